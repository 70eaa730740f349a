"""Fixtures for the dufu.config tests."""

import textwrap
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def write_configs(tmp_path):
    """Write ``{relative_path: source}`` under a fresh directory; return that directory."""

    def write(files: dict[str, str], root: Path | None = None) -> Path:
        root = root or tmp_path / "configs"
        for rel, source in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source).lstrip(), encoding="utf-8")
        return root

    return write


@pytest.fixture
def fixture_configs() -> Path:
    """A small tree of config files checked into tests/config/fixtures/configs."""
    return FIXTURES / "configs"
