"""Writing configs to YAML (`save`) and converting them to plain data (`to_plain`).

The YAML written here is what every run stores as ``config.yaml``; loading it
back with `LazyConfig.load` gives an equal config, except that tuples become
lists and classes/functions become their dotted import paths (which
`instantiate` resolves again for ``_target_``).
"""

from __future__ import annotations

import enum
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dufu.errors import ConfigError

from .instantiate import callable_path

__all__ = ["save", "to_plain"]

_SCALARS = (str, int, float, bool, type(None))
_KEY_TYPES = (str, int, float, bool)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_importable_kind(value: Any) -> bool:
    """Classes and plain functions (the things a config may reference by import path)."""
    return isinstance(value, type) or (
        callable(value) and hasattr(value, "__qualname__") and hasattr(value, "__module__")
    )


def to_plain(value: Any, path: str = "") -> Any:
    """Convert a config to YAML-safe data: dicts, lists, scalars and dotted-path strings.

    Raises `ConfigError` naming the key path of the first value that cannot
    be represented.
    """
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if not isinstance(k, _KEY_TYPES) and k is not None:
                raise ConfigError(
                    f"Config key {k!r} under {_join(path, '') or 'the config root'} has type "
                    f"{type(k).__name__}; saved configs need str (or number) keys. Rename it."
                )
            out[k] = to_plain(v, _join(path, k))
        return out
    if isinstance(value, (list, tuple)):
        return [to_plain(v, _join(path, i)) for i, v in enumerate(value)]
    if isinstance(value, _SCALARS) and not isinstance(value, enum.Enum):
        # Exact builtin types only: subclasses (numpy scalars, ...) would be written
        # as Python-specific YAML tags that safe_load refuses.
        if type(value) in _SCALARS:
            return value
        if isinstance(value, str):
            return str.__str__(value)
        base = next(t for t in (bool, int, float) if isinstance(value, t))
        return base(value)
    if _is_importable_kind(value):
        return callable_path(value, path)
    raise ConfigError(
        f"Cannot save config key '{path or '<root>'}': its value {_short_repr(value)} has type "
        f"{type(value).__module__}.{type(value).__qualname__}, which a YAML config cannot "
        f"represent. Config values must be str, int, float, bool, None, lists, dicts, "
        f"importable classes/functions, or LazyCall(...) nodes; describe the object with a "
        f"LazyCall (e.g. LazyCall(torch.device)(type='cpu')) or a plain value instead."
    )


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Dumper(yaml.SafeDumper):
    """SafeDumper that indents list items under their key (easier to read and diff)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> Any:
        return super().increase_indent(flow, False)


def dump_yaml(cfg: Mapping) -> str:
    """The YAML text `save` writes for `cfg`."""
    data = to_plain(cfg)
    return yaml.dump(
        data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save(cfg: Mapping, path: str | Path) -> Path:
    """Write `cfg` as YAML to `path` atomically (temp file + rename); return the path.

    Parent directories are created. Key order is kept.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(
            f"LazyConfig.save needs a config mapping (a ConfigDict of top-level keys), got "
            f"{type(cfg).__name__}. Pass the whole config, e.g. LazyConfig.save(cfg, path)."
        )
    text = dump_yaml(cfg)  # fails before anything is written
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file readable by its owner only; give it the mode a plain open() would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
