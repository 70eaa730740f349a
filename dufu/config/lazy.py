"""`LazyCall`: record a call in the config instead of making it.

``LazyCall(GPT)(hidden_size=768)`` is just
``ConfigDict(_target_=GPT, hidden_size=768)``: plain data that recipes edit
(``model.hidden_size = 1024``) before `instantiate` makes the call. Library
classes never see a config object; they receive keyword arguments.
"""

from __future__ import annotations

import re
from typing import Any

from dufu.errors import ConfigError

from .node import TARGET_KEY, ConfigDict

__all__ = ["LazyCall", "TARGET_KEY"]

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def target_name(target: Any) -> str:
    """A readable name for a `_target_` value (callable or dotted string)."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qualname is None:
        return repr(target)
    return f"{module}.{qualname}" if module else qualname


class LazyCall:
    """Wrap a callable (or a dotted import path) so that calling it records the call.

    >>> from collections import OrderedDict
    >>> node = LazyCall(OrderedDict)(a=1)
    >>> node["_target_"] is OrderedDict, node.a
    (True, 1)

    Only keyword arguments are accepted: config keys are the callable's
    keyword arguments, which is what makes ``model.hidden_size = 1024`` work.
    """

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        if isinstance(target, str):
            if not _DOTTED.match(target):
                raise ConfigError(
                    f"LazyCall got the string {target!r}, which is not a dotted import path. "
                    f"Pass the class or function itself, or its full path such as "
                    f"'torch.optim.AdamW'."
                )
        elif not callable(target):
            raise ConfigError(
                f"LazyCall needs a class, a function or a dotted import path string, but got "
                f"{target!r} of type {type(target).__name__}. Pass the callable that should "
                f"build the object, e.g. LazyCall(torch.optim.AdamW)(lr=1e-3)."
            )
        self._target = target

    def __call__(self, *args: Any, **kwargs: Any) -> ConfigDict:
        name = target_name(self._target)
        if args:
            raise ConfigError(
                f"LazyCall({name}) got {len(args)} positional argument(s) {args!r}; only keyword "
                f"arguments are allowed, because every argument becomes a named config key. "
                f"Write LazyCall({name})(name=value, ...) using the parameter names of {name}."
            )
        if TARGET_KEY in kwargs:
            raise ConfigError(
                f"LazyCall({name}) got a keyword argument named {TARGET_KEY!r}, which is reserved "
                f"for the callable itself. Rename that argument."
            )
        node = ConfigDict()
        node[TARGET_KEY] = self._target
        node.update(kwargs)
        return node

    def __repr__(self) -> str:
        return f"LazyCall({target_name(self._target)})"
