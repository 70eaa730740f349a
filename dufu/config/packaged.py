"""Configs shipped inside the package, in ``dufu/configs/`` (package data).

- `get_config("common/train.py")` loads one packaged config file;
- `list_recipes()` names the top-level recipes (``dufu/configs/<name>.py``);
- `resolve_config_path(arg)` turns a CLI argument (a path or a recipe name)
  into a file path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from dufu.errors import ConfigError

from .loader import load
from .node import closest

__all__ = ["get_config", "list_recipes", "resolve_config_path"]

_SUFFIXES = (".py", ".yaml", ".yml")


def _configs_root() -> Path:
    """The directory holding the packaged configs (``dufu/configs``)."""
    fallback = Path(__file__).resolve().parent.parent / "configs"
    try:
        root = resources.files("dufu.configs")
    except ModuleNotFoundError:
        return fallback
    if isinstance(root, Path):
        return root
    # A namespace package (no __init__.py) gives a multiplexed path; the
    # directory next to this package is the one shipped with it.
    if fallback.is_dir():
        return fallback
    raise ConfigError(
        "The packaged configs of dufu are not on the file system (dufu seems to be imported "
        "from a zip archive). Install dufu as a normal wheel or from a source checkout, or pass "
        "the path to a config file instead of a recipe name."
    )


def _packaged_files(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix in _SUFFIXES and p.is_file() and "__pycache__" not in p.parts
    )


def list_recipes() -> list[str]:
    """Sorted names of the top-level recipes: ``dufu/configs/<name>.py``, excluding ``_*``."""
    root = _configs_root()
    if not root.is_dir():
        return []
    return sorted(
        p.stem for p in root.glob("*.py") if p.is_file() and not p.name.startswith("_")
    )


def get_config(name: str, keys: str | tuple[str, ...] | None = None) -> Any:
    """Load a packaged config by its path inside ``dufu/configs`` (``.py`` may be omitted).

    >>> train = get_config("common/train.py").train  # doctest: +SKIP
    """
    root = _configs_root()
    rel = str(name).strip("/")
    candidates = [root / rel]
    if Path(rel).suffix not in _SUFFIXES:
        candidates.append(root / f"{rel}.py")
    for path in candidates:
        if path.is_file():
            return load(path, keys=keys)
    files = _packaged_files(root)
    matches = closest(rel, files) or closest(f"{rel}.py", files)
    hint = f" Did you mean: {', '.join(repr(m) for m in matches)}?" if matches else ""
    raise ConfigError(
        f"There is no packaged config {name!r} in {root}.{hint} Names are paths inside "
        f"dufu/configs, such as 'common/train.py'; run `dufu configs` to list the recipes."
    )


def resolve_config_path(arg: str | Path) -> Path:
    """The config file a CLI argument means: an existing file, else a packaged recipe name.

    ``"gpt2_small"``, ``"gpt2_small.py"`` and ``"common/train"`` all resolve
    to files in ``dufu/configs``.
    """
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    text = str(arg)
    root = _configs_root()
    rel = text.strip("/")
    candidates = []
    if Path(rel).suffix in _SUFFIXES:
        candidates.append(root / rel)
    else:
        candidates.append(root / f"{rel}.py")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    recipes = list_recipes()
    matches = closest(Path(rel).stem if Path(rel).suffix == ".py" else rel, recipes, cutoff=0.5)
    hint = f" Did you mean: {', '.join(repr(m) for m in matches)}?" if matches else ""
    if path.is_dir():
        what = f"{text!r} is a directory, not a config file"
    else:
        what = f"{text!r} is neither an existing config file nor a packaged recipe"
    raise ConfigError(
        f"{what}.{hint} Pass the path to a .py or .yaml config file, or a recipe name; run "
        f"`dufu configs` to list the packaged recipes."
    )
