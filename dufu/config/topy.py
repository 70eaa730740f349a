"""`to_py`: write a config back as a Python config file.

The output imports every referenced class/function, writes ``LazyCall``
nodes as ``LazyCall(Name)(...)`` and other dicts as dict literals, with one
assignment per top-level key. Executing it (or `LazyConfig.load` of a file
holding it) recreates an equal config.
"""

from __future__ import annotations

import builtins
import keyword
import math
from collections.abc import Mapping
from typing import Any

from dufu.errors import ConfigError

from .instantiate import callable_path
from .lazy import TARGET_KEY
from .serialize import _is_importable_kind

__all__ = ["to_py"]

_WIDTH = 88
_INDENT = "    "


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _Writer:
    def __init__(self, reserved: set[str], config_keys: set[str]) -> None:
        self.reserved = reserved
        self.config_keys = config_keys
        self.imports: dict[tuple[str, str], str] = {}  # (module, name) -> local alias
        self.uses_lazycall = False

    def ref(self, obj: Any, path: str) -> str:
        """An expression for an importable class/function, registering its import."""
        callable_path(obj, path)  # validates that module.qualname imports back to obj
        module, qualname = obj.__module__, obj.__qualname__
        head, _, rest = qualname.partition(".")
        if module == "builtins" and head not in self.config_keys:
            return qualname  # builtins need no import
        alias = self.imports.get((module, head))
        if alias is None:
            alias = head
            taken = self.reserved | set(self.imports.values())
            n = 1
            while alias in taken or keyword.iskeyword(alias):
                n += 1
                alias = f"{head}_{n}"
            self.imports[(module, head)] = alias
        return f"{alias}.{rest}" if rest else alias

    # Each formatter returns the expression for `value`; `level` is the indent depth.
    def fmt(self, value: Any, path: str, level: int) -> str:
        if isinstance(value, Mapping):
            if TARGET_KEY in value:
                return self._fmt_lazycall(value, path, level)
            return self._fmt_dict(value, path, level)
        if isinstance(value, (list, tuple)):
            return self._fmt_seq(value, path, level)
        if isinstance(value, bool) or value is None:
            return repr(value)
        if isinstance(value, (int, str)) and type(value) in (int, str):
            return repr(value)
        if type(value) is float:
            if math.isfinite(value):
                return repr(value)
            return f"float({str(value)!r})"
        if _is_importable_kind(value):
            return self.ref(value, path)
        raise ConfigError(
            f"Cannot write config key '{path or '<root>'}' as Python: its value {value!r:.60} "
            f"has type {type(value).__module__}.{type(value).__qualname__}, which has no "
            f"literal form. Use plain values, importable classes/functions, or LazyCall(...) "
            f"nodes in configs."
        )

    def _block(self, opener: str, items: list[str], closer: str, level: int) -> str:
        one_line = opener + ", ".join(items) + closer
        if "\n" not in one_line and len(_INDENT * level) + len(one_line) <= _WIDTH:
            return one_line
        inner = _INDENT * (level + 1)
        body = "".join(f"{inner}{it},\n" for it in items)
        return f"{opener}\n{body}{_INDENT * level}{closer}"

    def _fmt_lazycall(self, node: Mapping, path: str, level: int) -> str:
        self.uses_lazycall = True
        target = node[TARGET_KEY]
        if isinstance(target, str):
            target_expr = repr(target)
        else:
            target_expr = self.ref(target, _join(path, TARGET_KEY))
        args = []
        extra = []
        for k, v in node.items():
            if k == TARGET_KEY:
                continue
            expr = self.fmt(v, _join(path, k), level + 1)
            if isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k):
                args.append(f"{k}={expr}")
            else:
                extra.append(f"{k!r}: {expr}")
        if extra:
            args.append("**{" + ", ".join(extra) + "}")
        return self._block(f"LazyCall({target_expr})(", args, ")", level)

    def _fmt_dict(self, node: Mapping, path: str, level: int) -> str:
        items = [f"{k!r}: {self.fmt(v, _join(path, k), level + 1)}" for k, v in node.items()]
        return self._block("{", items, "}", level)

    def _fmt_seq(self, seq: list | tuple, path: str, level: int) -> str:
        items = [self.fmt(v, _join(path, i), level + 1) for i, v in enumerate(seq)]
        if isinstance(seq, list):
            return self._block("[", items, "]", level)
        if len(items) == 1:
            return f"({items[0]},)"
        return self._block("(", items, ")", level)


def to_py(cfg: Mapping, prefix: str = "") -> str:
    """Python source that recreates `cfg`: imports, then ``<prefix><key> = ...`` per top-level key.

    With the default empty `prefix` the source is a complete config file. A
    prefix such as ``"cfg."`` writes ``cfg.model = ...`` lines, for pasting
    into code where ``cfg`` exists.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(
            f"LazyConfig.to_py needs a config mapping (a ConfigDict of top-level keys), got "
            f"{type(cfg).__name__}. Pass the whole config."
        )
    for key in cfg:
        if not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)):
            raise ConfigError(
                f"Top-level config key {key!r} is not a Python identifier, so it cannot become a "
                f"variable of a Python config. Rename it (letters, digits and '_')."
            )
    # Imports never shadow config keys or builtins the generated code may use.
    config_keys = {str(k) for k in cfg}
    writer = _Writer(config_keys | {"LazyCall"} | set(dir(builtins)), config_keys)
    body = [f"{prefix}{key} = {writer.fmt(value, key, 0)}" for key, value in cfg.items()]

    lines = ["# Generated by dufu.config.LazyConfig.to_py; executing it recreates the config."]
    if writer.uses_lazycall:
        lines.append("from dufu.config import LazyCall")
    for (module, name), alias in sorted(writer.imports.items()):
        as_part = f" as {alias}" if alias != name else ""
        lines.append(f"from {module} import {name}{as_part}")
    lines.append("")
    lines.extend(body)
    return "\n".join(lines) + "\n"
