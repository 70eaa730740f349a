"""Command-line overrides: ``train.train_iter=1000``, ``+model.new_key=3``.

Values are parsed as Python literals (``1e-3``, ``[1, 2]``, ``'text'``), then
as the YAML words true/false/null/none, and otherwise kept as the raw text.

Unlike detectron2, a key that does not exist is an error naming the nearest
existing keys (a typo must not silently train the wrong model), and the new
value must have the type of the current one. ``+key=value`` adds a new key.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, MutableMapping
from typing import Any

from dufu.errors import ConfigError

from .node import closest, iter_key_paths

__all__ = ["apply_overrides", "parse_value"]

# Settings that are a switch or a named choice: a bool, or a word such as "auto" (the setting's own checks say
# which words it takes). Any other bool or str key keeps its type.
SWITCH_OR_CHOICE = frozenset({"train.amp.enabled", "train.compile.enabled"})
# Layout settings that may be "auto": `dufu plan` searches them and `dufu train` runs the planner's best choice
# (dufu.plan; this order is the one its messages use). Any of them may also be set back from "auto" to a value of
# its own type.
AUTO_KEYS = (
    "train.dist.data_parallel_size", "train.dist.tensor_parallel_size", "train.dist.pipeline_parallel_size",
    "train.dist.expert_parallel_size", "train.dist.context_parallel_size", "train.dist.sequence_parallel",
    "train.dist.virtual_pipeline_size", "train.train_micro_batch_size", "train.zero_optimization.stage",
    "train.activation_checkpoint.enabled",
)
# Keys a config need not define, with the type an override gives them: train.dist.auto=True lets the planner
# choose every layout setting above.
OPTIONAL_KEYS = {"train.dist.auto": bool}
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
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
    """Apply ``key=value`` overrides to `cfg` in place, in order; return `cfg`."""
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _apply_one(cfg, item)
    return cfg


def _malformed(item: Any, why: str) -> ConfigError:
    return ConfigError(
        f"Malformed override {item!r}: {why}. Overrides have the form `key=value` with a dotted "
        f"key, e.g. `train.train_iter=1000` or `optim.lr=3e-4`; write `+key=value` to add a new "
        f"key, and quote the whole override for the shell if the value has spaces."
    )


def _unknown_key(cfg: MutableMapping, key: str, item: str) -> ConfigError:
    paths = [p for p, _ in iter_key_paths(cfg)]
    matches = closest(key, paths)
    if len(matches) < 3:
        # Also match on the last segment: `train.lr_warmup` vs `train.warmup_iter`.
        last = key.rsplit(".", 1)[-1]
        by_last: dict[str, list[str]] = {}
        for p in paths:
            by_last.setdefault(p.rsplit(".", 1)[-1], []).append(p)
        for name in closest(last, by_last, n=3, cutoff=0.5):
            for p in by_last[name]:
                if p not in matches:
                    matches.append(p)
        matches = matches[:3]
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
    for depth, seg in enumerate(segments[:-1]):
        here = ".".join(segments[: depth + 1])
        if isinstance(node, MutableMapping):
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
            node = node[k]
        elif isinstance(node, list) and seg.isdigit():
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
        found, k = _lookup(node, last)
        if add:
            if found:
                raise ConfigError(
                    f"Override {item!r} adds '{key}' with '+', but that key already exists "
                    f"(value {_short(node[k])}). Drop the '+' to change it: `{key}={raw}`."
                )
            node[last] = value
            return
        if not found:
            if key in OPTIONAL_KEYS and isinstance(value, OPTIONAL_KEYS[key]):
                node[last] = value
                return
            raise _unknown_key(cfg, key, item)
        node[k] = _coerce(key, node[k], value, raw, item)
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


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def auto_layout_keys(cfg) -> list[str]:
    """The layout settings ``cfg`` leaves to the planner: the AUTO_KEYS set to "auto", or ``train.dist.auto``
    when it is True. Cheap: no planner import."""
    def value(dotted):
        node = cfg
        for part in dotted.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        return node

    left = [k for k in AUTO_KEYS if is_auto(value(k))]
    return left + (["train.dist.auto"] if value("train.dist.auto") is True else [])


def _short(value: Any, limit: int = 50) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _coerce(key: str, current: Any, value: Any, raw: str, item: str) -> Any:
    """Check `value` against the type of `current`; return the value to store."""
    if current is None:
        return value
    if value is None and isinstance(current, (int, float, list, tuple)) and not isinstance(current, bool):
        # Numbers and lists are often optional (train.stop_at_iter, train.global_batch_size=None to derive it).
        return None

    def wrong(expected: str, hint: str) -> ConfigError:
        return ConfigError(
            f"Config key '{key}' expects {expected} (current value {_short(current)}), but the "
            f"override {item!r} gives {_short(value)} of type {type(value).__name__}. {hint}"
        )

    if key in SWITCH_OR_CHOICE and isinstance(current, (bool, str)) and isinstance(value, (bool, str)):
        return value
    if key in AUTO_KEYS and (is_auto(value) or is_auto(current)):
        return "auto" if is_auto(value) else value
    raw_text = raw.strip()
    quote_hint = (
        f"If you mean the text, quote it so it stays a string: {key}=\"'{raw_text}'\"."
    )
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        extra = " (1 and 0 are ints, not bools)" if isinstance(value, int) else ""
        raise wrong("a bool", f"Write {key}=true or {key}=false{extra}.")
    if isinstance(current, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float):
            hint = f"Write a whole number without a decimal point, e.g. {key}={int(value)}."
            if not value.is_integer():
                hint = "Write a whole number; fractional values are not valid for this key."
            raise wrong("an int", hint)
        raise wrong("an int", f"Write a whole number, e.g. {key}={current}.")
    if isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and raw_text.lower() in {"inf", "-inf", "+inf", "nan"}:
            return float(raw_text)
        raise wrong("a float", f"Write a number, e.g. {key}={current!r} or {key}=1e-3.")
    if isinstance(current, str):
        if isinstance(value, str):
            return value
        raise wrong("a str", quote_hint)
    if isinstance(current, (list, tuple)):
        if isinstance(value, (list, tuple)):
            if isinstance(current, tuple) and hasattr(current, "_fields"):
                return type(current)(*value)
            return type(current)(value)
        raise wrong(
            f"a {type(current).__name__}",
            f"Write a Python list literal and quote it for the shell, e.g. {key}='[1, 2]'.",
        )
    if isinstance(current, MutableMapping):
        if isinstance(value, dict):
            return value
        subkeys = [str(k) for k in current][:6]
        example = f"`{key}.{subkeys[0]}=...`" if subkeys else f"`+{key}.name=...`"
        raise ConfigError(
            f"Config key '{key}' is a group of keys ({', '.join(subkeys) or 'empty'}), so the "
            f"override {item!r} cannot replace it with the single value {_short(value)}. "
            f"Override its sub-keys instead, e.g. {example}."
        )
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
