"""Command-line overrides: ``train.train_iter=1000``, ``+model.new_key=3``.

Values are parsed as Python literals (``1e-3``, ``[1, 2]``, ``'text'``), then
as the YAML words true/false/null/none, and otherwise kept as the raw text.

Unlike detectron2, a key that does not exist is an error naming the nearest
existing keys (a typo must not silently train the wrong model). Inside a typed
node (`dufu.config.schema`) the new value must have the type its schema
declares (which says, e.g., which keys also take the word "auto"); elsewhere
it must have the type of the current value. ``+key=value`` adds a new key; in a
typed node it is listed under ``_new_``, as `ConfigDict.add` does in files.
After the overrides, the whole config is checked as a loaded file is
(`dufu.config.schema.check_config`).
"""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterable, MutableMapping
from typing import Any

from dufu.errors import ConfigError

from .instantiate import locate
from .node import NEW_KEY, TARGET_KEY, closest_keys, iter_key_paths, value_repr
from .schema import check_call_node, check_config, field_types, nested_schema, schema_of
from .typecheck import Mismatch, conform, describe, scalar_kinds

__all__ = ["apply_overrides", "is_auto", "parse_value"]

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_FLOAT_WORDS = ("inf", "-inf", "+inf", "nan")
_WORDS = {"true": True, "false": False, "null": None, "none": None, "~": None}


def parse_value(text: str) -> Any:
    """Parse the value part of an override.

    >>> parse_value("1e-3"), parse_value("[1, 2]"), parse_value("true"), parse_value("gpt2")
    (0.001, [1, 2], True, 'gpt2')
    """
    stripped = text.strip()
    try:
        return ast.literal_eval(stripped)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    lowered = stripped.lower()
    if lowered in _WORDS:
        return _WORDS[lowered]
    return text


def apply_overrides(cfg: MutableMapping, overrides: Iterable[str] | str) -> MutableMapping:
    """Apply ``key=value`` overrides to `cfg` in place, in order; check the result; return `cfg`."""
    if isinstance(overrides, str):
        overrides = [overrides]
    overrides = list(overrides)
    for item in overrides:
        _apply_one(cfg, item)
    if overrides:
        check_config(cfg, source=f"the config after the overrides {' '.join(map(str, overrides))}")
    return cfg


def _malformed(item: Any, why: str) -> ConfigError:
    return ConfigError(
        f"Malformed override {item!r}: {why}. Overrides have the form `key=value` with a dotted "
        f"key, e.g. `train.train_iter=1000` or `optim.lr=3e-4`; write `+key=value` to add a new "
        f"key, and quote the whole override for the shell if the value has spaces."
    )


def _unknown_key(cfg: MutableMapping, key: str, item: str) -> ConfigError:
    matches = closest_keys(key, [p for p, _ in iter_key_paths(cfg)])
    hint = (
        f"Did you mean: {', '.join(repr(m) for m in matches)}? "
        if matches
        else "No existing key is similar. "
    )
    return ConfigError(
        f"Unknown config key '{key}' (in override {item!r}). {hint}Run `dufu train CONFIG "
        f"--show-config` to see every key, or write `+{key}=...` (with a '+' prefix) if you "
        f"really mean to add a new key."
    )


def _lookup(node: Any, seg: str) -> tuple[bool, Any]:
    """(found, key) of `seg` in a mapping, accepting int keys written as digits."""
    if seg in node:
        return True, seg
    if seg.lstrip("-").isdigit() and int(seg) in node:
        return True, int(seg)
    return False, seg


def _apply_one(cfg: MutableMapping, item: Any) -> None:
    if not isinstance(item, str):
        raise _malformed(item, f"overrides are strings, got {type(item).__name__}")
    text = item.strip()
    add = text.startswith("+")
    if add:
        text = text[1:]
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise _malformed(item, "there is no '='")
    if not key:
        raise _malformed(item, "the key before '=' is empty")
    segments = key.split(".")
    if any(not s.strip() for s in segments):
        raise _malformed(item, f"the key {key!r} has an empty part between dots")
    value = parse_value(raw)

    node: Any = cfg
    tp: Any = None  # the annotation a typed parent gives `node`
    for depth, seg in enumerate(segments[:-1]):
        here = ".".join(segments[: depth + 1])
        if isinstance(node, MutableMapping):
            schema = schema_of(node, tp)
            found, k = _lookup(node, seg)
            if not found:
                if add:
                    parent = ".".join(segments[:depth]) or "the config root"
                    raise ConfigError(
                        f"Cannot add '{key}' (override {item!r}): its parent '{here}' does not "
                        f"exist in {parent}. Add the parent first, e.g. `+{here}={{}}`, or fix "
                        f"the spelling."
                    )
                raise _unknown_key(cfg, key, item)
            tp = _field_type(schema, k)
            node = node[k]
        elif isinstance(node, list) and seg.isdigit():
            tp = None
            index = int(seg)
            if index >= len(node):
                raise ConfigError(
                    f"Override {item!r}: '{'.'.join(segments[:depth])}' is a list of "
                    f"{len(node)} item(s), so index {index} does not exist. Use an index "
                    f"from 0 to {len(node) - 1}, or override the whole list."
                )
            node = node[index]
        else:
            owner = ".".join(segments[:depth])
            raise ConfigError(
                f"Override {item!r}: '{owner}' holds a {type(node).__name__} "
                f"({_short(node)}), not a group of keys, so it has no sub-key {seg!r}. "
                f"Override '{owner}' itself, e.g. `{owner}=...`."
            )

    last = segments[-1]
    if isinstance(node, MutableMapping):
        schema = schema_of(node, tp)
        found, k = _lookup(node, last)
        if add:
            if found:
                raise ConfigError(
                    f"Override {item!r} adds '{key}' with '+', but that key already exists "
                    f"(value {_short(node[k])}). Drop the '+' to change it: `{key}={raw}`."
                )
            node[last] = value
            if schema is not None:  # on purpose: the schema's check lets it pass (ConfigDict.add in files)
                listed = node.setdefault(NEW_KEY, [])
                if last not in listed:
                    listed.append(last)
            elif TARGET_KEY in node:
                _check_call(node, ".".join(segments[:-1]), item)
            return
        field_tp = _field_type(schema, k)
        if not found and field_tp is None:
            raise _unknown_key(cfg, key, item)
        if field_tp is not None:
            node[k] = _coerce_typed(key, field_tp, node.get(k), value, raw, item)
        else:
            node[k] = _coerce(key, node[k], value, raw, item)
        if TARGET_KEY in node:
            _check_call(node, ".".join(segments[:-1]), item)
        return
    parent = ".".join(segments[:-1])
    if isinstance(node, list) and last.isdigit() and not add:
        index = int(last)
        if index >= len(node):
            raise ConfigError(
                f"Override {item!r}: '{parent}' is a list of {len(node)} item(s), so index "
                f"{index} does not exist. Use an index from 0 to {len(node) - 1}, or override "
                f"the whole list with `{parent}=[...]`."
            )
        node[index] = _coerce(key, node[index], value, raw, item)
        return
    what = "a group of keys (a dict)" if add else "a group of keys or a list"
    raise ConfigError(
        f"Override {item!r}: '{parent}' holds a {type(node).__name__} ({_short(node)}), not "
        f"{what}, so '{key}' cannot be set. Override '{parent}' itself, e.g. `{parent}=...`."
    )


def _field_type(schema: type | None, key: Any) -> Any:
    if schema is None:
        return None
    found = field_types(schema).get(key)
    return found[0] if found is not None else None


def _check_call(node: MutableMapping, path: str, item: str) -> None:
    try:
        check_call_node(node, path)
    except ConfigError as exc:
        raise ConfigError(f"Override {item!r}: {exc}") from None


def is_auto(value: Any) -> bool:
    """Whether `value` is the word "auto" (any case, surrounding spaces allowed)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _short(value: Any, limit: int = 50) -> str:
    return value_repr(value, limit)


def _hint(kind: type, key: str, current: Any, value: Any, raw: str) -> str:
    """What to write instead, for a key whose (first) type is `kind`."""
    if kind is bool:
        extra = " (1 and 0 are ints, not bools)" if isinstance(value, int) and not isinstance(value, bool) else ""
        return f"Write {key}=true or {key}=false{extra}."
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                return "Write a whole number; fractional values are not valid for this key."
            return f"Write a whole number without a decimal point, e.g. {key}={int(value)}."
        example = current if isinstance(current, int) and not isinstance(current, bool) else 1
        return f"Write a whole number, e.g. {key}={example}."
    if kind is float:
        example = current if isinstance(current, float) else 1.0
        return f"Write a number, e.g. {key}={example!r} or {key}=1e-3."
    if kind is str:
        return f"If you mean the text, quote it so it stays a string: {key}=\"'{raw.strip()}'\"."
    if kind in (list, tuple):
        return f"Write a Python list literal and quote it for the shell, e.g. {key}='[1, 2]'."
    return ""


def _group_error(key: str, current: MutableMapping, value: Any, item: str) -> ConfigError:
    subkeys = [str(k) for k in current if k not in (NEW_KEY, "_schema_")][:6]
    example = f"`{key}.{subkeys[0]}=...`" if subkeys else f"`+{key}.name=...`"
    return ConfigError(
        f"Config key '{key}' is a group of keys ({', '.join(subkeys) or 'empty'}), so the "
        f"override {item!r} cannot replace it with the single value {_short(value)}. "
        f"Override its sub-keys instead, e.g. {example}."
    )


def _coerce_typed(key: str, tp: Any, current: Any, value: Any, raw: str, item: str) -> Any:
    """Check `value` against the annotation `tp` of a typed node's key; return the value to store."""
    if isinstance(current, MutableMapping) and not isinstance(value, dict):
        raise _group_error(key, current, value, item)
    if isinstance(value, str) and raw.strip().lower() in _FLOAT_WORDS and float in scalar_kinds(tp):
        value = float(raw.strip())
    try:
        return conform(tp, value)
    except Mismatch as exc:
        kinds = scalar_kinds(tp)
        kinds.sort(key=lambda k: k is not type(current))  # the hint follows what the key holds now
        hint = _hint(kinds[0], key, current, value, raw) if kinds else ""
        words = [w for w in _words(tp) if isinstance(w, str)]
        if words:
            hint += f" It also takes the word{'s' if len(words) > 1 else ''} {', '.join(map(repr, words))}."
        reason = f"{exc} " if str(exc) else ""
        raise ConfigError(
            f"Config key '{key}' expects {describe(tp, first=current)} (current value {_short(current)}), but "
            f"the override {item!r} gives {_short(value)} of type {type(value).__name__}. {reason}{hint}".rstrip()
        ) from None


def _words(tp: Any) -> list:
    members = typing.get_args(tp) if typing.get_origin(tp) is not typing.Literal else (tp,)
    return [w for m in members if typing.get_origin(m) is typing.Literal for w in typing.get_args(m)]


def _coerce(key: str, current: Any, value: Any, raw: str, item: str) -> Any:
    """Check `value` against the type of `current` (a key no schema describes); return the value to store."""
    if current is None:
        return value
    if value is None and isinstance(current, (int, float, list, tuple)) and not isinstance(current, bool):
        # Numbers and lists are often optional (a stop step, a batch size left None to derive it).
        return None

    def wrong(expected: str, hint: str) -> ConfigError:
        return ConfigError(
            f"Config key '{key}' expects {expected} (current value {_short(current)}), but the "
            f"override {item!r} gives {_short(value)} of type {type(value).__name__}. {hint}"
        )

    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        raise wrong("a bool", _hint(bool, key, current, value, raw))
    if isinstance(current, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong("an int", _hint(int, key, current, value, raw))
    if isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and raw.strip().lower() in _FLOAT_WORDS:
            return float(raw.strip())
        raise wrong("a float", _hint(float, key, current, value, raw))
    if isinstance(current, str):
        if isinstance(value, str):
            return value
        raise wrong("a str", _hint(str, key, current, value, raw))
    if isinstance(current, (list, tuple)):
        if isinstance(value, (list, tuple)):
            if isinstance(current, tuple) and hasattr(current, "_fields"):
                return type(current)(*value)
            return type(current)(value)
        raise wrong(f"a {type(current).__name__}", _hint(list, key, current, value, raw))
    if isinstance(current, MutableMapping):
        if isinstance(value, dict):
            return value
        raise _group_error(key, current, value, item)
    if callable(current):
        if isinstance(value, str) and _DOTTED.match(value):
            return value
        raise wrong(
            "a class or function",
            f"Give its dotted import path, e.g. {key}=torch.optim.AdamW.",
        )
    if type(value) is type(current):
        return value
    raise wrong(
        f"a {type(current).__name__}",
        "Values of this type cannot be written on the command line; change it in the config "
        "file instead.",
    )
