import os
import pickle

import numpy as np
import pytest

from dufu.data import IndexedDataset, IndexedDatasetWriter
from dufu.errors import DataError


def write(prefix, docs, vocab_size):
    w = IndexedDatasetWriter(prefix, vocab_size)
    for d in docs:
        w.add_document(d)
    return w.finalize()


@pytest.mark.parametrize(
    "vocab_size, dtype", [(257, np.uint16), (65499, np.uint16), (65500, np.int32), (200_000, np.int32)]
)
def test_round_trip(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab_size, size=n).tolist() for n in (5, 0, 17, 1)]
    prefix = write(tmp_path / "ds", docs, vocab_size)
    ds = IndexedDataset(prefix)
    assert ds.tokens.dtype == dtype
    assert os.path.getsize(str(prefix) + ".bin") == 23 * np.dtype(dtype).itemsize
    assert ds.num_documents == 4 and ds.num_tokens == 23
    assert ds.doc_offsets.tolist() == [0, 5, 5, 22, 23]
    assert ds.max_token_id == max(max(d) for d in docs if d)
    for i, d in enumerate(docs):
        assert ds.document(i).tolist() == d
    flat = sum(docs, [])
    assert ds.get(3, 10).tolist() == flat[3:13]
    assert ds.tokens.tolist() == flat
    with pytest.raises(IndexError):
        ds.get(20, 5)
    # pickles by prefix (for DataLoader workers), not by copying tokens
    assert len(pickle.dumps(ds)) < 500
    assert pickle.loads(pickle.dumps(ds)).tokens.tolist() == flat


def test_large_document_crosses_flush(tmp_path, monkeypatch):
    import dufu.data.indexed_dataset as mod

    monkeypatch.setattr(mod, "_FLUSH_TOKENS", 7)
    docs = [list(range(i, i + 5)) for i in range(10)]
    ds = IndexedDataset(write(tmp_path / "ds", docs, 100))
    assert ds.tokens.tolist() == sum(docs, [])


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(write(tmp_path / "empty", [], 257))
    assert ds.num_documents == 0 and ds.num_tokens == 0 and ds.max_token_id == -1


def test_out_of_vocab_id_rejected(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "ds", 257)
    with pytest.raises(DataError, match=r"token id 300, outside \[0, 257\)"):
        w.add_document([1, 300])
    w.abort()


def test_context_manager_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "ds", 257) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


def test_no_final_files_before_finalize(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "ds", 257)
    w.add_document(list(range(100)))
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds.idx").exists()
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match=r"missing .*nothing\.bin and .*nothing\.idx.*dufu preprocess"):
        IndexedDataset(tmp_path / "nothing")
    prefix = write(tmp_path / "ds", [[1, 2, 3]], 257)
    os.remove(prefix + ".idx")
    with pytest.raises(DataError, match=r"missing .*ds\.idx"):
        IndexedDataset(prefix)


@pytest.fixture
def good(tmp_path):
    return write(tmp_path / "ds", [list(range(50)), list(range(30))], 257)


def test_bad_magic(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[:8] = b"NOTDUFU!"
    open(good + ".idx", "wb").write(data)
    with pytest.raises(DataError, match=r"ds\.idx is not a valid .*wrong magic"):
        IndexedDataset(good)


def test_truncated_idx(good):
    data = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(data[:-8])
    with pytest.raises(DataError, match=r"ds\.idx .* but a header saying 2 documents needs"):
        IndexedDataset(good)
    open(good + ".idx", "wb").write(data[:20])
    with pytest.raises(DataError, match="shorter than the 48-byte header"):
        IndexedDataset(good)


def test_truncated_bin(good):
    data = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(data[:-10])
    with pytest.raises(DataError, match=r"ds\.bin .*150 bytes, but its index ds\.idx says 80 tokens"):
        IndexedDataset(good)


def test_inconsistent_offsets(good):
    data = bytearray(open(good + ".idx", "rb").read())
    data[48 + 8 : 48 + 16] = (90).to_bytes(8, "little")  # offsets [0, 90, 80]
    open(good + ".idx", "wb").write(data)
    with pytest.raises(DataError, match="offsets are not increasing"):
        IndexedDataset(good)
