"""Pretrained weights into a dufu model: the step that composes models, materialisation, checkpoints and configs.

Building a model never reads a file: a constructor given ``pretrained=DIR`` (``model.pretrained=DIR`` in a
config) only records ``pretrained_path``. Whoever builds the model loads it, here:

* the trainer builds on the meta device, splits and shards, and fills each rank's part through
  :func:`pretrained_source` (see :mod:`dufu.parallel.materialize`): a pipeline stage reads only its own
  tensors, and a tensor-parallel or ZeRO rank reads only its block of each tensor stored as-is
  (:class:`dufu.models.hf_weights.StoredTensor`);
* :func:`load_pretrained` fills a model already built on a real device, in place;
* :func:`from_pretrained` and :func:`pretrained_model` build the model from the source's own config and fill it.

A source is a Hugging Face directory (read through the family's adapter, :mod:`dufu.models.hub`) or a dufu
run (``output_dir``, ``output_dir/checkpoints`` or ``.../step_N``), read through
``torch.distributed.checkpoint`` with the module's own keys.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dufu.config import LazyConfig, instantiate
from dufu.delta import peft
from dufu.delta.lora import lora_layers
from dufu.delta.peft import load_adapter
from dufu.engine.weights.checkpoint import Checkpointer, SafeFileSystemReader, SafeLoadPlanner
from dufu.errors import DataError, DufuError
from dufu.models.hub import (
    STRUCTURAL_SIZES,
    adapter_for_model,
    adapters,
    build_from_hf_config,
    check_sizes_fit,
    check_source_shape,
    hf_tensor_sources,
    read_hf_config,
    write_hf_model,
)
from dufu.parallel.materialize import materialize_
from dufu.models.base import contract_of


def resolve_dufu_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory (``step_N`` with a manifest) that ``path`` names or holds the latest of."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir():
            latest = Checkpointer(root).latest()
            if latest is not None:
                return latest
    raise DataError(f"{path} holds no complete dufu checkpoint (no checkpoints/step_N with a manifest.json). "
                    "Give a Hugging Face directory (config.json + model.safetensors), a run's output_dir or a "
                    "checkpoint directory.")


def dufu_checkpoint_tensors(ckpt: Path, module: nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """Only ``keys`` of the checkpoint's model state, read by DCP into fresh tensors (tied names resolved)."""
    reader = SafeFileSystemReader(str(ckpt))
    available = reader.read_metadata().state_dict_metadata
    aliases = {}
    for a, b in contract_of(module).tied_parameter_names.items():
        aliases[a], aliases[b] = b, a
    wanted, names = {}, {}
    own = module.state_dict()
    for key in keys:
        stored = key if f"model.{key}" in available else aliases.get(key)
        if stored is None or f"model.{stored}" not in available:
            continue
        ref = own[key]
        wanted[stored] = torch.empty(ref.shape, dtype=available[f"model.{stored}"].properties.dtype)
        names.setdefault(stored, []).append(key)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load({"model": wanted}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {key: t for stored, t in wanted.items() for key in names[stored]}


def check_pretrained(module: nn.Module, path: str | Path, check_sizes: bool = True):
    """Where ``path``'s weights come from, checked without reading a tensor: ``(what, adapter, None)`` for a
    Hugging Face directory, ``(what, None, checkpoint_dir)`` for a dufu run or checkpoint. A missing path, or
    sizes in the source's config that differ from ``module``'s, is a DataError naming both (the start-up
    checks of ``dufu train --nproc`` run this before any worker starts)."""
    path = Path(path)
    if (path / "config.json").is_file():
        hf_config = read_hf_config(path)
        ad = adapters().get(hf_config.get("model_type"))
        if ad is None or not isinstance(module, tuple(ad.dufu_classes)):
            ad = adapter_for_model(module)
        what = f"the Hugging Face weights in {path}"
        if check_sizes:
            check_sizes_fit(module, ad.config_from_hf(hf_config), what)
        return what, ad, None
    if path.exists():
        ckpt = resolve_dufu_checkpoint(path)
        what = f"the dufu checkpoint {ckpt}"
        if check_sizes and (ckpt / "config.yaml").is_file():
            node = LazyConfig.load(str(ckpt / "config.yaml")).model
            check_sizes_fit(module, {k: node.get(k) for k in STRUCTURAL_SIZES}, what)
        return what, None, ckpt
    raise DataError(f"pretrained weights {path} do not exist. Give a Hugging Face directory "
                    "(config.json + model.safetensors), a dufu run's output_dir or a checkpoint directory.")


def pretrained_source(module: nn.Module, path: str | Path, strict: bool = False,
                      check_sizes: bool = True) -> tuple[str, dict]:
    """What :func:`load_pretrained` would copy into ``module``, unread: ``(what, source)``, where ``what``
    names the source for messages and ``source`` maps each of ``module``'s tensor names to a tensor or a
    zero-argument callable that reads it. Sizes that differ from the source's config or a parameter the
    source lacks is an error naming both; ``strict`` also refuses source tensors ``module`` has no place for.
    ``module`` may be a pipeline stage or hold sharded tensors: only its names and global shapes are used."""
    own = module.state_dict()
    tied = contract_of(module).tied_parameter_names
    what, ad, ckpt = check_pretrained(module, path, check_sizes)
    if ad is not None:
        source = hf_tensor_sources(ad, module, path)
    else:
        source = dufu_checkpoint_tensors(ckpt, module, list(own))
    delta = contract_of(module).delta_info
    added = set(delta.added if delta is not None else ())  # a delta's own: in no base
    missing = [k for k in own if k not in source and k not in tied and k not in added]
    unexpected = [k for k in source if k not in own] if strict else []
    if missing or unexpected:
        raise DataError(f"{what} do not fit {type(module).__name__}: missing {missing[:5]}, unexpected "
                        f"{unexpected[:5]}. Check that model.* (sizes, layers, biases) matches the pretrained model.")
    return what, {k: v for k, v in source.items() if k in own}


@torch.no_grad()
def load_pretrained(module: nn.Module, path: Optional[str | Path] = None, strict: bool = False,
                    check_sizes: bool = True) -> nn.Module:
    """Copy pretrained weights into ``module`` in place, from a Hugging Face directory (through the
    family's adapter) or a dufu checkpoint; ``path`` defaults to the ``pretrained_path`` the constructor
    recorded. ``module`` may be part of a model (a pipeline stage): only the tensors it holds are read
    (see :func:`pretrained_source` for the checks)."""
    path = contract_of(module).pretrained_path if path is None else path
    if path is None:
        raise DufuError(f"{type(module).__name__} was built without pretrained weights (pretrained=None) and no "
                        "path was given to load_pretrained.")
    if any(p.is_meta for p in module.parameters()):
        raise DufuError("load_pretrained needs a materialised module (to_empty + init_weights first), "
                        "not one on the meta device.")
    what, source = pretrained_source(module, path, strict, check_sizes)
    for key, target in module.state_dict().items():
        if key not in source:
            continue  # a tied name served by its twin
        value = source[key]
        value = value() if callable(value) else value
        check_source_shape(what, module, key, value, target)
        target.copy_(value)
    contract_of(module).tie_weights()
    return module


def _filled(model: nn.Module, path: str | Path, strict: bool = False) -> nn.Module:
    """A meta-built ``model`` (built from ``path``'s own config) allocated on the CPU and filled from ``path``:
    the source's tensors are read one at a time into place, and only what it lacks (buffers, a new task head)
    is initialised (seeded from torch's global generator), so no random full model is made first."""
    seed = int(torch.randint(0, 2**62, ()).item())
    return materialize_(model, model, torch.device("cpu"), seed=seed,
                        pretrained=lambda m: pretrained_source(m, path, strict=strict, check_sizes=False))


def from_pretrained(path: str | Path, architecture: Optional[str] = None, adapter: Optional[str | Path] = None,
                    **overrides) -> nn.Module:
    """Load a Hugging Face model directory into the matching dufu model (fp32, training mode).

    ``adapter``: a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to add, unmerged:
    its target modules become LoRA layers with its rank, alpha and scaling, and only the adapter trains
    (:func:`dufu.delta.peft.load_adapter`); ``dufu.save_pretrained`` writes it back in PEFT's format."""
    with torch.device("meta"):
        model = build_from_hf_config(read_hf_config(path), architecture, **overrides)
    model = _filled(model, path, strict=True)
    model.pretrained_path = str(path)  # the base an adapter written from this model names
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def pretrained_model(path: str | Path, architecture: Optional[str] = None, **overrides) -> nn.Module:
    """A model built from a pretrained source's own config, with its weights: ``model =
    L(pretrained_model)(path=DIR)`` in a config. ``path``: a Hugging Face directory or a dufu run /
    checkpoint (whose config.yaml gives the architecture). ``overrides``: constructor arguments to change
    (e.g. dropout). Under ``torch.device("meta")`` (start-up checks, the trainer's build) only the shapes
    are built and ``pretrained_path`` is recorded for the trainer to fill shard by shard."""
    path = Path(path)
    meta = torch.empty(0).is_meta
    if (path / "config.json").is_file():
        with torch.device("meta"):
            model = build_from_hf_config(read_hf_config(path), architecture, **overrides)
    else:
        ckpt = resolve_dufu_checkpoint(path)
        cfg_file = ckpt / "config.yaml"
        if not cfg_file.is_file():
            raise DataError(f"checkpoint {ckpt} has no config.yaml, so its model cannot be identified.")
        node = LazyConfig.load(str(cfg_file)).model
        for k, v in overrides.items():
            node[k] = v
        if "pretrained" in node:
            node["pretrained"] = None  # the checkpoint's own weights replace those it started from
        with torch.device("meta"):
            model = instantiate(node)  # shapes only
        if not meta and contract_of(model).init_module is None:
            raise DufuError(f"{type(model).__name__} has no init_module(), so it cannot be materialised "
                            "from a meta-device build to load a checkpoint into.")
    if meta:
        model.pretrained_path = str(path)  # read later, shard by shard (dufu.parallel.materialize)
        return model
    return _filled(model, path)  # built from the source's own config


def save_pretrained(model: nn.Module, path: str | Path, state_dict: Optional[dict] = None, merge: bool = False,
                    base: Optional[str | Path] = None) -> Path:
    """``dufu.save_pretrained``: config.json + model.safetensors that transformers' Auto classes load.

    A model carrying LoRA layers (:mod:`dufu.delta`) is written as a PEFT adapter instead
    (adapter_config.json + adapter_model.safetensors, which ``peft.PeftModel.from_pretrained`` loads onto its
    base; ``base``: the base's Hugging Face directory, see :func:`dufu.delta.peft.save_adapter`), or with
    ``merge=True`` as the plain model with the LoRA updates folded into the weights. ``state_dict``: the
    values to write, for a model built on the meta device."""
    peft.check_lora_only(model)
    sd = state_dict if state_dict is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if lora_layers(model):
        if not merge:
            out = peft.save_adapter(model, path, sd, base=base)
            give_default_mode(out / peft.ADAPTER_WEIGHTS, out / "base" / "model.safetensors")
            return out
        sd = peft.merged_state_dict(model, sd)
    out = write_hf_model(model, path, sd)
    give_default_mode(out / "model.safetensors")
    return out


def give_default_mode(*files: Path) -> None:
    """Give the weight files just written (those of ``files`` that exist) the mode every other file of the
    directory has: what a plain ``open()`` creates, 0o666 less the umask (0o644 under the usual umask 022).
    safetensors' ``save_file`` writes a temporary file and renames it, which leaves it readable by its owner only
    (0o600), so that others sharing the directory could read config.json but not the weights."""
    mask = os.umask(0o022)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    for f in files:
        if Path(f).is_file():
            os.chmod(f, 0o666 & ~mask)


@dataclass
class Pretrained:
    """Where ``model.pretrained`` weights come in. ``source``: a Hugging Face directory, read into each part as
    it is materialized. ``checkpoint``: a dufu run, which all ranks read together through DCP once the parts
    exist. Both None: no pretrained weights, or a resumed run (its checkpoint replaces every weight)."""

    path: Optional[str] = None
    source: Optional[Callable] = None
    checkpoint: Optional[Path] = None


def pretrained_weights(model: nn.Module, resume_from: Optional[Path]) -> Pretrained:
    """Check ``model.pretrained`` (the path and the sizes; nothing is read) and say how it will be loaded."""
    path = contract_of(model).pretrained_path
    if path is None or resume_from is not None:
        return Pretrained(path)
    *_, checkpoint = check_pretrained(model, path)
    if checkpoint is not None:
        return Pretrained(path, checkpoint=checkpoint)
    return Pretrained(path, source=lambda part: pretrained_source(part, path))
