"""Every test file is collected by pytest with the repository's configuration (pyproject.toml).

A directory pytest does not recurse into (``norecursedirs``: ``build``, ``dist``, ``*.egg`` ... by default), a
file name outside ``python_files``, or a conftest that ignores a path silently drops tests: tests/dist was
such a directory. This runs ``pytest --collect-only`` as CI does and names every ``tests/**/test_*.py`` file
that contributed nothing (a module skipped as a whole is reported by pytest as skipped, and counts as seen).
"""

from __future__ import annotations

import re
import sys

import launch
from launch import REPO


def test_every_test_file_is_collected(tmp_path):
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
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
    missed = [f for f in files if f not in seen]
    assert files and not missed, (
        f"pytest does not collect {', '.join(missed)}: a directory in norecursedirs, a name outside python_files, "
        f"or a conftest's collect_ignore? (pytest --collect-only output, end:\n{proc.stdout[-2000:]})")
