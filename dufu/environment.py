"""Environment variables set for a block of code, and restored after it (imports nothing heavy: the launcher uses
it before torch is imported)."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def environment(variables):
    """``os.environ`` with ``variables`` (a dict, or (name, value) pairs; a value of None removes the variable) while
    the block runs, each restored (or removed) after it."""
    variables = dict(variables)
    saved = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
