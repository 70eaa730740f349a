"""The types a config value is checked against, and how a mismatch is described.

A config key's type is an ordinary annotation, as written in a schema dataclass (`dufu.config.schema`) or in
the signature of a LazyCall target:

- ``int``, ``float`` (an int is taken and stored as a float), ``bool``, ``str``, ``None``;
- ``Literal["auto"]``: one of the listed words (matched without regard to case or surrounding spaces, stored
  as written in the annotation), or of the listed numbers;
- unions, ``X | Y`` or ``Optional[X]``: the first member that takes the value decides;
- ``list[X]`` / ``tuple[X, ...]`` (a YAML list is taken for either), ``dict`` / ``dict[str, X]``;
- `Lazy`: a LazyCall node (a mapping with ``_target_``), checked against its target's signature;
- a schema dataclass: a group of keys, checked by that schema;
- ``Any``, and for signatures any annotation not listed here (``nn.Module``, ``Callable``, ...): anything.

`conform` returns the value to store (a float for an int given to a float key, the annotation's spelling of a
word) or raises `Mismatch`; the caller names the key and the place (override, file) in its message.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

__all__ = ["Lazy", "Mismatch", "conform", "describe", "is_checkable", "scalar_kinds"]


class Lazy:
    """Annotation for a key holding a LazyCall node, e.g. ``scheduler: Lazy`` or ``hooks: list[Lazy]``."""


class Mismatch(Exception):
    """`value` does not have the type an annotation asks for (the message, if any, is a hint how to fix it)."""


_SCALARS = (bool, int, float, str, type(None))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _members(tp: Any) -> tuple:
    return typing.get_args(tp) if _is_union(tp) else (tp,)


def is_schema(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_checkable(tp: Any) -> bool:
    """Whether every part of `tp` is a type this module knows (a schema's fields must be; a signature's need not)."""
    if tp is Any or tp is Lazy or tp in _SCALARS or tp is None or is_schema(tp):
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return all(isinstance(a, (str, int)) for a in typing.get_args(tp))
    if _is_union(tp) or origin in (list, tuple, dict):
        return all(a is Ellipsis or is_checkable(a) for a in typing.get_args(tp))
    return tp in (list, tuple, dict)


def scalar_kinds(tp: Any) -> list[type]:
    """The scalar types `tp` admits, in order (``int | Literal['auto']`` -> [int, str]); for hints."""
    out: list[type] = []
    for m in _members(tp):
        kinds = [type(a) for a in typing.get_args(m)] if typing.get_origin(m) is Literal else [m]
        for k in kinds:
            if k in _SCALARS and k not in out:
                out.append(k)
    return out


def _article(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def _describe_one(tp: Any) -> str:
    if tp is Any:
        return "any value"
    if tp is None or tp is type(None):
        return "None"
    if tp is Lazy:
        return "a LazyCall node (a mapping with _target_)"
    if is_schema(tp):
        return "a group of keys"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin in (list, tuple):
        inner = f" of {_plural(args[0])}" if args and args[0] is not Any else ""
        return f"a list{inner}"
    if origin is dict:
        return "a mapping"
    return _article(getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    if tp is Lazy:
        return "LazyCall nodes"
    text = _describe_one(tp)
    return text.split(" ", 1)[1] if text.startswith(("a ", "an ")) else text


def describe(tp: Any, first: Any = dataclasses.MISSING) -> str:
    """``an int``, ``a bool or a str``, ``an int or 'auto'``; with `first`, the member taking that value (the
    key's current value) is named first, so the message reads from what the key holds now (None is always last)."""
    members = list(_members(tp))
    if first is not dataclasses.MISSING:
        def takes(m: Any) -> bool:
            try:
                conform(m, first)
                return True
            except Mismatch:
                return False
        members.sort(key=lambda m: (m in (None, type(None)), not takes(m)))  # None last: "an int or None"
    return " or ".join(_describe_one(m) for m in members)


def _word(value: Any, words: tuple) -> Any:
    for w in words:
        if type(w) is type(value) and w == value:
            return w
        if isinstance(w, str) and isinstance(value, str) and value.strip().lower() == w.lower():
            return w
    raise Mismatch()


def conform(tp: Any, value: Any) -> Any:
    """`value` as stored under annotation `tp`, or `Mismatch`. Schema dataclasses and LazyCall nodes are only
    checked for being mappings here; `dufu.config.schema` checks their keys."""
    if tp is Any:
        return value
    if _is_union(tp):
        for member in typing.get_args(tp):
            try:
                return conform(member, value)
            except Mismatch:
                continue
        raise Mismatch()
    if tp is None or tp is type(None):
        if value is None:
            return None
        raise Mismatch()
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise Mismatch()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Mismatch()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _looks_like_number(value):
            raise Mismatch(f"{value!r} is text here: YAML 1.1 reads a float only with a dot, e.g. 1.0e-3 for 1e-3.")
        raise Mismatch()
    if tp is str:
        if isinstance(value, str):
            return value
        raise Mismatch()
    if typing.get_origin(tp) is Literal:
        return _word(value, typing.get_args(tp))
    if tp is Lazy:
        if isinstance(value, Mapping) and "_target_" in value:
            return value
        raise Mismatch()
    if is_schema(tp):
        if isinstance(value, Mapping):
            return value
        raise Mismatch()
    origin, args = typing.get_origin(tp) or tp, typing.get_args(tp)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise Mismatch()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise Mismatch(f"It needs {len(args)} items, not {len(value)}.")
            items = [conform(a, v) for a, v in zip(args, value)]
        else:
            items = [conform(args[0], v) for v in value] if args else list(value)
        if all(new is old for new, old in zip(items, value)):
            return value  # unchanged: the same object (a tuple stays a tuple, a list keeps its identity)
        return type(value)(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise Mismatch()
        if len(args) == 2:
            for v in value.values():
                conform(args[1], v)
        return value
    return value  # an annotation this module does not know (signatures only: nn.Module, Callable, ...)


def _looks_like_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
