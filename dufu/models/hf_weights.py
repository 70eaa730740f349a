"""The tensors of a Hugging Face model directory, read lazily: one tensor at a time, or one block of a tensor.

:class:`HFWeights` maps the names a directory stores (``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` memory-mapped) to tensors read on access;
:class:`StoredTensor` is the reader of one tensor stored as-is, which a tensor-parallel or ZeRO rank asks for just
its own block (safetensors ``get_slice``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch
from safetensors import safe_open

from dufu.errors import DataError


class HFWeights(Mapping):
    """The tensors of a Hugging Face model directory, read one at a time on access (``safe_open``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._eager: Optional[dict] = None
        single, index = self.path / "model.safetensors", self.path / "model.safetensors.index.json"
        if single.is_file():
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
