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

import torch

from dufu.errors import DufuError
from dufu.models.hub import StoredTensor

_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
                "silu": "silu", "swish": "silu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# dufu name (inside a block) -> transformers name (inside encoder.layer.i)
_BLOCK_NAMES = (
    ("attn.q_proj", "attention.self.query"),
    ("attn.k_proj", "attention.self.key"),
    ("attn.v_proj", "attention.self.value"),
    ("attn.out_proj", "attention.output.dense"),
    ("ln1", "attention.output.LayerNorm"),
    ("mlp.fc1", "intermediate.dense"),
    ("mlp.fc2", "output.dense"),
    ("ln2", "output.LayerNorm"),
)
_ENCODER_NAMES = (
    ("wte", "embeddings.word_embeddings"),
    ("wpe", "embeddings.position_embeddings"),
    ("token_types", "embeddings.token_type_embeddings"),
    ("ln_emb", "embeddings.LayerNorm"),
    ("pooler.dense", "pooler.dense"),
)
# Head modules: (dufu module, transformers module) per family; these are not under the encoder's prefix.
_HEAD_NAMES = {
    "bert": (
        ("mlm_transform.dense", "cls.predictions.transform.dense"),
        ("mlm_transform.ln", "cls.predictions.transform.LayerNorm"),
        ("lm_head.weight", "cls.predictions.decoder.weight"),
        ("lm_head.bias", "cls.predictions.bias"),
        ("classifier", "classifier"),
    ),
    "roberta": (
        ("mlm_transform.dense", "lm_head.dense"),
        ("mlm_transform.ln", "lm_head.layer_norm"),
        ("lm_head.weight", "lm_head.decoder.weight"),
        ("lm_head.bias", "lm_head.bias"),
        ("classifier", "classifier"),
    ),
}
# The other name transformers also stores the output bias under (tied to the first).
_BIAS_TWIN = {"bert": "cls.predictions.decoder.bias", "roberta": "lm_head.decoder.bias"}


def _rename(name: str, table) -> str | None:
    for ours, theirs in table:
        if name == ours or name.startswith(ours + "."):
            return theirs + name[len(ours):]
    return None


def hf_name(name: str, family: str, prefixed: bool) -> str:
    """The transformers name of dufu tensor ``name``; ``prefixed``: the encoder sits under ``bert.``/``roberta.``
    (every architecture with a head)."""
    prefix = f"{family}." if prefixed else ""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        inner = _rename(rest, _BLOCK_NAMES)
        if inner is not None:
            return f"{prefix}encoder.layer.{i}.{inner}"
    encoder = _rename(name, _ENCODER_NAMES)
    if encoder is not None:
        return prefix + encoder
    head = _rename(name, _HEAD_NAMES[family])
    if head is not None:
        return head
    raise DufuError(f"dufu tensor {name!r} has no {family} name in transformers")


def _is_prefixed(model) -> bool:
    from dufu.models.bert.model import BertModel

    return not isinstance(model, BertModel)


def state_dict_from_hf(hf_sd, model, family: str) -> dict:
    """transformers tensors (with or without the ``bert.``/``roberta.`` prefix; a dict or a lazy mapping) ->
    ``model``'s tensors, as zero-argument callables that read one each: only the tensors ``model`` has are
    returned (a pipeline stage reads its own), and a missing one is left for the caller to report."""
    prefix = f"{family}."

    def stored(theirs: str):
        return theirs if theirs in hf_sd else (prefix + theirs if prefix + theirs in hf_sd else None)

    out, fresh = {}, []
    own = model.state_dict()
    for name in own:
        key = stored(hf_name(name, family, prefixed=False))
        if key is None and name == "lm_head.bias":
            key = stored(_BIAS_TWIN[family])
        if key is not None:
            out[name] = StoredTensor(hf_sd, key)
        elif name == "lm_head.weight" and model.tie_word_embeddings and stored(hf_name("wte.weight", family, False)):
            out[name] = StoredTensor(hf_sd, stored(hf_name("wte.weight", family, False)))
        elif name.startswith(model.newly_initialized_prefixes):
            # A task head the checkpoint (e.g. a bare encoder) lacks keeps the model's own initialisation.
            out[name] = own[name]
            fresh.append(name)
    if fresh:
        warnings.warn(f"{type(model).__name__}: {', '.join(fresh)} are not in the checkpoint and keep their "
                      "fresh initialisation; train them (fine-tuning) before use.", stacklevel=2)
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], model, family: str) -> dict[str, torch.Tensor]:
    """dufu tensors -> the tensors of the transformers class ``model`` exports as."""
    prefixed = _is_prefixed(model)
    out = {hf_name(name, family, prefixed): t for name, t in sd.items()}
    if "lm_head.bias" in sd:
        out[_BIAS_TWIN[family]] = sd["lm_head.bias"].clone()  # one tensor there, stored under both names
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
    # The tied output projection is not written: transformers ties it to the embedding on load.
    cfg["_tied_hf_keys"] = [hf_name("lm_head.weight", family, True)] if model.tie_word_embeddings else []
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


def _register() -> None:
    from dufu.models.bert import model as m
    from dufu.models.hub import FamilyAdapter, register

    families = {
        # RoBERTa first: its classes are subclasses of BERT's, so a model is matched by its own family.
        "roberta": (m.RobertaModel, m.RobertaForMaskedLM, m.RobertaForSequenceClassification),
        "bert": (m.BertModel, m.BertForMaskedLM, m.BertForSequenceClassification),
    }
    for family, classes in families.items():
        register(FamilyAdapter(
            model_type=family,
            classes={cls.__name__: _factory(cls) for cls in classes},
            config_from_hf=config_from_hf,
            config_to_hf=lambda model, family=family: config_to_hf(model, family, type(model).__name__),
            state_dict_from_hf=lambda sd, model, family=family: state_dict_from_hf(sd, model, family),
            state_dict_to_hf=lambda sd, model, family=family: state_dict_to_hf(sd, model, family),
            default_architecture=classes[0].__name__,
            dufu_classes=classes,
            lazy=True,
        ))


_register()
