"""Map dufu's BERT/RoBERTa models to and from Hugging Face transformers' (model_type "bert" and "roberta").

transformers keeps the same tensors under longer names (``encoder.layer.3.attention.self.query.weight`` is
dufu's ``blocks.3.attn.q_proj.weight``), and prefixes the encoder of a model with a head by ``bert.`` or
``roberta.``; the heads sit beside it (``cls.predictions.*``, ``lm_head.*``, ``classifier.*``). No tensor is
split, fused or transposed: both sides use ``nn.Linear`` layouts. The masked-LM output projection is tied to the
token embedding, and its bias is stored twice by transformers (``...decoder.bias`` and ``...bias``, one tensor).
"""

from __future__ import annotations

import inspect
import warnings

from dufu.errors import DufuError
from dufu.models.bert import model as m
from dufu.models.hf_adapter import HFMapping
from dufu.models.hub import register

_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                "silu": "silu", "swish": "silu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# The encoder sits under ``bert.`` / ``roberta.`` in every architecture with a head ({prefix}).
_ENCODER_NAMES = [
    ("blocks.{i}.attn.q_proj", "{prefix}encoder.layer.{i}.attention.self.query"),
    ("blocks.{i}.attn.k_proj", "{prefix}encoder.layer.{i}.attention.self.key"),
    ("blocks.{i}.attn.v_proj", "{prefix}encoder.layer.{i}.attention.self.value"),
    ("blocks.{i}.attn.out_proj", "{prefix}encoder.layer.{i}.attention.output.dense"),
    ("blocks.{i}.ln1", "{prefix}encoder.layer.{i}.attention.output.LayerNorm"),
    ("blocks.{i}.mlp.fc1", "{prefix}encoder.layer.{i}.intermediate.dense"),
    ("blocks.{i}.mlp.fc2", "{prefix}encoder.layer.{i}.output.dense"),
    ("blocks.{i}.ln2", "{prefix}encoder.layer.{i}.output.LayerNorm"),
    ("wte", "{prefix}embeddings.word_embeddings"),
    ("wpe", "{prefix}embeddings.position_embeddings"),
    ("token_types", "{prefix}embeddings.token_type_embeddings"),
    ("ln_emb", "{prefix}embeddings.LayerNorm"),
    ("pooler.dense", "{prefix}pooler.dense"),
]
# The heads sit beside the encoder. transformers stores the output bias twice (one tensor): both are read.
_HEAD_NAMES = {
    "bert": [
        ("mlm_transform.dense", "cls.predictions.transform.dense"),
        ("mlm_transform.ln", "cls.predictions.transform.LayerNorm"),
        ("lm_head.weight", ("cls.predictions.decoder.weight", "{prefix}embeddings.word_embeddings.weight")),
        ("lm_head.bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
        ("classifier", "classifier"),
    ],
    "roberta": [
        ("mlm_transform.dense", "lm_head.dense"),
        ("mlm_transform.ln", "lm_head.layer_norm"),
        ("lm_head.weight", ("lm_head.decoder.weight", "{prefix}embeddings.word_embeddings.weight")),
        ("lm_head.bias", ("lm_head.bias", "lm_head.decoder.bias")),
        ("classifier", "classifier"),
    ],
}


def _finish_sources(hf, model, out: dict) -> dict:
    """The table lets an output head missing from the checkpoint read the embedding: only a tied head may. A
    task head the checkpoint (e.g. a bare encoder) lacks keeps the model's own initialisation, with a warning."""
    own = model.state_dict()
    head = out.get("lm_head.weight")
    if head is not None and not model.tie_word_embeddings and head.key.endswith("embeddings.word_embeddings.weight"):
        del out["lm_head.weight"]
    fresh = [name for name in own if name not in out and name.startswith(model.newly_initialized_prefixes)]
    for name in fresh:
        out[name] = own[name]
    if fresh:
        warnings.warn(f"{type(model).__name__}: {', '.join(fresh)} are not in the checkpoint and keep their "
                      "fresh initialisation; train them (fine-tuning) before use.", stacklevel=3)
    return out


def config_from_hf(hf: dict) -> dict:
    """Constructor keyword arguments (encoder and every head's) from a transformers BertConfig/RobertaConfig dict."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise DufuError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported; dufu's "
                        "BERT/RoBERTa use absolute positions.")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise DufuError("BERT/RoBERTa as a decoder (is_decoder / add_cross_attention) is not supported.")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACT_FROM_HF:
        raise DufuError(f"hidden_act {act!r} is not supported; known: {sorted(_ACT_FROM_HF)}")
    id2label = hf.get("id2label") or {}
    num_labels = hf.get("num_labels") or len(id2label) or 2
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf.get("intermediate_size") or 4 * hf["hidden_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
        activation=_ACT_FROM_HF[act],
        pad_token_id=hf.get("pad_token_id", 0),
        initializer_range=hf.get("initializer_range", 0.02),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        num_labels=num_labels,
        classifier_dropout=hf.get("classifier_dropout"),
    )


def config_to_hf(model, family: str, architecture: str) -> dict:
    blocks = list(model.blocks.values())
    cfg = {
        "architectures": [architecture],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": blocks[0].mlp.fc1.out_features if blocks else 4 * model.hidden_size,
        "hidden_act": _ACT_TO_HF[model.activation],
        "hidden_dropout_prob": model.drop.p,
        "attention_probs_dropout_prob": blocks[0].attn.attention_dropout if blocks else 0.0,
        "max_position_embeddings": model.max_position_embeddings,
        "type_vocab_size": model.type_vocab_size,
        "initializer_range": model.initializer_range,
        "layer_norm_eps": model.ln_emb.eps,
        "pad_token_id": model.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": model.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if family == "roberta":
        cfg.update(bos_token_id=0, eos_token_id=2)
    if hasattr(model, "num_labels"):
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
        cfg["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    return cfg


# Constructor arguments only some classes take; config_from_hf gives them all.
_HEAD_KWARGS = {"tie_word_embeddings", "num_labels", "classifier_dropout", "add_pooling_layer"}


def _factory(cls):
    accepted = {name for klass in cls.__mro__ if "__init__" in vars(klass)
                for name in inspect.signature(vars(klass)["__init__"]).parameters}

    def build(**kwargs):
        return cls(**{k: v for k, v in kwargs.items() if k not in _HEAD_KWARGS or k in accepted})

    build.__name__ = cls.__name__
    return build


def _mapping(family: str, classes) -> HFMapping:
    head_names = _HEAD_NAMES[family]
    return HFMapping(
        model_type=family,
        classes={cls.__name__: _factory(cls) for cls in classes},
        names=_ENCODER_NAMES + head_names,
        load_renames=[(rf"^{family}\.", "")],  # the encoder's names are looked up without the prefix
        save_prefix=lambda model: "" if isinstance(model, m.BertModel) else f"{family}.",
        also_saved_as={head_names[3][1][0]: head_names[3][1][1]},
        finish_sources=_finish_sources,
        config_from_hf=config_from_hf,
        config_to_hf=lambda model: config_to_hf(model, family, type(model).__name__),
        default_architecture=classes[0].__name__,
        dufu_classes=tuple(classes),
    )


# RoBERTa first: its classes are subclasses of BERT's, so a model is matched by its own family.
MAPPINGS = [
    register(_mapping("roberta", (m.RobertaModel, m.RobertaForMaskedLM, m.RobertaForSequenceClassification))),
    register(_mapping("bert", (m.BertModel, m.BertForMaskedLM, m.BertForSequenceClassification))),
]
