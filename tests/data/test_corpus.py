import pytest

from dufu.data import BUILTIN, builtin_documents, read_documents
from dufu.errors import DataError


def test_builtin_corpus_is_deterministic_and_sizeable():
    docs = builtin_documents()
    assert docs == builtin_documents()
    assert len(docs) > 50
    assert 300_000 < sum(len(d) for d in docs) < 2_000_000
    assert list(read_documents(BUILTIN)) == docs


def test_directory_reads_txt_and_jsonl_sorted_recursively(text_dir):
    docs = list(read_documents(text_dir))
    # sorted paths: a.txt, c.jsonl (3 docs), sub/b.txt; README.md and hidden files skipped
    assert docs == [
        "First document.\nIt has two lines.\n",
        "jsonl one",
        "jsonl two, a bit longer",
        "jsonl three ✓",
        "Zweites Dokument: grüße aus Köln.",
    ]


def test_list_of_inputs_in_order(text_dir):
    docs = list(read_documents([text_dir / "sub" / "b.txt", text_dir / "a.txt"]))
    assert docs == ["Zweites Dokument: grüße aus Köln.", "First document.\nIt has two lines.\n"]


def test_jsonl_custom_key_and_blank_lines(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"content": "a"}\n\n{"content": "b"}\n', encoding="utf-8")
    assert list(read_documents(f, json_key="content")) == ["a", "b"]


def test_jsonl_bad_line_reports_line_number(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "broken"\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"Line 2 of .*bad\.jsonl is not valid JSON"):
        list(read_documents(f))


def test_jsonl_missing_key(tmp_path):
    f = tmp_path / "nokey.jsonl"
    f.write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"Line 1 .* no field 'text'.*json_key"):
        list(read_documents(f))


def test_missing_and_unsupported_paths_fail_at_call_time(tmp_path):
    with pytest.raises(DataError, match=r"does-not-exist does not exist.*\.jsonl"):
        read_documents(tmp_path / "does-not-exist")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"unsupported type '\.csv'"):
        read_documents(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="contains no .txt or .jsonl files"):
        read_documents(tmp_path / "empty")
