import warnings

import numpy as np
import pytest

import dufu.data.dataset as dataset_module
from dufu.data import IndexedDataset, IndexedDatasetWriter, TokenDataset, build_lm_datasets, build_tokenizer, preprocess
from dufu.errors import DataError


@pytest.fixture
def counting(tmp_path):
    """An indexed dataset whose tokens are 0, 1, 2, ..., 99 in four documents."""
    w = IndexedDatasetWriter(tmp_path / "count", 257)
    for lo, hi in ((0, 10), (10, 40), (40, 41), (41, 100)):
        w.add_document(range(lo, hi))
    return IndexedDataset(w.finalize())


def test_sample_boundaries_overlap_by_one_token(counting):
    ds = TokenDataset(counting, seq_length=8)
    assert len(ds) == (100 - 1) // 8 == 12
    assert ds[0].dtype == np.int64 and ds[0].shape == (9,)
    assert ds[0].tolist() == list(range(0, 9))
    assert ds[1].tolist() == list(range(8, 17))
    assert ds[11].tolist() == list(range(88, 97))
    assert ds[-1].tolist() == ds[11].tolist()
    with pytest.raises(IndexError):
        ds[12]
    # every token except the first is a target exactly once
    targets = np.concatenate([ds[i][1:] for i in range(len(ds))])
    assert targets.tolist() == list(range(1, 97))


def test_sub_range(counting):
    ds = TokenDataset(counting, 4, start_token=10, end_token=40)
    assert len(ds) == (30 - 1) // 4
    assert ds[0].tolist() == [10, 11, 12, 13, 14]
    assert ds[len(ds) - 1][-1] < 40
    exact = TokenDataset(counting, 4, 10, 15)
    assert len(exact) == 1


def test_too_short_says_how_many_tokens(counting):
    with pytest.raises(DataError, match=r"has 30 tokens, but one sample of seq_length 64 needs 65"):
        TokenDataset(counting, 64, 10, 40)


def test_split_by_documents_and_cache_reuse(cache_dir, text_dir, byte_tok, monkeypatch):
    train, valid = build_lm_datasets(text_dir, byte_tok, seq_length=4, valid_fraction=0.2)
    indexed = train.indexed
    assert indexed.num_documents == 5
    # last 20% of 5 documents = 1 document ("Zweites Dokument ..."), the rest train
    boundary = int(indexed.doc_offsets[4])
    assert (train.start_token, train.end_token) == (0, boundary)
    assert (valid.start_token, valid.end_token) == (boundary, indexed.num_tokens)
    assert byte_tok.decode(indexed.tokens[boundary:].tolist()) == "Zweites Dokument: grüße aus Köln.<|endoftext|>"
    assert str(cache_dir / "datasets") in indexed.prefix

    # Second call reuses the cache: preprocessing again would fail.
    def no_preprocess(*args, **kwargs):
        raise AssertionError("preprocessed again instead of using the cache")

    with monkeypatch.context() as patch:
        patch.setattr(dataset_module, "preprocess", no_preprocess)
        train2, valid2 = build_lm_datasets(text_dir, byte_tok, seq_length=4, valid_fraction=0.2)
    assert train2.indexed.prefix == indexed.prefix
    assert len(train2) == len(train) and len(valid2) == len(valid)

    # A changed input file gets a new cache entry.
    (text_dir / "a.txt").write_text("changed, and now longer than before.")
    train3, _ = build_lm_datasets(text_dir, byte_tok, seq_length=4, valid_fraction=0.2)
    assert train3.indexed.prefix != indexed.prefix
    assert len(list((cache_dir / "datasets").iterdir())) == 4  # two entries + their lock files


def test_builtin_with_no_validation(byte_tok):
    train, valid = build_lm_datasets("builtin", byte_tok, seq_length=128, valid_fraction=0)
    assert valid is None
    assert train.end_token == train.indexed.num_tokens > 400_000


def test_at_least_one_validation_document(tmp_path, byte_tok):
    files = []
    for i in range(3):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(f"document number {i} " * 5)
    train, valid = build_lm_datasets(files, byte_tok, seq_length=8, valid_fraction=0.01)
    assert valid.start_token == train.end_token == int(train.indexed.doc_offsets[2])
    with pytest.raises(DataError, match="needs at least 2"):
        build_lm_datasets(files[0], byte_tok, seq_length=8)
    with pytest.raises(DataError, match=r"validation split .*\(last 1 of 3 documents\) has 91 tokens.* needs 101"):
        build_lm_datasets(files, byte_tok, seq_length=100, valid_fraction=0.01)
    with pytest.raises(DataError, match=r"training split .* has 182 tokens.* needs 201"):
        build_lm_datasets(files, byte_tok, seq_length=200, valid_fraction=0.01)


def test_preprocessed_prefix_used_directly(tmp_path, cache_dir, text_dir, byte_tok):
    prefix = preprocess(text_dir, tmp_path / "pre" / "ds", byte_tok, show_progress=False)
    for path in (prefix, prefix + ".bin"):
        train, valid = build_lm_datasets(path, byte_tok, seq_length=4, valid_fraction=0.2)
        assert train.indexed.prefix == prefix
    assert not (cache_dir / "datasets").exists()


def test_prefix_vocab_mismatch(tmp_path, text_dir):
    big = build_tokenizer("bpe", vocab_size=400, corpus=text_dir)
    prefix = preprocess("builtin", tmp_path / "ds", big, show_progress=False)
    assert IndexedDataset(prefix).max_token_id >= 257
    with pytest.raises(DataError, match=r"contains token id \d+, but the tokenizer byte has only 257 tokens"):
        build_lm_datasets(prefix, build_tokenizer("byte"), seq_length=16)


def test_prefix_tokenizer_mismatch_is_refused(tmp_path, byte_tok):
    prefix = preprocess("builtin", tmp_path / "ds", byte_tok, show_progress=False)
    byte_tok.save(prefix + ".tokenizer.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_lm_datasets(prefix, byte_tok, seq_length=16)
    other = build_tokenizer("bpe", vocab_size=300)
    other.save(prefix + ".tokenizer.json")
    with pytest.raises(DataError, match=r"differs from the tokenizer in use .*tokenization.tokenizer.path="):
        build_lm_datasets(prefix, byte_tok, seq_length=16)


def test_missing_data_path(tmp_path, byte_tok):
    with pytest.raises(DataError, match=r"does not exist, and neither do .*\.bin .*dufu preprocess"):
        build_lm_datasets(str(tmp_path / "nope"), byte_tok, seq_length=8)
    (tmp_path / "half.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"missing .*half\.idx"):
        build_lm_datasets(str(tmp_path / "half"), byte_tok, seq_length=8)
    with pytest.raises(DataError, match="valid_fraction"):
        build_lm_datasets("builtin", byte_tok, seq_length=8, valid_fraction=1.5)
