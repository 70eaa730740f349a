"""Hugging Face interop below the engine: the adapter registry, reading transformers files, config conversion.

Each family registers a :class:`dufu.models.hf_adapter.HFMapping` keyed by the transformers ``model_type``
(``gpt2``, ``llama``, ``bert`` ...): a name table, tensor transforms and a config map, which turn a
transformers ``config.json`` into the dufu model's constructor arguments and back, rename (and split / fuse /
transpose) tensors between the two layouts, and pick the dufu class for an HF architecture name.

Weights are read from ``model.safetensors`` (sharded ``model.safetensors.index.json`` too) or, failing
that, ``pytorch_model.bin`` with ``torch.load(weights_only=True)``, lazily (:mod:`dufu.models.hf_weights`): a
tensor is read only when the module being filled has a parameter of that name, and a tensor stored as-is
(:class:`~dufu.models.hf_weights.StoredTensor`) can be read one block at a time (safetensors ``get_slice``), so
a tensor-parallel or ZeRO rank reads only its own shard.

Filling a model with those weights (``dufu.from_pretrained``, ``model.pretrained=DIR``, a dufu run as the
source) composes models, materialisation and checkpoints, so it lives above: :mod:`dufu.engine.weights.pretrained`.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import dufu.models
from dufu.errors import DataError, DufuError
from dufu.models.base import contract_of
from dufu.models.hf_adapter import HFMapping
# StoredTensor is also imported from here (dufu.engine.inference.streaming, dufu.engine.inference.streaming_source)
from dufu.models.hf_weights import HFWeights, StoredTensor  # noqa: F401

# The registry's entries (one per transformers model_type) are HFMappings.
FamilyAdapter = HFMapping

_REGISTRY: dict[str, HFMapping] = {}


def register(adapter: HFMapping) -> HFMapping:
    _REGISTRY[adapter.model_type] = adapter
    return adapter


def _load_families() -> None:
    """Import every family's hf module so it registers itself (lazily: transformers is not needed)."""
    for info in pkgutil.iter_modules(dufu.models.__path__):
        if info.ispkg:
            try:
                importlib.import_module(f"dufu.models.{info.name}.hf")
            except ModuleNotFoundError as e:
                if e.name != f"dufu.models.{info.name}.hf":
                    raise


def adapters() -> dict[str, FamilyAdapter]:
    _load_families()
    return dict(_REGISTRY)


def adapter_for_model(model: nn.Module) -> FamilyAdapter:
    """The mapping ``model`` exports through and loads with: its family's, or the one its class carries
    (``hf_mapping``: a transformers model as-is, :class:`dufu.models.hf_auto.HFAutoModel`)."""
    own = contract_of(model).hf_mapping
    if own is not None:
        return own
    for ad in adapters().values():
        if isinstance(model, tuple(ad.dufu_classes)):
            return ad
    raise DufuError(f"{type(model).__name__} has no Hugging Face mapping; families with one: "
                    f"{', '.join(sorted(_REGISTRY))}.")


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise DataError(f"{path} is not a Hugging Face model directory: it has no config.json. Give the directory "
                        "that transformers' save_pretrained wrote (config.json + model.safetensors).")
    try:
        return json.loads(cfg.read_text())
    except ValueError as e:
        raise DataError(f"{cfg} is not valid JSON ({e}).") from None


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd = {}
        for f in files:
            sd.update(load_file(str(path / f)))
        return sd
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise DataError(f"{path} holds no weights: expected model.safetensors, model.safetensors.index.json or "
                    "pytorch_model.bin.")


def build_from_hf_config(hf_config: dict, architecture: Optional[str] = None, **overrides) -> nn.Module:
    """A randomly initialised dufu model shaped like ``hf_config``."""
    model_type = hf_config.get("model_type")
    table = adapters()
    if model_type not in table:
        raise DufuError(f"no dufu family for Hugging Face model_type {model_type!r}; dufu maps "
                        f"{', '.join(sorted(table))}. Any other architecture can still be trained as-is "
                        "(data parallel / ZeRO) with dufu.models.hf_auto.")
    ad = table[model_type]
    arch = architecture or (hf_config.get("architectures") or [ad.default_architecture])[0]
    if arch not in ad.classes:
        raise DufuError(f"architecture {arch!r} of {model_type} is not mapped; mapped: {', '.join(ad.classes)}.")
    kwargs = {**ad.config_from_hf(hf_config), **overrides}
    return ad.classes[arch](**kwargs)


def save_pretrained(model: nn.Module, path: str | Path, state_dict: Optional[dict] = None) -> Path:
    """Write config.json + model.safetensors that transformers' Auto classes load (``state_dict``: the values
    to write, for a model built on the meta device). A model carrying a delta is written by
    :func:`dufu.engine.weights.pretrained.save_pretrained` (``dufu.save_pretrained``), as a PEFT adapter or merged."""
    sd = state_dict if state_dict is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return write_hf_model(model, path, sd)


def write_hf_model(model: nn.Module, path: str | Path, sd: dict) -> Path:
    """config.json + model.safetensors of ``model`` with the tensors ``sd`` (dufu names)."""
    ad = adapter_for_model(model)
    hf_sd = ad.state_dict_to_hf(sd, model)
    hf_config = ad.config_to_hf(model)
    if hf_config.get("tie_word_embeddings", False):
        for k in ad.tied_hf_names(model):  # transformers ties them to the embedding on load
            hf_sd.pop(k, None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path


def hf_tensor_sources(adapter: HFMapping, module: nn.Module, path: str | Path) -> dict:
    """Readers of ``module``'s tensors from the Hugging Face directory ``path`` (nothing is read yet)."""
    return adapter.tensor_sources(HFWeights(path), module)


# Sizes that must agree between a model built from config and the pretrained weights poured into it.
STRUCTURAL_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "ffn_hidden_size", "max_position_embeddings")


def check_sizes_fit(module: nn.Module, source_kwargs: dict, what: str) -> None:
    """Sizes in a pretrained source's config that differ from ``module``'s are a DataError naming both."""
    wrong = [f"{k}={getattr(module, k)} (pretrained: {source_kwargs[k]})" for k in STRUCTURAL_SIZES
             if source_kwargs.get(k) is not None and getattr(module, k, None) is not None
             and getattr(module, k) != source_kwargs[k]]
    if wrong:
        raise DataError(f"{what} do not fit this {type(module).__name__}: {', '.join(wrong)}. Set model.* to "
                        "the pretrained sizes, or use model = L(dufu.engine.weights.pretrained.pretrained_model)(path=...), "
                        "which takes them from the pretrained config.")


def check_source_shape(what: str, module: nn.Module, key: str, value: torch.Tensor, target: torch.Tensor) -> None:
    """A pretrained tensor must have the (global) shape of the parameter it fills."""
    if tuple(value.shape) != tuple(target.shape):
        raise DataError(f"{what} do not fit {type(module).__name__}: {key} has shape {tuple(value.shape)} "
                        f"there but {tuple(target.shape)} in the model. Check model.* against the "
                        "pretrained model's config.")
