"""Where a streamed model's weights come from (:mod:`dufu.engine.inference.streaming`): memory-mapped safetensors, every
tensor stored exactly as the model uses it, so that a streamed parameter is a view of the map and never a copy.

* A Hugging Face directory (``model.safetensors`` or a sharded ``model.safetensors.index.json``, what
  ``dufu convert --to-hf`` and transformers write) whose tensors the family's mapping takes as they are, in the
  model's dtype (LLaMA, Qwen2 in fp32), is read in place.
* One whose tensors change on the way (GPT-2 stores ``Conv1D`` weights transposed and Q, K, V fused; a bf16 file
  for an fp32 model) is converted once into dufu's names and layout, in ``$DUFU_CACHE_DIR/streaming/<hash>/``
  (keyed by the directory and its files' sizes and times). Transforming them again before every forward would
  cost a transpose and fresh private memory (page faults) per block and token; using transposed views of the map
  instead would change the matrix kernels' summation order, so the logits would differ in the last bits from
  those of the contiguous weights ``from_pretrained`` gives, and the tokens must be equal.
* A dufu run (its ``output_dir``, ``checkpoints`` or one ``step_N``) is converted once the same way, next to its
  checkpoint (``checkpoints/step_N.streaming/``), and rewritten when the checkpoint changes. DCP is not read
  directly: its reader runs ``torch.load`` on every stored item and copies it into the target, with DCP's load
  planning, so a streamed block would cost two private copies on every forward instead of none.

Conversions read and write one block (or one module outside the blocks, such as the embedding) at a time, one
safetensors shard each, so they hold about what one streamed block does, not the model.

:class:`MappedSafetensors` reads the tensors. safetensors' ``safe_open`` maps the whole file (copy-on-write,
``MAP_PRIVATE``) and ``get_tensor`` returns a view of that map; the map lives as long as the handle or any view
of it, and the file's pages a view touched count in the process's RSS (as file-backed pages, not anonymous
memory) until it is unmapped. So handles are never kept: a read outside :meth:`MappedSafetensors.reading` opens the
file for that one tensor, and a block's reads share one handle that is closed when the block is loaded. Once a
streamed block's parameters are dropped, no view is left and the whole map goes away.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dufu.cache import file_lock, resolve_cache_dir, short_hash
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.delta_run import is_delta_checkpoint
from dufu.engine.weights.pretrained import dufu_checkpoint_tensors, pretrained_model, resolve_dufu_checkpoint
from dufu.errors import DataError, DufuError
from dufu.models.gpt import GPTModel
from dufu.models.hf_weights import StoredTensor
from dufu.models.hub import adapter_for_model, build_from_hf_config, read_hf_config
from dufu.models.llama import LlamaModel
from dufu.models.base import contract_of

# transformers model_type -> what streaming supports: decoders whose blocks run one after another in a ModuleDict.
SUPPORTED_MODEL_TYPES = {"gpt2": "GPT", "llama": "LLaMA", "qwen2": "Qwen2"}
CACHE_SUFFIX = ".streaming"
_STAMP = "dufu_streaming_source.json"  # what a conversion was made from


def check_family(model: nn.Module, what: str) -> None:
    """Streaming runs dufu's causal decoders (GPT, LLaMA, Qwen2); anything else is a clear refusal."""
    if not isinstance(model, (GPTModel, LlamaModel)) or not isinstance(getattr(model, "blocks", None), nn.ModuleDict):
        families = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_MODEL_TYPES.items())
        raise DufuError(f"{what} is a {type(model).__name__}; streaming weights within a memory budget supports the "
                        f"decoder families {families}. Generate without --max-memory for other models.")


class MappedSafetensors(Mapping):
    """The tensors of a Hugging Face directory's safetensors files, each read as a view of a memory map.

    ``dtype(key)`` and ``shape(key)`` come from the headers, read at construction without touching the data."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise DataError(f"{index} is not a safetensors index (no weight_map: {e}).") from None
            files = sorted({self.path / f for f in weight_map.values()})
        elif (self.path / "pytorch_model.bin").is_file():
            raise DataError(f"{self.path} holds pytorch_model.bin, which cannot be memory-mapped tensor by tensor; "
                            "streaming needs safetensors. Write them once, e.g. with transformers: "
                            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir, "
                            "safe_serialization=True).")
        else:
            raise DataError(f"{self.path} holds no weights: expected model.safetensors or "
                            "model.safetensors.index.json.")
        self._files: dict[str, Path] = {}
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for file in files:
            if not file.is_file():
                raise DataError(f"{file} is missing (named by {index}).")
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    view = f.get_tensor(key)  # a view of the map: the header's dtype and shape, no data read
                    self._files[key] = file
                    self._meta[key] = (view.dtype, tuple(view.shape))
                    del view
        self._open: Optional[dict[Path, object]] = None

    @contextlib.contextmanager
    def reading(self):
        """Reads inside share one handle per file; the handles are closed on exit (views stay valid)."""
        outer, self._open = self._open, ({} if self._open is None else self._open)
        try:
            yield self
        finally:
            self._open = outer

    def __getitem__(self, key: str) -> torch.Tensor:
        file = self._files[key]
        if self._open is None:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][1]

    def dtypes(self) -> set[torch.dtype]:
        return {d for d, _ in self._meta.values()}

    def files(self) -> list[Path]:
        return sorted(set(self._files.values()))

    def __contains__(self, key) -> bool:
        return key in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def mapped_files(path: str | Path) -> list[str]:
    """The lines of ``/proc/self/maps`` that map a file under ``path`` (Linux): what of it this process maps."""
    root = str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        return [line.rstrip() for line in f if root in line]


# ----------------------------------------------------------------------------- sources
def open_source(source: str | Path):
    """``(model, readers, weights, what)`` for streaming ``source``: the meta-device model, a
    :class:`dufu.models.hf_weights.StoredTensor` per tensor name of its state dict (a tied head may have none: its
    embedding serves it), each stored exactly as the model holds it, the :class:`MappedSafetensors` they read, and
    a name for messages."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a Hugging Face directory (config.json + safetensors) or a "
                        "dufu run's output_dir (or one of its checkpoints).")
    if (path / "config.json").is_file():
        with torch.device("meta"):
            model = build_from_hf_config(read_hf_config(path))
        check_family(model, str(path))
        weights = MappedSafetensors(path)
        readers = adapter_for_model(model).tensor_sources(weights, model)
        _check_complete(model, readers, f"the weights in {path}")
        if not all(_as_stored(model, readers, weights).values()):
            directory = _hf_cache(path, weights)
            if not _stamped(directory, {"source": str(path.resolve())}):
                _convert(model, lambda keys: {k: readers[k]() for k in keys}, directory,
                         {"source": str(path.resolve())}, f"the weights in {path}")
            weights = MappedSafetensors(directory)
            readers = {k: StoredTensor(weights, k) for k in model.state_dict() if k in weights}
        return model, readers, weights, f"the weights in {path}"
    ckpt = resolve_dufu_checkpoint(path)
    if is_delta_checkpoint(ckpt):
        raise DufuError(f"{ckpt} is a delta run's checkpoint (its base and delta are separate). Merge them into a "
                        "Hugging Face directory first: dufu convert --to-hf --merge, then stream that directory.")
    if not (ckpt / "config.yaml").is_file():
        raise DataError(f"checkpoint {ckpt} has no config.yaml, so its model cannot be identified.")
    with torch.device("meta"):
        model = pretrained_model(ckpt)  # from the checkpoint's config.yaml; on the meta device nothing is read
    check_family(model, f"the model of {ckpt}")
    directory = ckpt.with_name(ckpt.name + CACHE_SUFFIX)
    stamp = {"checkpoint": ckpt.name,
             "manifest_sha256": hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest()}
    if not _stamped(directory, stamp):
        Checkpointer(ckpt.parent).verify(ckpt)  # sizes and checksums, before the files are trusted
        _convert(model, lambda keys: dufu_checkpoint_tensors(ckpt, model, keys), directory, stamp,
                 f"the dufu checkpoint {ckpt}")
    weights = MappedSafetensors(directory)
    readers = {k: StoredTensor(weights, k) for k in model.state_dict() if k in weights}
    _check_complete(model, readers, f"the streaming copy {directory} of {ckpt}")
    return model, readers, weights, f"the dufu checkpoint {ckpt}"


def _check_complete(model: nn.Module, readers: dict, what: str) -> None:
    tied = contract_of(model).tied_parameter_names
    missing = [k for k in model.state_dict() if k not in readers and k not in tied]
    if missing:
        raise DataError(f"{what} do not fit {type(model).__name__}: missing {missing[:5]}. Check that the config "
                        "belongs to these weights.")


def _as_stored(model: nn.Module, readers: dict, weights: MappedSafetensors) -> dict[str, bool]:
    """Per tensor the model holds: is it stored as-is, in the model's dtype (so the parameter can be a view)?"""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {k: isinstance(r, StoredTensor) and weights.dtype(r.key) == own[k].dtype
            for k, r in readers.items() if k in own}


def _stamped(directory: Path, stamp: dict) -> bool:
    try:
        return json.loads((directory / _STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _hf_cache(path: Path, weights: MappedSafetensors) -> Path:
    """The cache entry of a Hugging Face directory's conversion: keyed by its path, config and weight files."""
    files = weights.files()
    parts = [str(path.resolve()), (path / "config.json").read_bytes()]
    parts += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return resolve_cache_dir() / "streaming" / short_hash(*parts)


def _convert(model: nn.Module, read: Callable[[list[str]], dict], directory: Path, stamp: dict, what: str) -> None:
    """Write ``model``'s tensors as ``read(names)`` gives them, under dufu's names, in the model's dtypes, into
    ``directory``: one safetensors shard per block and per module outside the blocks, so one of them is in memory
    at a time. Written under a temporary name and renamed into place, so an entry is complete or absent."""
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # a tied head: its embedding only
    names = [k for k in model.state_dict() if k in own and k not in contract_of(model).tied_parameter_names]
    groups: dict[str, list[str]] = {}  # one per block, and one per module outside the blocks (wte, ln_f, ...)
    for n in names:
        parts = n.split(".")
        groups.setdefault(".".join(parts[:2]) if parts[0] == "blocks" else parts[0], []).append(n)
    tmp = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    try:
        with file_lock(directory.with_name(f".{directory.name}.lock")):
            if _stamped(directory, stamp):  # another process converted it while this one waited
                return
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            weight_map, total = {}, 0
            for g, keys in enumerate(groups.values()):
                part = {k: v.to(own[k].dtype).contiguous() for k, v in read(keys).items()}
                shard = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
                save_file(part, str(tmp / shard), metadata={"format": "pt"})
                weight_map.update({k: shard for k in part})
                total += sum(v.numel() * v.element_size() for v in part.values())
                del part
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            (tmp / _STAMP).write_text(json.dumps(stamp, indent=2))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"could not write the streaming copy of {what} to {directory} ({e}). Make that directory "
                        "writable (or set DUFU_CACHE_DIR), or write a Hugging Face directory elsewhere with dufu "
                        "convert --to-hf and stream that.") from None
