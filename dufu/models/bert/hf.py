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
from dufu.models.hf_adapter import ConfigField, HFConfigMap, HFMapping, id2label, in_first_block, label2id
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


def _check_encoder(hf: dict) -> dict:
    """A check across two keys no row can say: dufu's BERT/RoBERTa are encoders only."""
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise DufuError("BERT/RoBERTa as a decoder (is_decoder / add_cross_attention) is not supported.")
    return {}


# id2label / label2id: written only for a model with a classification head (one with ``num_labels``)
_LABEL_ROW = dict(optional=True, load=False, export="num_labels")


def _config(family: str) -> HFConfigMap:
    return HFConfigMap(
        fields=[
            ConfigField(None, "position_embedding_type", default=None, from_hf={"absolute": "absolute"},
                        hint="; dufu's BERT/RoBERTa use absolute positions", export=lambda m: "absolute"),
            ConfigField("vocab_size", "vocab_size"),
            ConfigField("hidden_size", "hidden_size"),
            ConfigField("num_layers", "num_hidden_layers"),
            ConfigField("num_attention_heads", "num_attention_heads"),
            ConfigField("ffn_hidden_size", "intermediate_size", default=lambda hf: 4 * hf["hidden_size"],
                        or_default=True, export=in_first_block("mlp.fc1.out_features", lambda m: 4 * m.hidden_size)),
            ConfigField("max_position_embeddings", "max_position_embeddings", default=512),
            ConfigField("type_vocab_size", "type_vocab_size", default=2),
            ConfigField("hidden_dropout", "hidden_dropout_prob", default=0.1, export="drop.p"),
            ConfigField("attention_dropout", "attention_probs_dropout_prob", default=0.1,
                        export=in_first_block("attn.attention_dropout", 0.0)),
            ConfigField("layernorm_epsilon", "layer_norm_eps", default=1e-12, export="ln_emb.eps"),
            ConfigField("activation", "hidden_act", default="gelu", from_hf=_ACT_FROM_HF, to_hf=_ACT_TO_HF),
            ConfigField("pad_token_id", "pad_token_id", default=0),
            ConfigField("initializer_range", "initializer_range", default=0.02),
            ConfigField("tie_word_embeddings", "tie_word_embeddings", default=True),
            # every head's arguments are read; _factory passes each class those it takes
            ConfigField("num_labels", "num_labels", or_default=True, save=False,
                        default=lambda hf: len(hf.get("id2label") or {}) or 2),
            ConfigField("classifier_dropout", "classifier_dropout", default=None, save=False),
            ConfigField("num_labels", "id2label", to_hf=id2label, **_LABEL_ROW),
            ConfigField("num_labels", "label2id", to_hf=label2id, **_LABEL_ROW),
        ],
        constants={"torch_dtype": "float32", **({"bos_token_id": 0, "eos_token_id": 2} if family == "roberta" else {})},
        more_from_hf=_check_encoder,
    )


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
        config=_config(family),
        default_architecture=classes[0].__name__,
        dufu_classes=tuple(classes),
    )


# RoBERTa first: its classes are subclasses of BERT's, so a model is matched by its own family.
MAPPINGS = [
    register(_mapping("roberta", (m.RobertaModel, m.RobertaForMaskedLM, m.RobertaForSequenceClassification))),
    register(_mapping("bert", (m.BertModel, m.BertForMaskedLM, m.BertForSequenceClassification))),
]
