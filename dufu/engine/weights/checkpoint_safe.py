"""Reading DCP checkpoints without unpickling arbitrary objects (see :mod:`dufu.engine.weights.checkpoint`)."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from dufu.errors import CheckpointError

# --- loading without unpickling arbitrary objects -------------------------------------------------
# DCP stores tensors with torch.save (read back with weights_only=True), but its .metadata file is a
# plain pickle and non-tensor items are read with weights_only=False. dufu reads both through
# restricted loaders: only DCP's own metadata classes and plain data may appear.
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint._extension")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_GLOBALS or module.startswith(_METADATA_MODULES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:
                raise CheckpointError(
                    f"checkpoint metadata {path} cannot be read: {e}. It is corrupt or was not written by "
                    "torch.distributed.checkpoint; use another checkpoint."
                ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
