"""`instantiate`: turn a config tree into objects, and the import-path helpers it needs.

Every mapping with a ``_target_`` key is called as ``target(**kwargs)`` after
its values have been instantiated (depth first). A ``_target_`` may be the
callable itself or a dotted import path such as ``"torch.optim.AdamW"``;
attributes of classes work too (``"datetime.datetime.fromisoformat"``).

Mistakes in the config (a misspelt import path, a key that is not a
parameter of the target, a missing required parameter) raise `ConfigError`
naming the config key. Exceptions raised *inside* the target are real errors
and propagate unchanged, with a note saying which config key was being built.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from dufu.errors import ConfigError

from .lazy import TARGET_KEY, target_name
from .node import ConfigDict, closest

__all__ = ["callable_path", "instantiate", "locate"]


class _LocateError(Exception):
    """Internal: why a dotted path could not be resolved (message is the reason)."""


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return f"config key '{path}'" if path else "the config root"


def _locate(path: str) -> Any:
    """Import the object named by dotted `path`, or raise `_LocateError` saying why not.

    The longest importable module prefix is imported, the rest is read with
    getattr. A missing *dependency* inside an existing module is not a config
    mistake, so that ImportError propagates.
    """
    parts = path.split(".")
    if not path or not all(p.isidentifier() for p in parts):
        raise _LocateError(f"{path!r} is not a dotted import path like 'package.module.Name'")
    obj: Any = None
    n_module = 0
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                break
            raise
        n_module = i
    if n_module == 0:
        raise _LocateError(f"there is no module named {parts[0]!r}")
    for i in range(n_module, len(parts)):
        attr = parts[i]
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            owner = ".".join(parts[:i])
            kind = "module" if inspect.ismodule(obj) else type(obj).__name__
            public = [n for n in dir(obj) if not n.startswith("_")]
            matches = closest(attr, public)
            hint = f" (closest: {', '.join(repr(m) for m in matches)})" if matches else ""
            raise _LocateError(f"{kind} '{owner}' has no attribute {attr!r}{hint}") from None
    return obj


def locate(path: str) -> Any:
    """Import and return the object named by a dotted path such as ``"torch.optim.AdamW"``."""
    try:
        return _locate(path)
    except _LocateError as exc:
        raise ConfigError(
            f"Cannot import {path!r}: {exc}. Check the spelling; the path must be "
            f"'package.module.Name' of an importable module."
        ) from None


def callable_path(obj: Any, key: str = "") -> str:
    """The dotted import path of a class or function, checked to import back to `obj`.

    Raises `ConfigError` naming `key` for lambdas, local functions and other
    callables that cannot be re-imported by name (they cannot be written to a
    config file).
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    where = _where(key)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
        kind = "lambda" if qualname and "<lambda>" in qualname else "local or unnamed callable"
        raise ConfigError(
            f"The value of {where} is a {kind} ({obj!r}), which cannot be written to a config "
            f"file because it cannot be imported by name. Define it at the top level of an "
            f"importable module (not inside a function or a config file) and use that."
        )
    path = f"{module}.{qualname}"
    try:
        found = _locate(path)
    except (_LocateError, ImportError):
        found = None
    if found is not obj and (found is None or found != obj):
        raise ConfigError(
            f"The value of {where} is {obj!r}, whose import path {path!r} does not import back "
            f"to the same object (it may be defined inside a config file or generated at run "
            f"time). Move it to the top level of an importable module and use that."
        )
    return path


def instantiate(cfg: Any, *, key: str = "") -> Any:
    """Build objects from a config tree; the input is never modified.

    - a mapping with ``_target_``: ``target(**{k: instantiate(v)})``;
    - any other mapping: a new `ConfigDict` of instantiated values;
    - a list or tuple: a new one of the same type, element-wise;
    - anything else: returned as is.

    `key` is the config key path of `cfg` (e.g. ``"model"``), used only to
    make error messages point at the right line of the config.
    """
    return _instantiate(cfg, key)


def _instantiate(node: Any, path: str) -> Any:
    if isinstance(node, dict):
        if TARGET_KEY in node:
            return _call(node, path)
        out = ConfigDict()
        for k, v in node.items():
            # dict.__setitem__: objects built by targets are stored as they are,
            # not converted to ConfigDicts.
            dict.__setitem__(out, k, _instantiate(v, _join(path, k)))
        return out
    if isinstance(node, (list, tuple)):
        items = [_instantiate(v, _join(path, i)) for i, v in enumerate(node)]
        if type(node) in (list, tuple):
            return type(node)(items)  # always a new container: the output never aliases the config
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
            return type(node)(*items)
        if all(new is old for new, old in zip(items, node)):
            return node  # other sequence types (torch.Size, ...) with nothing to build
        return type(node)(items)
    return node


def _resolve_target(raw: Any, path: str) -> Any:
    where = f"'{_join(path, TARGET_KEY)}'"
    if isinstance(raw, str):
        try:
            target = _locate(raw)
        except _LocateError as exc:
            raise ConfigError(
                f"Cannot import the _target_ {raw!r} of {_where(path)}: {exc}. Fix the import path "
                f"in {where} (it must be 'package.module.Name'), or set the node with "
                f"LazyCall(Name)(...) using the class itself."
            ) from None
    else:
        target = raw
    if not callable(target):
        raise ConfigError(
            f"The _target_ of {_where(path)} is {raw!r} of type {type(target).__name__}, which "
            f"cannot be called. {where} must be a class, a function, or a dotted import path "
            f"naming one."
        )
    return target


def _call(node: dict, path: str) -> Any:
    target = _resolve_target(node[TARGET_KEY], path)
    kwargs: dict[str, Any] = {}
    for k, v in node.items():
        if k == TARGET_KEY:
            continue
        if not isinstance(k, str):
            raise ConfigError(
                f"{_where(path)} has the non-string key {k!r}, but the keys of a node with "
                f"_target_ are keyword arguments and must be strings. Rename the key."
            )
        kwargs[k] = _instantiate(v, _join(path, k))
    _check_arguments(target, kwargs, path)
    name = target_name(target)
    try:
        return target(**kwargs)
    except TypeError as exc:
        # Without a signature (some builtins) the argument check above could not run;
        # a TypeError raised by the call itself (no deeper frame) is then a config mistake.
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None and (
            "keyword argument" in str(exc)
        ):
            raise ConfigError(
                f"Cannot instantiate {_where(path)} with {name}: {exc}. Fix the keys of "
                f"{_where(path)} so that they match the parameters of {name}."
            ) from exc
        _add_note(exc, path, name)
        raise
    except Exception as exc:
        _add_note(exc, path, name)
        raise


def _add_note(exc: BaseException, path: str, name: str) -> None:
    """Say which config node was being built, without changing the exception (Python >= 3.11)."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised while instantiating {_where(path)} with _target_ {name})")


def _check_arguments(target: Any, kwargs: dict[str, Any], path: str) -> None:
    """Raise ConfigError if `kwargs` cannot be bound to `target`'s signature."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return  # no introspectable signature; the call itself will tell
    params = list(sig.parameters.values())
    kinds = inspect.Parameter
    keyword_kinds = (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    accepted = [p.name for p in params if p.kind in keyword_kinds]
    takes_any = any(p.kind == kinds.VAR_KEYWORD for p in params)
    name = target_name(target)
    short = getattr(target, "__name__", name)
    accepted_text = ", ".join(accepted) if accepted else "no keyword arguments"

    unexpected = [] if takes_any else [k for k in kwargs if k not in accepted]
    if unexpected:
        details = []
        for k in unexpected:
            matches = closest(k, [a for a in accepted if a not in kwargs]) or closest(k, accepted)
            hint = f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""
            details.append(f"'{_join(path, k)}'{hint}")
        noun = "is not a parameter" if len(unexpected) == 1 else "are not parameters"
        raise ConfigError(
            f"Config key {', '.join(details)} {noun} of {name}, the _target_ of "
            f"{_where(path)}. {short} accepts: {accepted_text}. Rename or remove the key; "
            f"config keys must equal the keyword arguments of the target."
        )

    positional_only = [
        p.name for p in params if p.kind == kinds.POSITIONAL_ONLY and p.default is p.empty
    ]
    if positional_only:
        raise ConfigError(
            f"{name}, the _target_ of {_where(path)}, has required positional-only parameter(s) "
            f"{', '.join(positional_only)}, which a config cannot pass (configs only pass "
            f"keyword arguments). Use a function with keyword parameters as the _target_."
        )
    missing = [
        p.name
        for p in params
        if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        and p.default is p.empty
        and p.name not in kwargs
    ]
    if missing:
        where = _where(path)
        first = _join(path, missing[0])
        raise ConfigError(
            f"{where[0].upper()}{where[1:]} does not set the required parameter(s) "
            f"{', '.join(repr(m) for m in missing)} of its _target_ {name}. Add them in the "
            f"config file, or on the command line with `+{first}=VALUE`."
        )
