"""Every test file is collected by pytest with the repository's configuration (pyproject.toml).

A directory pytest does not recurse into (``norecursedirs``: ``build``, ``dist``, ``*.egg`` ... by default), a
file name outside ``python_files``, or a conftest that ignores a path silently drops tests: tests/dist was
such a directory. This runs ``pytest --collect-only`` as CI does and names every ``tests/**/test_*.py`` file
that contributed nothing (a module skipped as a whole is reported by pytest as skipped, and counts as seen).
When this session is the whole suite, it is that collection: the files it collected, before any deselection
(tests/conftest.py records them), are checked without collecting again.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import launch
from launch import REPO


def _whole_suite(config) -> bool:
    """Whether this session collected the whole of tests/ (the README's command), not a part of it."""
    args = [a for a in config.args if not a.startswith("-")] or list(config.getini("testpaths"))
    return [Path(config.rootpath, a).resolve() for a in args] == [REPO / "tests"]


def test_every_test_file_is_collected(request, collected_files):
    if _whole_suite(request.config):  # this session is CI's collection: what it saw (tests/conftest.py)
        seen = collected_files
        output = f"{len(seen)} files seen by this session"
    else:
        proc = launch.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=REPO, timeout=300)
        assert proc.returncode == 0, f"collection failed:\n{proc.describe()}"
        seen = set()
        for line in proc.stdout.splitlines():
            if "::" in line:
                seen.add(line.split("::", 1)[0].strip())
            m = re.match(r"SKIPPED \[\d+\] (\S+?\.py)", line)  # a whole module skipped at import
            if m:
                seen.add(m.group(1))
        output = proc.stdout[-2000:]
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
    missed = [f for f in files if f not in seen]
    assert files and not missed, (
        f"pytest does not collect {', '.join(missed)}: a directory in norecursedirs, a name outside python_files, "
        f"or a conftest's collect_ignore? (pytest --collect-only output, end:\n{output})")
