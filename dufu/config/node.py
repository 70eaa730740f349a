"""`ConfigDict`: the node type of every dufu config, plus key-path helpers.

A config is a tree of plain Python values whose inner nodes are `ConfigDict`s:
a `dict` with attribute access (``cfg.train.amp.enabled``). It stays a real
`dict`, so ``json.dumps``, ``**cfg``, ``==`` against plain dicts, pickle and
deepcopy all work as usual.

Keys that collide with `dict` method names (``items``, ``keys``, ``values``,
``update``, ``copy``, ``get``, ``pop``, ``add``, ...) are allowed, but they can
only be read and written with ``cfg["items"]``; attribute access finds the
method.

Three keys are reserved: ``_target_`` (the callable of a LazyCall node),
``_schema_`` (the dotted name of the schema dataclass a typed node follows, see
`dufu.config.schema`) and ``_new_`` (the keys of a typed node that were added
on purpose with `ConfigDict.add`, which its schema does not know).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from dufu.errors import ConfigError

__all__ = [
    "NEW_KEY",
    "SCHEMA_KEY",
    "TARGET_KEY",
    "ConfigDict",
    "ConfigKeyError",
    "closest",
    "closest_keys",
    "convert_dicts",
    "flatten",
    "iter_key_paths",
]


TARGET_KEY = "_target_"
SCHEMA_KEY = "_schema_"
NEW_KEY = "_new_"


class ConfigKeyError(ConfigError, AttributeError):
    """A missing key was read as an attribute of a `ConfigDict`.

    It is an `AttributeError` (so ``hasattr``/``getattr(cfg, k, default)``
    behave as for any object) and a `ConfigError` (so the CLI shows the
    message without a traceback when a config file reads a misspelt key).
    """


def closest(word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Up to `n` entries of `candidates` most similar to `word` (difflib ratio >= cutoff)."""
    return difflib.get_close_matches(word, [str(c) for c in candidates], n=n, cutoff=cutoff)


def closest_keys(key: str, paths: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` dotted key paths most like `key`: by the whole path, then by the last part
    (``train.lr_warmup`` finds ``train.warmup_iter``). Reserved keys other than ``_target_`` are never proposed."""
    paths = [p for p in paths if p.rsplit(".", 1)[-1] not in (SCHEMA_KEY, NEW_KEY)]
    matches = closest(key, paths, n=n)
    if len(matches) < n:
        last = key.rsplit(".", 1)[-1]
        by_last: dict[str, list[str]] = {}
        for p in paths:
            by_last.setdefault(p.rsplit(".", 1)[-1], []).append(p)
        for name in closest(last, by_last, n=n, cutoff=0.5):
            matches += [p for p in by_last[name] if p not in matches]
    return matches[:n]


def value_repr(value: Any, limit: int = 50) -> str:
    """`repr(value)`, shortened to `limit` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quote_list(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


def convert_dicts(value: Any) -> Any:
    """Turn plain dicts (also inside lists and tuples) into ConfigDicts.

    Containers that need no change are returned as the same object, so
    ``cfg.a = lst; lst.append(x)`` keeps working for lists of plain values.
    """
    if isinstance(value, ConfigDict):
        return value
    if isinstance(value, dict):
        return ConfigDict(value)
    if type(value) in (list, tuple):
        items = [convert_dicts(v) for v in value]
        if any(new is not old for new, old in zip(items, value)):
            return type(value)(items)
    return value


class ConfigDict(dict):
    """A `dict` with attribute access whose nested plain dicts become ConfigDicts.

    >>> cfg = ConfigDict(train={"amp": {"enabled": False}})
    >>> cfg.train.amp.enabled = True
    >>> cfg["train"]["amp"]["enabled"]
    True
    """

    # No per-instance __dict__: every attribute write goes to the dict items.
    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    # ---- item access (all writes convert nested dicts) ------------------------

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, convert_dicts(value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if len(args) > 1:
            raise TypeError(f"update expected at most 1 positional argument, got {len(args)}")
        if args:
            other = args[0]
            if isinstance(other, Mapping):
                for key in other:
                    self[key] = other[key]
            elif hasattr(other, "keys"):
                for key in other.keys():
                    self[key] = other[key]
            else:
                for key, value in other:
                    self[key] = value
        for key, value in kwargs.items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def add(self, **new_keys: Any) -> None:
        """Add keys that do not exist yet, on purpose: the ``+key=value`` of command-line overrides.

        A typed node (one with ``_schema_``, or a group of keys inside one) refuses keys its schema does not
        know when its file has been executed; keys added here are listed under ``_new_`` and accepted, also
        after a round trip through YAML. A LazyCall node's keys are its target's parameters, so nothing is listed for it.

        >>> train = ConfigDict(train_iter=10)
        >>> train.add(my_setting=3)
        >>> train.my_setting, train["_new_"]
        (3, ['my_setting'])
        """
        for key, value in new_keys.items():
            if key in self:
                raise ConfigError(
                    f"add({key}=...): the key {key!r} already exists (value {value_repr(self[key])}). Assign it "
                    f"instead (cfg.{key} = ...); add() is for keys that do not exist yet."
                )
            self[key] = value
            if TARGET_KEY not in self:
                listed = self.get(NEW_KEY)
                if listed is None:
                    listed = dict.setdefault(self, NEW_KEY, [])
                if key not in listed:
                    listed.append(key)

    def copy(self) -> ConfigDict:
        """A shallow copy that is still a ConfigDict (``dict.copy`` would give a dict)."""
        return ConfigDict(self)

    def __or__(self, other: Any) -> ConfigDict:
        if not isinstance(other, Mapping):
            return NotImplemented
        new = ConfigDict(self)
        new.update(other)
        return new

    def __ror__(self, other: Any) -> ConfigDict:
        if not isinstance(other, Mapping):
            return NotImplemented
        new = ConfigDict(other)
        new.update(self)
        return new

    def __ior__(self, other: Any) -> ConfigDict:
        self.update(other)
        return self

    # ---- attribute access -----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only called when normal attribute lookup failed.
        try:
            return self[name]
        except KeyError:
            pass
        if name.startswith("__") and name.endswith("__"):
            # Protocol probes (pickle, copy, numpy, ...) must get a plain, cheap AttributeError.
            raise AttributeError(name)
        raise ConfigKeyError(self._missing_key_message(name)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(type(self), name):
            raise AttributeError(
                f"Cannot set config key {name!r} as an attribute: {name!r} is also the name of a "
                f"dict method, so `cfg.{name}` would keep returning the method. Use item syntax "
                f"instead: cfg[{name!r}] = ..."
            )
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise ConfigKeyError(self._missing_key_message(name)) from None

    def __dir__(self) -> Iterable[str]:
        keys = [k for k in self.keys() if isinstance(k, str) and k.isidentifier()]
        return sorted(set(super().__dir__()) | set(keys))

    def _missing_key_message(self, name: str) -> str:
        keys = [str(k) for k in self.keys()]
        matches = closest(name, keys)
        if matches:
            hint = f"Did you mean: {_quote_list(matches)}?"
        elif keys:
            shown = keys[:20]
            more = f" (and {len(keys) - 20} more)" if len(keys) > 20 else ""
            hint = f"Existing keys: {_quote_list(shown)}{more}."
        else:
            hint = "This config node is empty."
        return (
            f"Config has no key {name!r}. {hint} Fix the spelling, or if {name!r} is meant to "
            f"be a new key, assign it first (cfg.{name} = ...)."
        )


# ---- key paths --------------------------------------------------------------------


def iter_key_paths(cfg: Mapping, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``("a.b.c", value)`` for every key at every depth (inner nodes too), depth first."""
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, Mapping):
            yield from iter_key_paths(value, path + ".")


def flatten(cfg: Mapping, prefix: str = "") -> dict[str, Any]:
    """Map each leaf of `cfg` to its dotted key path.

    Leaves are everything that is not a non-empty mapping: scalars, lists and
    tuples (kept whole), callables, and empty dicts.

    >>> flatten({"train": {"amp": {"enabled": True}, "lr": 0.1}})
    {'train.amp.enabled': True, 'train.lr': 0.1}
    """
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
