"""Loading configs from ``.py`` and ``.yaml`` files.

A ``.py`` config is executed as a fresh module and its public top-level data
(ConfigDicts, dicts, lists, tuples and scalars) becomes the config. Config
files derive from each other with *relative* imports, which are resolved as
file paths, so a directory of configs needs no ``__init__.py`` and need not
be importable::

    from .common.train import train          # <this dir>/common/train.py
    from ..common.optim import optim         # <parent dir>/common/optim.py
    from . import data                       # <this dir>/data.py (as a module)

Every import re-executes the imported file, and every `load` returns deep
copies, so editing a loaded config never changes another one. Absolute
imports are ordinary Python imports: share configs between files only with
relative imports (an absolutely imported config module would be one shared,
mutable object).

Each file is checked as soon as it has been executed or read
(`dufu.config.schema.check_config`): an unknown key or a value of the wrong
type in a typed node, or a key a LazyCall target does not take, is an error
naming the file, the line where the key is set (when it can be found) and the
closest existing keys, exactly as for a command-line override.
"""

from __future__ import annotations

import builtins
import copy
import itertools
import re
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from dufu.errors import ConfigError

from .node import ConfigDict, closest, convert_dicts
from .schema import KeyProblem, check_config

__all__ = ["load"]

# Set in the globals of every executing config file; the import hook only
# touches relative imports made from globals carrying it.
_MARKER = "__dufu_config_file__"
_SUFFIXES = (".py", ".yaml", ".yml")
_DATA_TYPES = (dict, list, tuple, str, int, float, bool, type(None))

_counter = itertools.count()
_hook_lock = threading.RLock()
_hook_state: dict[str, Any] = {"depth": 0, "original": None}
_loading = threading.local()  # .stack: files being executed, for cycle detection


def load(path: str | Path, keys: str | tuple[str, ...] | list[str] | None = None) -> Any:
    """Load a ``.py`` or ``.yaml`` config file into a `ConfigDict`.

    With `keys` a single name, return only that top-level value; with a tuple
    (or list) of names, return a tuple of those values.
    """
    file = _check_file(path)
    if file.suffix == ".py":
        namespace = _exec_config(file)
        cfg = ConfigDict()
        for name, value in namespace.items():
            if name.startswith("_") or not isinstance(value, _DATA_TYPES):
                continue
            cfg[name] = value
        # Values reached through absolute imports could be shared module state;
        # the deep copy makes every load independent.
        cfg = copy.deepcopy(cfg)
    else:
        cfg = _load_yaml(file)
        _check(cfg, file)
    if keys is None:
        return cfg
    if isinstance(keys, str):
        return _pick(cfg, keys, file)
    return tuple(_pick(cfg, k, file) for k in keys)


def _pick(cfg: ConfigDict, key: str, file: Path) -> Any:
    if key not in cfg:
        matches = closest(key, cfg.keys())
        hint = f"Did you mean: {', '.join(repr(m) for m in matches)}? " if matches else ""
        raise ConfigError(
            f"Config file {file} defines no top-level key {key!r}. {hint}It defines: "
            f"{', '.join(map(str, cfg.keys())) or 'nothing'}. Load one of those keys instead."
        )
    return cfg[key]


def _check_file(path: str | Path) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory, not a file" if file.is_dir() else "does not exist"
        raise ConfigError(
            f"Config file {str(path)!r} {what} (looked at {file.resolve()}). Check the path; "
            f"to use a packaged recipe pass its name instead, and run `dufu configs` to list them."
        )
    if file.suffix not in _SUFFIXES:
        raise ConfigError(
            f"Config file {str(path)!r} has the extension {file.suffix!r}, but configs must be "
            f"Python (.py) or YAML (.yaml/.yml) files. Rename the file or pass the right one."
        )
    return file


# ---- YAML ---------------------------------------------------------------------------


def _load_yaml(file: Path) -> ConfigDict:
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"YAML syntax error in config file {where}: {problem}. Fix the YAML at that line "
            f"(configs written by dufu always parse; was the file edited by hand?)."
        ) from None
    if data is None:
        return ConfigDict()
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {file} holds a YAML {type(data).__name__}, but a config must be a "
            f"mapping of top-level keys (e.g. `train:` and `model:`). Fix the file's top level."
        )
    return ConfigDict(data)


# ---- Python configs -------------------------------------------------------------------


def _exec_config(file: Path) -> dict[str, Any]:
    """Execute config file `file` as a new module; return its namespace."""
    file = file.resolve()
    stack: list[Path] = getattr(_loading, "stack", None) or []
    _loading.stack = stack
    if file in stack:
        chain = " -> ".join(str(p) for p in [*stack[stack.index(file) :], file])
        raise ConfigError(
            f"Config files import each other in a cycle: {chain}. Move the shared part into "
            f"its own file that both import."
        )
    source = file.read_text(encoding="utf-8")
    try:
        code = compile(source, str(file), "exec")
    except SyntaxError as exc:
        line = f" (`{exc.text.strip()}`)" if exc.text and exc.text.strip() else ""
        raise _located(ConfigError(
            f"Syntax error in config file {exc.filename or file}:{exc.lineno}: {exc.msg}{line}. "
            f"Config files are plain Python; fix the syntax at that line."
        )) from None
    namespace: dict[str, Any] = {
        "__name__": f"dufu.config._loaded_{next(_counter)}_{file.stem}",
        "__file__": str(file),
        "__builtins__": builtins,
        _MARKER: True,
    }
    stack.append(file)
    try:
        with _relative_import_hook():
            exec(code, namespace)
    except ConfigError as exc:
        located = _with_location(exc, file)
        if located is exc:
            raise
        raise located from exc
    finally:
        stack.pop()
    _check({k: v for k, v in namespace.items() if not k.startswith("_") and isinstance(v, _DATA_TYPES)}, file)
    return namespace


def _check(data: Any, file: Path) -> None:
    """`check_config` on what `file` defines; an error names the file and, when found, the key's line."""
    try:
        check_config(data)
    except KeyProblem as exc:
        line = _key_line(file, exc.key)
        where = f"In config file {file}, line {line}" if line else f"In config file {file}"
        raise _located(KeyProblem(f"{where}: {exc}", exc.key)) from None
    except ConfigError as exc:
        raise _located(ConfigError(f"In config file {file}: {exc}")) from None


def _key_line(file: Path, key: str) -> int | None:
    """The line of `file` that sets the dotted `key`: in Python the last assignment to it (``a.b.c = ...`` or
    ``c=...`` in a call), in YAML the nested ``c:`` under ``a:`` and ``b:``."""
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    parts = key.split(".")
    if file.suffix == ".py":
        for pattern in (rf"\b{re.escape(key)}\s*=(?!=)", rf"\b{re.escape(parts[-1])}\s*=(?!=)",
                        rf"\b{re.escape(parts[-1])}\b"):
            found = [n for n, text in enumerate(lines, 1) if re.search(pattern, text.split("#")[0])]
            if found:
                return found[-1]
        return None
    start, child, found = 0, 0, None
    for part in parts:
        found = None
        for n in range(start, len(lines)):
            text = lines[n].split(" #")[0].rstrip()
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            indent = len(text) - len(text.lstrip())
            if indent < child:
                return None  # past the parent's block
            if indent == child and re.match(rf"['\"]?{re.escape(part)}['\"]?\s*:", text.lstrip()):
                found = n
                break
        if found is None:
            return None
        start = found + 1
        below = next((ln for ln in lines[start:] if ln.strip() and not ln.lstrip().startswith("#")), "")
        child = len(below) - len(below.lstrip())
    return found + 1 if found is not None else None


def _located(exc: ConfigError) -> ConfigError:
    exc._dufu_config_location = True  # type: ignore[attr-defined]
    return exc


def _with_location(exc: ConfigError, file: Path) -> ConfigError:
    """`exc` with "In config file F, line N:" prefixed, pointing at the line of `file` that
    raised it (e.g. a misspelt key read in a recipe); the CLI shows no traceback."""
    if getattr(exc, "_dufu_config_location", False):
        return exc
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(file):
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return exc
    message = f"In config file {file}, line {line}: {exc}"
    try:
        located = type(exc)(message)
    except Exception:
        located = ConfigError(message)
    located._dufu_config_location = True  # type: ignore[attr-defined]
    return located


_PACKAGED = "dufu.configs"
_PACKAGED_DIR = Path(__file__).resolve().parent.parent / "configs"


@contextmanager
def _relative_import_hook() -> Iterator[None]:
    """Route relative imports made by config files to `_import_config` (re-entrant).

    The lock is held while configs execute, so loads in different threads run
    one after another and the original ``__import__`` is restored exactly once.
    """
    with _hook_lock:
        if _hook_state["depth"] == 0:
            original = builtins.__import__
            _hook_state["original"] = original

            def hooked_import(name, globals=None, locals=None, fromlist=(), level=0):
                if level > 0 and globals is not None and globals.get(_MARKER):
                    return _import_config(globals["__file__"], name, fromlist or (), level)
                if level == 0 and fromlist and name.startswith(_PACKAGED + ".") and globals is not None \
                        and globals.get(_MARKER):
                    # `from dufu.configs.common.train import train` in a config of one's own folder: executed
                    # afresh like a relative import, so that what one config edits no other load sees (Python's
                    # import would hand every config in the process the same module-level node).
                    return _import_config(str(_PACKAGED_DIR / "__init__.py"), name[len(_PACKAGED) + 1:], fromlist, 1)
                return original(name, globals, locals, fromlist, level)

            builtins.__import__ = hooked_import
        _hook_state["depth"] += 1
        try:
            yield
        finally:
            _hook_state["depth"] -= 1
            if _hook_state["depth"] == 0:
                builtins.__import__ = _hook_state["original"]
                _hook_state["original"] = None


def _module_from(file: Path, namespace: dict[str, Any]) -> types.ModuleType:
    """The executed file as a module; its plain dicts become ConfigDicts, as in `load`,
    so the importing file can edit them with attribute access."""
    module = types.ModuleType(namespace["__name__"])
    for name, value in namespace.items():
        if name == "__builtins__":
            continue
        if not name.startswith("_"):
            value = convert_dicts(value)
        setattr(module, name, value)
    module.__file__ = str(file)
    return module


def _import_config(
    importer: str, name: str, fromlist: tuple[str, ...], level: int
) -> types.ModuleType:
    """``from <dots><name> import <fromlist>`` inside config file `importer`."""
    base = Path(importer).parent
    for _ in range(level - 1):
        base = base.parent
    statement = f"from {'.' * level}{name} import {', '.join(fromlist)}"
    target = base.joinpath(*name.split(".")) if name else base
    py_file = target.with_name(target.name + ".py") if name else None

    if py_file is not None and py_file.is_file():
        module = _module_from(py_file, _exec_config(py_file))
        missing = [n for n in fromlist if n != "*" and not hasattr(module, n)]
        if missing:
            public = [k for k in vars(module) if not k.startswith("_")]
            matches = closest(missing[0], public)
            hint = f" Did you mean: {', '.join(repr(m) for m in matches)}?" if matches else ""
            raise ConfigError(
                f"`{statement}` failed: {py_file} defines no "
                f"{', '.join(repr(m) for m in missing)}.{hint} It defines: "
                f"{', '.join(public) or 'nothing'}. Fix the imported name."
            )
        return module

    if target.is_dir():
        # `from .common import train`: each imported name is a file in that directory.
        module = types.ModuleType(f"dufu.config._dir_{next(_counter)}_{target.name}")
        module.__path__ = [str(target)]  # type: ignore[attr-defined]
        for item in fromlist:
            if item == "*":
                raise ConfigError(
                    f"`{statement}` cannot work: {target} is a "
                    f"directory, and `import *` needs a file. Import from the file instead, "
                    f"e.g. `from {'.' * level}{name + '.' if name else ''}train import *`."
                )
            item_file = target / f"{item}.py"
            if not item_file.is_file():
                raise ConfigError(
                    f"`{statement}` failed: there is no config file "
                    f"{item_file}. Relative imports in configs name files relative to the "
                    f"importing file's directory; fix the path."
                )
            setattr(module, item, _module_from(item_file, _exec_config(item_file)))
        return module

    raise ConfigError(
        f"`{statement}` failed: there is no config file "
        f"{py_file if py_file is not None else target}. Relative imports in configs name files "
        f"relative to the importing file's directory (one dot = the same directory, two dots "
        f"= its parent); fix the path.{_packaged_hint(name, fromlist, level)}"
    )


def _packaged_hint(name: str, fromlist: tuple[str, ...], level: int) -> str:
    """When ``from .<name> import ...`` names one of dufu's own config files (a recipe copied out of the
    package), the absolute import that works from any folder."""
    if level != 1 or not name:
        return ""
    if not _PACKAGED_DIR.joinpath(*name.split(".")).with_suffix(".py").is_file():
        return ""
    return (f" dufu's own config files are a package: from a config in your own folder, write "
            f"`from dufu.configs.{name} import {', '.join(fromlist)}`.")
