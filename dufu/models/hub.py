"""Hugging Face interop: ``from_pretrained`` / ``save_pretrained`` for every dufu model family.

Each family registers an adapter keyed by the transformers ``model_type`` (``gpt2``, ``llama``,
``bert`` ...). An adapter knows how to

* turn a transformers ``config.json`` into the dufu model's constructor arguments and back,
* rename (and split / fuse / transpose) tensors between the two state-dict layouts,
* pick the dufu class for an HF architecture name (a headless ``BertModel`` loads as the encoder alone).

Weights are read from ``model.safetensors`` (sharded ``model.safetensors.index.json`` too) or, failing
that, ``pytorch_model.bin`` with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from dufu.errors import DataError, DufuError


@dataclass
class FamilyAdapter:
    model_type: str                                   # transformers' config.model_type
    classes: dict[str, Callable[..., nn.Module]]      # HF architecture name -> dufu class (or factory)
    config_from_hf: Callable[[dict], dict]            # HF config dict -> dufu kwargs
    config_to_hf: Callable[[nn.Module], dict]         # dufu model -> HF config dict (with "architectures")
    state_dict_from_hf: Callable[[dict, nn.Module], dict]
    state_dict_to_hf: Callable[[dict, nn.Module], dict]
    default_architecture: str = ""
    dufu_classes: tuple = field(default_factory=tuple)  # dufu classes this adapter exports


_REGISTRY: dict[str, FamilyAdapter] = {}


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    _REGISTRY[adapter.model_type] = adapter
    return adapter


def _load_families() -> None:
    """Import every family's hf module so it registers itself (lazily: transformers is not needed)."""
    import importlib
    import pkgutil

    import dufu.models as models

    for info in pkgutil.iter_modules(models.__path__):
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
    from safetensors.torch import load_file

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


def from_pretrained(path: str | Path, architecture: Optional[str] = None, **overrides) -> nn.Module:
    """Load a Hugging Face model directory into the matching dufu model (fp32, eval mode off)."""
    hf_config = read_hf_config(path)
    ad = adapters().get(hf_config.get("model_type"))
    model = build_from_hf_config(hf_config, architecture, **overrides)
    sd = ad.state_dict_from_hf(read_hf_state_dict(path), model)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k not in getattr(model, "tied_parameter_names", {})]
    if missing or unexpected:
        raise DataError(f"the weights in {path} do not fit {type(model).__name__}: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}.")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def save_pretrained(model: nn.Module, path: str | Path, state_dict: Optional[dict] = None) -> Path:
    """Write config.json + model.safetensors that transformers' Auto classes load."""
    from safetensors.torch import save_file

    ad = adapter_for_model(model)
    sd = state_dict if state_dict is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    hf_sd = ad.state_dict_to_hf(sd, model)
    hf_config = ad.config_to_hf(model)
    if hf_config.get("tie_word_embeddings", False):
        for k in list(hf_sd):
            if k in hf_config.get("_tied_hf_keys", ()):
                hf_sd.pop(k)
    hf_config.pop("_tied_hf_keys", None)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return path
