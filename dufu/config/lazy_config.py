"""`LazyConfig`: the file-level operations on configs, gathered in one namespace."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from . import loader, serialize, topy
from .overrides import apply_overrides as _apply_overrides

__all__ = ["LazyConfig"]


class LazyConfig:
    """Load, save, override and print configs (all static methods).

    >>> cfg = LazyConfig.load("configs/gpt2_small.py")                    # doctest: +SKIP
    >>> LazyConfig.apply_overrides(cfg, ["train.train_iter=100"])        # doctest: +SKIP
    >>> LazyConfig.save(cfg, "output/config.yaml")                        # doctest: +SKIP
    """

    @staticmethod
    def load(path: str | Path, keys: str | tuple[str, ...] | list[str] | None = None) -> Any:
        """Load a ``.py`` or ``.yaml`` config (see `dufu.config.loader.load`)."""
        return loader.load(path, keys=keys)

    @staticmethod
    def save(cfg: Mapping, path: str | Path) -> Path:
        """Write `cfg` to `path` as YAML, atomically (see `dufu.config.serialize.save`)."""
        return serialize.save(cfg, path)

    @staticmethod
    def apply_overrides(cfg: MutableMapping, overrides: Iterable[str] | str) -> MutableMapping:
        """Apply ``key=value`` / ``+key=value`` overrides in place; return `cfg`."""
        return _apply_overrides(cfg, overrides)

    @staticmethod
    def to_py(cfg: Mapping, prefix: str = "") -> str:
        """Python source that recreates `cfg` (see `dufu.config.topy.to_py`)."""
        return topy.to_py(cfg, prefix=prefix)

    @staticmethod
    def to_yaml(cfg: Mapping) -> str:
        """The YAML text `save` would write (for ``--show-config``)."""
        return serialize.dump_yaml(cfg)
