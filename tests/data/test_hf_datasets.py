"""Hugging Face datasets files as input: .parquet, .arrow (both Arrow IPC formats), save_to_disk directories and
.jsonl written by datasets give the same tokens as the same text in .txt files; a missing text column is an error
listing the columns; records for SFT-style fields."""

import json
import shutil

import numpy as np
import pytest

from dufu.data import BlendedDataset, build_lm_datasets, read_documents
from dufu.data.corpus import input_fingerprint, resolve_sources
from dufu.data.hf_datasets import read_records
from dufu.errors import DataError

datasets = pytest.importorskip("datasets")

DOCS = ["First document.\nIt has two lines.\n", "Zweites Dokument: grüße aus Köln.", "", "jsonl three ✓",
        "a fifth, rather longer document " * 20]


@pytest.fixture
def table():
    return datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS,
                                       "prompt": [f"p{i}" for i in range(len(DOCS))]})


@pytest.fixture
def txt_dir(tmp_path):
    """The same documents as .txt files, one per document, in sorted order."""
    d = tmp_path / "txt"
    d.mkdir()
    for i, text in enumerate(DOCS):
        (d / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return d


def tokens(path, tok, **kw):
    train, _ = build_lm_datasets(path, tok, seq_length=8, valid_fraction=0, **kw)
    return np.asarray(train.indexed.tokens), np.asarray(train.indexed.doc_offsets)


def make_inputs(tmp_path, table):
    """Every kind of datasets file holding ``table``."""
    out = {}
    out["parquet"] = tmp_path / "docs.parquet"
    table.to_parquet(str(out["parquet"]))
    out["save_to_disk"] = tmp_path / "saved"
    table.save_to_disk(str(out["save_to_disk"]))
    out["arrow (datasets' stream file)"] = tmp_path / "docs.arrow"
    shutil.copy(next(out["save_to_disk"].glob("*.arrow")), out["arrow (datasets' stream file)"])
    import pyarrow.feather

    out["arrow (IPC file)"] = tmp_path / "docs_ipc.arrow"
    pyarrow.feather.write_feather(table.data.table, str(out["arrow (IPC file)"]), compression="uncompressed")
    out["jsonl (written by datasets)"] = tmp_path / "docs.jsonl"
    table.to_json(str(out["jsonl (written by datasets)"]), force_ascii=False)
    return out


def test_every_kind_gives_the_tokens_of_the_same_text(tmp_path, table, txt_dir, byte_tok):
    expected_tokens, expected_offsets = tokens(txt_dir, byte_tok)
    assert len(expected_offsets) == len(DOCS)  # the empty document is skipped, as for any input
    for kind, path in make_inputs(tmp_path, table).items():
        assert list(read_documents(path)) == DOCS, kind
        got_tokens, got_offsets = tokens(path, byte_tok)
        assert np.array_equal(got_tokens, expected_tokens), kind
        assert np.array_equal(got_offsets, expected_offsets), kind


def test_text_column_is_json_key(tmp_path, table, byte_tok):
    path = tmp_path / "docs.parquet"
    table.to_parquet(str(path))
    assert list(read_documents(path, json_key="prompt")) == [f"p{i}" for i in range(len(DOCS))]
    a, _ = tokens(path, byte_tok, json_key="prompt")
    assert byte_tok.decode(a.tolist()).startswith("p0<|endoftext|>p1")


def test_missing_text_column_lists_the_columns(tmp_path, table, byte_tok, cache_dir):
    for kind, path in make_inputs(tmp_path, table).items():
        if path.suffix == ".jsonl":
            continue  # dufu's own reader: the message names the line (tests/data/test_corpus.py)
        with pytest.raises(DataError, match=r"has no column 'content'; its columns are \['id', 'text', 'prompt'\]\. "
                                            r"Set json_key \(--json-key\) to the column"):
            build_lm_datasets(path, byte_tok, seq_length=8, json_key="content")
    assert not list((cache_dir / "datasets").glob("*/data.bin"))


def test_a_null_text_names_its_row(tmp_path, byte_tok):
    path = tmp_path / "nulls.parquet"
    datasets.Dataset.from_dict({"text": ["fine", None, "fine"]}).to_parquet(str(path))
    with pytest.raises(DataError, match=r"Row 1 of data file .*nulls.parquet: column 'text' is null, not a string"):
        build_lm_datasets(path, byte_tok, seq_length=2, valid_fraction=0)


def test_dataset_dict_directory_asks_for_a_split(tmp_path, table):
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"holds the splits \['train', 'test'\]\. Pass the directory of one split"):
        resolve_sources(tmp_path / "dd")
    assert list(read_documents(tmp_path / "dd" / "train")) == DOCS


def test_directory_scan_reads_datasets_files_and_save_to_disk_directories(tmp_path, table):
    root = tmp_path / "mixed"
    (root / "b").mkdir(parents=True)
    table.save_to_disk(str(root / "b" / "saved"))
    table.select(range(2)).to_parquet(str(root / "a.parquet"))
    (root / "c.txt").write_text("the end", encoding="utf-8")
    sources = resolve_sources(root)
    assert [s.relative_to(root).as_posix() for s in sources] == ["a.parquet", "b/saved", "c.txt"]
    assert list(read_documents(root)) == DOCS[:2] + DOCS + ["the end"]


def test_cache_key_follows_the_files_of_a_saved_directory(tmp_path, table, byte_tok):
    saved = tmp_path / "saved"
    table.save_to_disk(str(saved))
    before = input_fingerprint(saved)
    first, _ = tokens(saved, byte_tok)
    again, _ = tokens(saved, byte_tok)  # from the cache
    assert np.array_equal(first, again)
    shutil.rmtree(saved)
    table.select(range(2)).save_to_disk(str(saved))
    assert input_fingerprint(saved) != before
    assert len(tokens(saved, byte_tok)[0]) < len(first)


def test_blend_of_datasets_files_and_text(tmp_path, table, byte_tok):
    path = tmp_path / "docs.parquet"
    table.to_parquet(str(path))
    train, valid = build_lm_datasets({path: 0.25, "builtin": 0.75}, byte_tok, seq_length=8)
    assert isinstance(train, BlendedDataset) and valid.names == ["docs", "builtin"]


def test_read_records_for_prompt_response_fields(tmp_path, table):
    path = tmp_path / "sft.parquet"
    table.rename_columns({"text": "response"}).to_parquet(str(path))
    records = list(read_records(path, ["prompt", "response"]))
    assert records[1] == {"prompt": "p1", "response": DOCS[1]}
    fields = {"prompt": ("dataloader.train.prompt_key", "prompt"), "answer": ("dataloader.train.response_key",
                                                                              "response")}
    with pytest.raises(DataError, match=r"SFT data file .* has no column 'answer'; its columns are \['id', "
                                        r"'response', 'prompt'\]\. Set dataloader.train.response_key"):
        read_records(path, fields, what="SFT data")


def test_jsonl_lines_written_by_datasets_are_dufus_jsonl(tmp_path, table):
    path = tmp_path / "docs.jsonl"
    table.to_json(str(path))
    assert [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()] == DOCS
