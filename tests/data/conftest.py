import json

import pytest

from dufu.data import build_tokenizer


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty dufu cache (never ~/.cache/dufu)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("DUFU_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def byte_tok():
    return build_tokenizer("byte")


@pytest.fixture
def text_dir(tmp_path):
    """A directory with two .txt documents and a .jsonl file of three documents."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("First document.\nIt has two lines.\n", encoding="utf-8")
    (d / "sub" / "b.txt").write_text("Zweites Dokument: grüße aus Köln.", encoding="utf-8")
    lines = [{"text": "jsonl one"}, {"text": "jsonl two, a bit longer"}, {"text": "jsonl three ✓", "id": 3}]
    (d / "c.jsonl").write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n", encoding="utf-8")
    (d / "README.md").write_text("ignored: not .txt/.jsonl", encoding="utf-8")
    (d / ".hidden.txt").write_text("ignored: hidden", encoding="utf-8")
    return d
