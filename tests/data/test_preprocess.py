import json

import pytest

from dufu.data import IndexedDataset, build_tokenizer, preprocess
from dufu.data.preprocess import main
from dufu.errors import DataError


def test_preprocess_txt_and_jsonl(tmp_path, text_dir, byte_tok):
    prefix = preprocess(text_dir, tmp_path / "out" / "ds", byte_tok, show_progress=False)
    ds = IndexedDataset(prefix)
    texts = ["First document.\nIt has two lines.\n", "jsonl one", "jsonl two, a bit longer", "jsonl three ✓",
             "Zweites Dokument: grüße aus Köln."]
    assert ds.num_documents == len(texts)
    for i, text in enumerate(texts):
        doc = ds.document(i).tolist()
        assert doc[-1] == byte_tok.eod_id
        assert byte_tok.decode(doc[:-1]) == text


def test_preprocess_without_eod_and_skips_empty(tmp_path, byte_tok):
    f = tmp_path / "x.jsonl"
    f.write_text("\n".join(json.dumps({"body": t}) for t in ["ab", "", "c"]) + "\n")
    prefix = preprocess(f, tmp_path / "ds", byte_tok, append_eod=False, json_key="body", show_progress=False)
    ds = IndexedDataset(prefix)
    assert ds.doc_offsets.tolist() == [0, 2, 3]
    assert ds.tokens.tolist() == [97, 98, 99]


def test_preprocess_bad_jsonl_line_leaves_no_output(tmp_path, byte_tok):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError, match=r"Line 3 of .*bad\.jsonl"):
        preprocess(f, tmp_path / "ds", byte_tok, show_progress=False)
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds.idx").exists()


def test_main_writes_dataset_tokenizer_and_summary(tmp_path, text_dir, capsys):
    prefix = str(tmp_path / "out" / "corpus")
    rc = main([str(text_dir), "--output-prefix", prefix, "--tokenizer", "bpe", "--vocab-size", "300", "--quiet"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "5 documents" in out and "tokens/s" in out and "corpus.bin" in out
    tok = build_tokenizer("pretrained", path=prefix + ".tokenizer.json")
    ds = IndexedDataset(prefix)
    assert ds.max_token_id < tok.vocab_size
    assert tok.decode(ds.document(1).tolist()) == "jsonl one<|endoftext|>"


def test_main_bad_arguments_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="--output-prefix"):
        main(["builtin"])
    with pytest.raises(DataError, match="invalid choice"):
        main(["builtin", "--output-prefix", str(tmp_path / "x"), "--tokenizer", "wordpiece"])
    with pytest.raises(DataError, match="does not exist"):
        main([str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "x")])
    with pytest.raises(DataError, match="needs path="):
        main(["builtin", "--output-prefix", str(tmp_path / "x"), "--tokenizer", "pretrained"])
