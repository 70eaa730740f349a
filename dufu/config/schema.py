"""Typed config nodes: a schema per config namespace, and the check every config gets where it enters.

A schema is a dataclass whose fields are the keys of one namespace, each with its type (`dufu.config.typecheck`)
and its one default; nested dataclasses are groups of keys. The config itself stays data: a typed node is a
`ConfigDict` that names its schema under the reserved key ``_schema_``, as a LazyCall node names its callable
under ``_target_``::

    train = schema_node(Train)       # {"_schema_": "dufu.engine.schema.Train", "output_dir": ..., "amp": {...}}
    train.amp.enabled = False        # recipes edit it like any config
    train.add(my_setting=3)          # a key the schema lacks, added on purpose (listed under "_new_")

Because the name travels with the data (also through ``config.yaml``), this layer checks a node without
knowing which namespaces exist or importing the module that defines them: the schema is imported by its dotted
name when a node is checked, as `instantiate` imports a ``_target_``.

`check_config` walks a config and, for

- a typed node: refuses keys that are neither fields nor listed in ``_new_`` (naming the closest keys), refuses
  values of the wrong type, stores values in their declared form (an int given to a float key becomes a float,
  ``"Auto"`` becomes ``"auto"``), fills in every missing key with its default and puts the keys in schema order;
- a LazyCall node: refuses keys that are not parameters of the target (unless it takes ``**kwargs``) and values
  that do not match a parameter's annotation, where the annotation is one `typecheck` knows.

The loader runs it on every config file it executes or reads (once the file has run: an assignment is not
checked on its own, so a `ConfigDict` stays a plain dict; the loader finds the offending key's line for the
message), and `apply_overrides` after the overrides. So a config that came through `LazyConfig` or `get_config`
has every typed node complete and typed, and code reads ``cfg.train.x``. A namespace built in code from plain
dicts carries no ``_schema_`` and is not checked here; the engine types its ``train`` at start-up
(`dufu.engine.schema.validate_train`), and lower layers that take plain fragments (``ParallelDims.from_config``)
keep their own keyword defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Mapping
from typing import Any

from dufu.errors import ConfigError

from .instantiate import _locate, _LocateError, callable_path
from .lazy import target_name
from .node import NEW_KEY, SCHEMA_KEY, TARGET_KEY, ConfigDict, closest_keys, iter_key_paths, value_repr
from .typecheck import Mismatch, conform, describe, is_schema, scalar_kinds

__all__ = ["check_config", "check_call_node", "field_types", "schema_defaults", "schema_node", "schema_of"]

_schemas: dict[str, type] = {}
_signatures: dict[Any, Any] = {}


class KeyProblem(ConfigError):
    """A config key that is unknown or holds the wrong type; `key` is its dotted path (for locating its line)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


# ---- schemas ------------------------------------------------------------------------------


def resolve_schema(marker: Any, path: str = "") -> type:
    """The dataclass a ``_schema_`` value names (a dotted path, or the class itself)."""
    if isinstance(marker, str):
        if marker not in _schemas:
            try:
                _schemas[marker] = _locate(marker)
            except _LocateError as exc:
                raise ConfigError(
                    f"Cannot import the schema {marker!r} of {_where(path)}: {exc}. '{_join(path, SCHEMA_KEY)}' "
                    f"must name a schema dataclass, e.g. 'dufu.engine.schema.Train'."
                ) from None
        marker = _schemas[marker]
    if not is_schema(marker):
        raise ConfigError(
            f"The {SCHEMA_KEY} of {_where(path)} is {marker!r}, which is not a dataclass. It must name the schema "
            f"dataclass of the node."
        )
    return marker


@functools.cache
def field_types(schema: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    """``{name: (annotation, field)}`` of a schema, in order (string annotations resolved). Do not modify it."""
    hints = typing.get_type_hints(schema)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(schema)}


def nested_schema(tp: Any) -> type | None:
    """The schema dataclass a field's annotation holds (also inside ``X | None``), if any."""
    for member in typing.get_args(tp) or (tp,):
        if is_schema(member):
            return member
    return None


def schema_of(node: Any, tp: Any = None) -> type | None:
    """The schema of a mapping: the one it names, else the one its parent's annotation `tp` gives."""
    if not isinstance(node, Mapping):
        return None
    if node.get(SCHEMA_KEY) is not None:
        return resolve_schema(node[SCHEMA_KEY])
    return nested_schema(tp) if tp is not None else None


def _plain(value: Any) -> Any:
    """A default as config data: dataclass instances become ConfigDicts, everything else a fresh copy."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ConfigDict({f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return copy.deepcopy(value)


def _default(schema: type, name: str, f: dataclasses.Field, tp: Any, path: str) -> Any:
    if f.default is not dataclasses.MISSING:
        return _plain(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _plain(f.default_factory())
    sub = nested_schema(tp)
    if sub is not None:
        return ConfigDict()  # filled in from the nested schema
    raise KeyProblem(f"Config key '{_join(path, name)}' has no default in {schema.__qualname__}; set it.",
                     _join(path, name))


def schema_defaults(schema: type) -> ConfigDict:
    """Every key of `schema` with its default, as config data (no ``_schema_`` marker)."""
    node = ConfigDict()
    _check_typed(node, "", schema)
    return node


def schema_node(schema: type, **values: Any) -> ConfigDict:
    """A typed node: ``_schema_`` naming `schema`, its defaults, then `values` (checked)."""
    node = ConfigDict()
    node[SCHEMA_KEY] = callable_path(schema)
    node.update(values)
    check_config(node)
    return node


# ---- checking -----------------------------------------------------------------------------


def check_config(cfg: Any, source: str | None = None) -> Any:
    """Check every typed and LazyCall node of `cfg` in place (see the module docstring); return `cfg`.

    `source` (e.g. "config file my.py") is named in the error messages.
    """
    try:
        _walk(cfg, "", None)
    except ConfigError as exc:
        if source is None:
            raise
        raise type(exc)(f"In {source}: {exc}", *([exc.key] if isinstance(exc, KeyProblem) else [])) from None
    return cfg


def _where(path: str) -> str:
    return f"config key '{path}'" if path else "the config root"


def _walk(node: Any, path: str, tp: Any) -> None:
    if isinstance(node, Mapping):
        schema = schema_of(node, tp)
        if schema is not None:
            _check_typed(node, path, schema)
            return
        if TARGET_KEY in node:
            check_call_node(node, path)
        for key, value in node.items():
            _walk(value, _join(path, key), None)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _walk(value, _join(path, i), None)


def _check_typed(node: Any, path: str, schema: type) -> None:
    fields = field_types(schema)
    new = node.get(NEW_KEY) or []
    if not isinstance(new, list) or not all(isinstance(k, str) for k in new):
        raise KeyProblem(f"'{_join(path, NEW_KEY)}' must be a list of key names (the keys added with add()), "
                         f"not {value_repr(new)}.", _join(path, NEW_KEY))
    for key in node:
        if key not in fields and key not in new and key not in (SCHEMA_KEY, NEW_KEY):
            raise unknown_key_error(node, path, key, schema)
    values = {}
    for name, (tp, f) in fields.items():
        key = _join(path, name)
        if name in node:
            values[name] = conform_value(tp, node[name], key, f)
        else:
            values[name] = _default(schema, name, f, tp, path)
    head = {k: node[k] for k in (SCHEMA_KEY, NEW_KEY) if k in node}
    extras = {k: node[k] for k in node if k not in fields and k not in head}
    node.clear()
    for key, value in {**head, **values, **extras}.items():
        node[key] = value  # a ConfigDict turns plain dicts into ConfigDicts
    for name, (tp, _) in fields.items():
        _walk(node[name], _join(path, name), tp)
    for key in extras:
        _walk(node[key], _join(path, key), None)


def unknown_key_error(node: Mapping, path: str, key: Any, schema: type | None = None) -> KeyProblem:
    full = _join(path, key)
    paths = [_join(path, p) for p, _ in iter_key_paths(node) if p != key and not str(p).startswith(f"{key}.")]
    matches = closest_keys(full, paths)
    hint = f"Did you mean: {', '.join(repr(m) for m in matches)}? " if matches else "No existing key is similar. "
    owner = f" ({schema.__module__}.{schema.__qualname__} has no such key)" if schema is not None else ""
    return KeyProblem(
        f"Unknown config key '{full}'{owner}. {hint}Fix the spelling; to add a new key on purpose write "
        f"{path or 'cfg'}.add({key}=...) in a config file, or +{full}=... on the command line.", full)


def conform_value(tp: Any, value: Any, key: str, f: dataclasses.Field | None = None, owner: str = "") -> Any:
    """`value` in the form `tp` declares, or a `KeyProblem` naming `key` and what to write instead."""
    try:
        return conform(tp, value)
    except Mismatch as exc:
        default = f.default if f is not None else dataclasses.MISSING
        example = f" (the default is {default!r})" if default not in (dataclasses.MISSING, None) else ""
        hint = " ".join(h for h in (str(exc), _hint(tp)) if h)
        raise KeyProblem(
            f"Config key '{key}' expects {describe(tp)}{owner}{example}, but the config gives {value_repr(value)} of "
            f"type {type(value).__name__}. {hint}".rstrip(), key) from None


def _hint(tp: Any) -> str:
    kinds = scalar_kinds(tp)
    if kinds[:1] == [bool]:
        return "Write true or false (1 and 0 are ints, not bools)."
    if kinds[:1] == [int]:
        return "Write a whole number."
    if kinds[:1] == [float]:
        return "Write a number."
    if kinds[:1] == [str]:
        return "Write it as text (in quotes in a YAML or Python file)."
    return ""


# ---- LazyCall nodes -------------------------------------------------------------------------


def _parameters(target: Any) -> tuple[dict[str, tuple[Any, Any]], bool] | None:
    """``({name: (annotation, default)}, takes **kwargs)`` of a callable; None without a signature."""
    if target in _signatures:
        return _signatures[target]
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        _signatures[target] = None
        return None
    func = inspect.unwrap(target.__init__ if isinstance(target, type) else target)
    module = sys.modules.get(getattr(target, "__module__", "") or "")
    namespace = getattr(func, "__globals__", None) or (vars(module) if module else {})
    kinds = inspect.Parameter
    params, takes_any = {}, False
    for p in sig.parameters.values():
        if p.kind == kinds.VAR_KEYWORD:
            takes_any = True
        elif p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY):
            ann = p.annotation
            if ann is p.empty:
                ann = Any
            elif isinstance(ann, str):
                try:
                    ann = eval(ann, namespace)  # noqa: S307 - an annotation in an imported module
                except Exception:
                    ann = Any
            params[p.name] = (ann, p.default)
    try:
        _signatures[target] = (params, takes_any)
    except TypeError:  # an unhashable callable
        pass
    return params, takes_any


def check_call_node(node: Mapping, path: str) -> None:
    """Refuse keys of a LazyCall node its target does not take, and values its annotations rule out.

    A target that cannot be imported here is left to `instantiate`, which says why."""
    target = node[TARGET_KEY]
    if isinstance(target, str):
        try:
            target = _locate(target)
        except Exception:
            return
    if not callable(target):
        return
    found = _parameters(target)
    if found is None:
        return
    params, takes_any = found
    name = target_name(target)
    for key, value in node.items():
        if key == TARGET_KEY or not isinstance(key, str):
            continue
        full = _join(path, key)
        if key not in params:
            if takes_any:
                continue
            matches = closest_keys(full, [_join(path, p) for p in params])
            hint = f"Did you mean: {', '.join(repr(m) for m in matches)}? " if matches else ""
            short = getattr(target, "__name__", name)
            raise KeyProblem(
                f"Config key '{full}' is not a parameter of {name}, the _target_ of {_where(path)}. {hint}"
                f"{short} accepts: {', '.join(params) or 'no keyword arguments'}. Config keys are the keyword "
                f"arguments of the target; fix the spelling or remove the key.", full)
        ann, default = params[key]
        if (isinstance(value, Mapping) and TARGET_KEY in value) or (value is None and default is None):
            continue
        conform_value(ann, value, full, owner=f" (the parameter {key} of {name})")
