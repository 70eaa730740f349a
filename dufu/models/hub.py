"""Hugging Face interop: ``from_pretrained`` / ``save_pretrained`` for every dufu model family.

Each family registers an adapter keyed by the transformers ``model_type`` (``gpt2``, ``llama``,
``bert`` ...). An adapter knows how to

* turn a transformers ``config.json`` into the dufu model's constructor arguments and back,
* rename (and split / fuse / transpose) tensors between the two state-dict layouts,
* pick the dufu class for an HF architecture name (a headless ``BertModel`` loads as the encoder alone).

Weights are read from ``model.safetensors`` (sharded ``model.safetensors.index.json`` too) or, failing
that, ``pytorch_model.bin`` with ``torch.load(weights_only=True)``.

Starting a run from pretrained weights (``model.pretrained=DIR`` on a model config, or
``model = L(pretrained_model)(path=DIR)``) goes through :func:`load_pretrained`. It reads lazily: the
safetensors files are opened with ``safe_open`` and a tensor is read only when the module being loaded
has a parameter of that name, one tensor at a time, straight into the parameter (an adapter may return
zero-argument callables instead of tensors for that purpose). So a module that holds part of a model —
a pipeline stage with the other stages' blocks deleted — reads only its own tensors. A dufu checkpoint
(``output_dir``, ``output_dir/checkpoints`` or ``.../step_N``) is read the same way, through
``torch.distributed.checkpoint`` with the module's own keys. The trainer builds the model on the meta
device, splits and shards it, and fills each rank's part through :func:`pretrained_source` (see
:mod:`dufu.parallel.materialize`): a pipeline stage reads only its own tensors, and a tensor-parallel or
ZeRO rank reads only its block of each tensor stored as-is (:class:`StoredTensor`, safetensors ``get_slice``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

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
    # True: state_dict_from_hf takes a lazy Mapping (HFWeights), returns only the keys the given module holds,
    # and may return zero-argument callables that read a tensor when called (see load_pretrained).
    lazy: bool = False


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
    """Load a Hugging Face model directory into the matching dufu model (fp32, training mode)."""
    with torch.device("meta"):
        model = build_from_hf_config(read_hf_config(path), architecture, **overrides)
    return _filled(model, path, strict=True)


def _filled(model: nn.Module, path: str | Path, strict: bool = False) -> nn.Module:
    """A meta-built ``model`` (built from ``path``'s own config) allocated on the CPU and filled from ``path``:
    the source's tensors are read one at a time into place, and only what it lacks (buffers, a new task head)
    is initialised (seeded from torch's global generator), so no random full model is made first."""
    from dufu.parallel.materialize import materialize_

    seed = int(torch.randint(0, 2**62, ()).item())
    return materialize_(model, model, torch.device("cpu"), seed=seed,
                        pretrained=lambda m: pretrained_source(m, path, strict=strict, check_sizes=False))


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


# --------------------------------------------------------------------------- lazy loading
class HFWeights(Mapping):
    """The tensors of a Hugging Face model directory, read one at a time on access (``safe_open``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._eager: Optional[dict] = None
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                self._files = {k: single for k in f.keys()}
        elif index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {k: self.path / f for k, f in weight_map.items()}
        elif (self.path / "pytorch_model.bin").is_file():
            # memory-mapped: tensors are paged in when used
            self._eager = torch.load(self.path / "pytorch_model.bin", map_location="cpu", weights_only=True,
                                     mmap=True)
        else:
            raise DataError(f"{self.path} holds no weights: expected model.safetensors, "
                            "model.safetensors.index.json or pytorch_model.bin.")

    def _handle(self, key: str):
        file = self._files[key]
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._eager is not None:
            return self._eager[key]
        return self._handle(key).get_tensor(key)

    def read_slice(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Only ``tensor[index]`` of a stored tensor (safetensors reads just those bytes)."""
        if self._eager is not None:
            return self._eager[key][index]
        return self._handle(key).get_slice(key)[index]

    def shape_of(self, key: str) -> tuple[int, ...]:
        if self._eager is not None:
            return tuple(self._eager[key].shape)
        return tuple(self._handle(key).get_slice(key).get_shape())

    def __contains__(self, key) -> bool:
        return key in (self._eager if self._eager is not None else self._files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._eager if self._eager is not None else self._files)

    def __len__(self) -> int:
        return len(self._eager if self._eager is not None else self._files)


class StoredTensor:
    """A tensor stored as-is (renamed only) under ``key`` in ``weights`` (an :class:`HFWeights` or a dict):
    called, it reads the whole tensor; ``read_slice(index)`` reads just a block of it, which lets a
    tensor-parallel or ZeRO rank read only its own shard (:mod:`dufu.parallel.materialize`)."""

    def __init__(self, weights, key: str):
        self.weights, self.key = weights, key

    def __call__(self) -> torch.Tensor:
        return self.weights[self.key]

    @property
    def shape(self) -> tuple[int, ...]:
        w = self.weights
        return w.shape_of(self.key) if isinstance(w, HFWeights) else tuple(w[self.key].shape)

    def read_slice(self, index: tuple[slice, ...]) -> torch.Tensor:
        w = self.weights
        return w.read_slice(self.key, index) if isinstance(w, HFWeights) else w[self.key][index]


def renamed_sources(hf, rules, wanted: Mapping[str, str]) -> dict[str, Callable[[], torch.Tensor]]:
    """Readers for a lazy adapter whose transformers names changed between versions: every stored name of
    ``hf`` (a dict or :class:`HFWeights`; only names are looked at) is normalised by the regex ``rules``
    ``[(pattern, replacement), ...]``, and each dufu name in ``wanted`` (dufu name -> normalised transformers
    name) present there gets a zero-argument callable that reads its tensor."""
    import re

    stored = {}
    for key in hf:
        name = key
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        stored[name] = key
    return {ours: StoredTensor(hf, stored[theirs]) for ours, theirs in wanted.items() if theirs in stored}


def _resolve_dufu_checkpoint(path: str | Path) -> Path:
    from dufu.engine.checkpoint import Checkpointer

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


def _dufu_checkpoint_tensors(ckpt: Path, module: nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """Only ``keys`` of the checkpoint's model state, read by DCP into fresh tensors (tied names resolved)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from dufu.engine.checkpoint import SafeFileSystemReader, SafeLoadPlanner

    reader = SafeFileSystemReader(str(ckpt))
    available = reader.read_metadata().state_dict_metadata
    aliases = {}
    for a, b in getattr(module, "tied_parameter_names", {}).items():
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


# Sizes that must agree between a model built from config and the pretrained weights poured into it.
_STRUCTURAL = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "ffn_hidden_size", "max_position_embeddings")


def _check_sizes(module: nn.Module, source_kwargs: dict, what: str) -> None:
    wrong = [f"{k}={getattr(module, k)} (pretrained: {source_kwargs[k]})" for k in _STRUCTURAL
             if source_kwargs.get(k) is not None and getattr(module, k, None) is not None
             and getattr(module, k) != source_kwargs[k]]
    if wrong:
        raise DataError(f"{what} do not fit this {type(module).__name__}: {', '.join(wrong)}. Set model.* to "
                        "the pretrained sizes, or use model = L(dufu.models.hub.pretrained_model)(path=...), "
                        "which takes them from the pretrained config.")


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
            _check_sizes(module, ad.config_from_hf(hf_config), what)
        return what, ad, None
    if path.exists():
        from dufu.config import LazyConfig

        ckpt = _resolve_dufu_checkpoint(path)
        what = f"the dufu checkpoint {ckpt}"
        if check_sizes and (ckpt / "config.yaml").is_file():
            node = LazyConfig.load(str(ckpt / "config.yaml")).model
            _check_sizes(module, {k: node.get(k) for k in _STRUCTURAL}, what)
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
    tied = getattr(module, "tied_parameter_names", {})
    what, ad, ckpt = check_pretrained(module, path, check_sizes)
    if ad is not None:
        source = ad.state_dict_from_hf(HFWeights(path) if ad.lazy else read_hf_state_dict(path), module)
    else:
        source = _dufu_checkpoint_tensors(ckpt, module, list(own))
    missing = [k for k in own if k not in source and k not in tied]
    unexpected = [k for k in source if k not in own] if strict else []
    if missing or unexpected:
        raise DataError(f"{what} do not fit {type(module).__name__}: missing {missing[:5]}, unexpected "
                        f"{unexpected[:5]}. Check that model.* (sizes, layers, biases) matches the pretrained model.")
    return what, {k: v for k, v in source.items() if k in own}


def check_source_shape(what: str, module: nn.Module, key: str, value: torch.Tensor, target: torch.Tensor) -> None:
    """A pretrained tensor must have the (global) shape of the parameter it fills."""
    if tuple(value.shape) != tuple(target.shape):
        raise DataError(f"{what} do not fit {type(module).__name__}: {key} has shape {tuple(value.shape)} "
                        f"there but {tuple(target.shape)} in the model. Check model.* against the "
                        "pretrained model's config.")


@torch.no_grad()
def load_pretrained(module: nn.Module, path: str | Path, strict: bool = False, check_sizes: bool = True) -> nn.Module:
    """Copy pretrained weights into ``module`` in place, from a Hugging Face directory (through the
    family's adapter) or a dufu checkpoint. ``module`` may be part of a model (a pipeline stage): only the
    tensors it holds are read (see the module docstring and :func:`pretrained_source` for the checks)."""
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
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module


def pretrained_model(path: str | Path, architecture: Optional[str] = None, **overrides) -> nn.Module:
    """A model built from a pretrained source's own config, with its weights: ``model =
    L(pretrained_model)(path=DIR)`` in a config. ``path``: a Hugging Face directory or a dufu run /
    checkpoint (whose config.yaml gives the architecture). ``overrides``: constructor arguments to change
    (e.g. dropout). Under ``torch.device("meta")`` (start-up checks) only the shapes are built."""
    path = Path(path)
    meta = torch.empty(0).is_meta
    if (path / "config.json").is_file():
        with torch.device("meta"):
            model = build_from_hf_config(read_hf_config(path), architecture, **overrides)
    else:
        from dufu.config import LazyConfig, instantiate

        ckpt = _resolve_dufu_checkpoint(path)
        cfg_file = ckpt / "config.yaml"
        if not cfg_file.is_file():
            raise DataError(f"checkpoint {ckpt} has no config.yaml, so its model cannot be identified.")
        node = LazyConfig.load(str(cfg_file)).model
        for k, v in overrides.items():
            node[k] = v
        if "pretrained" in node:
            node["pretrained"] = None  # the checkpoint's own weights replace those it started from
        with torch.device("meta"):
            model = instantiate(node)  # shapes only; a pretrained_model node here reads nothing on meta
        if not meta and not callable(getattr(model, "init_module", None)):
            raise DufuError(f"{type(model).__name__} has no init_module(), so it cannot be materialised "
                            "from a meta-device build to load a checkpoint into.")
    if meta:
        model.pretrained_path = str(path)  # read later, shard by shard (dufu.parallel.materialize)
        return model
    return _filled(model, path)  # built from the source's own config
