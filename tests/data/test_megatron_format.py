"""Megatron's memory-mapped indexed format, both ways, against megatron-core's own writer and reader.

* A pair written by megatron-core's ``IndexedDatasetBuilder`` (every dtype code it writes, documents of several
  sequences, empty documents, sequence modes) reads in dufu token for token and document for document, as
  megatron-core's ``IndexedDataset`` reads it.
* ``dufu preprocess --format megatron`` (and the Python API) writes a pair megatron-core reads with the same
  documents and tokens; its ``.bin`` is byte for byte the one of dufu's own format.
* Bad input fails with a DataError that says what is wrong.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():  # megatron-core warns that apex / transformer-engine are not installed
    warnings.simplefilter("ignore")
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
import torch  # noqa: E402

import dufu.data.indexed_dataset as mod  # noqa: E402
from dufu.data import build_lm_datasets, preprocess  # noqa: E402
from dufu.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter  # noqa: E402
from dufu.data.preprocess import main  # noqa: E402
from dufu.errors import DataError  # noqa: E402

# megatron-core's DType codes, as dufu reads them
DTYPES = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8,
}


def documents(rng, high: int) -> list[list[list[int]]]:
    """Documents as lists of sequences: one sequence, several, an empty document, an empty sequence, and an
    empty document at the end (its document index equals the number of sequences)."""
    def seq(n):
        return rng.integers(0, high, size=n).tolist()

    return [[seq(7)], [seq(3), seq(11), seq(1)], [], [seq(5), seq(0), seq(4)], [seq(20)], []]


def megatron_write(prefix, docs, dtype, multimodal: bool = False, modes=None) -> str:
    """Write ``docs`` with megatron-core's builder: add_item per sequence + end_document, except the second
    document, written in one add_document call with its sequence lengths."""
    prefix = str(prefix)
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d, doc in enumerate(docs):
        if d == 1 and not multimodal:
            # a list of ids, as Megatron's tools/preprocess_data.py passes it
            builder.add_document(sum(doc, []), [len(s) for s in doc])
            continue
        for s, sequence in enumerate(doc):
            if multimodal:
                builder.add_item(torch.tensor(sequence, dtype=torch.int64), mode=modes[d][s])
            else:
                builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def megatron_documents(prefix) -> list[list[int]]:
    """Documents as megatron-core reads them: the sequences of each document, concatenated."""
    ds = mc.IndexedDataset(str(prefix))
    idx = ds.document_indices
    out = []
    for d in range(len(idx) - 1):
        seqs = [ds[i].tolist() for i in range(idx[d], idx[d + 1])]
        out.append(sum(seqs, []))
    return out


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda t: t.__name__)
def test_reads_megatron_core_output_token_for_token(tmp_path, dtype):
    high = min(int(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer) else 1 << 20, 70_000)
    docs = documents(np.random.default_rng(DTYPES[dtype]), high)
    prefix = megatron_write(tmp_path / "ds", docs, dtype)
    header = open(prefix + ".idx", "rb").read(18)
    assert header[:9] == b"MMIDIDX\x00\x00" and header[17] == DTYPES[dtype]  # megatron-core's code for the dtype

    ds = IndexedDataset(prefix)
    flat_docs = [sum(doc, []) for doc in docs]
    flat = sum(flat_docs, [])
    assert ds.format == "megatron" and ds.dtype == np.dtype(dtype) and ds.vocab_size is None
    assert isinstance(ds.tokens, np.memmap) and isinstance(ds.sequence_lengths, np.memmap)
    assert ds.num_documents == len(docs) and ds.num_tokens == len(flat)
    assert ds.doc_offsets.tolist() == np.cumsum([0] + [len(d) for d in flat_docs]).tolist()
    assert megatron_documents(prefix) == flat_docs  # megatron-core's reading, the reference
    for i, doc in enumerate(flat_docs):
        assert ds.document(i).tolist() == doc
    assert ds.tokens.tolist() == flat
    assert ds.get(5, 9).tolist() == flat[5:14]
    assert ds.max_token_id == max(flat)
    assert ds.sequence_modes is None
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(doc) for doc in docs]).tolist()
    # pickles by prefix (for DataLoader workers)
    assert len(pickle.dumps(ds)) < 500 and pickle.loads(pickle.dumps(ds)).tokens.tolist() == flat


def test_reads_sequence_modes(tmp_path):
    rng = np.random.default_rng(0)
    docs = documents(rng, 1000)
    modes = [[int(rng.integers(0, 3)) for _ in doc] for doc in docs]
    prefix = megatron_write(tmp_path / "mm", docs, np.uint16, multimodal=True, modes=modes)
    ds = IndexedDataset(prefix)
    assert ds.sequence_modes.tolist() == sum(modes, [])
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == [sum(doc, []) for doc in docs]


def test_megatron_file_trains_through_build_lm_datasets(tmp_path, byte_tok):
    """A Megatron prefix is a data_path: split by whole documents, samples are its tokens."""
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 257, size=n).tolist()] for n in (40, 50, 60, 30)]
    prefix = megatron_write(tmp_path / "corpus", docs, np.uint16)
    train, valid = build_lm_datasets(prefix, byte_tok, seq_length=8, valid_fraction=0.25)
    flat = sum((d[0] for d in docs), [])
    assert (train.end_token, valid.start_token, valid.end_token) == (150, 150, 180)
    assert train[2].tolist() == flat[16:25] and valid[0].tolist() == flat[150:159]


def test_token_ids_that_do_not_fit_the_tokenizer(tmp_path, byte_tok):
    prefix = megatron_write(tmp_path / "big", [[[1, 2, 3, 300] * 10], [[5] * 20]], np.int32)
    with pytest.raises(DataError, match=r"contains token id 300, but the tokenizer byte has only 257 tokens"):
        build_lm_datasets(prefix, byte_tok, seq_length=8)


# ------------------------------------------------------------------------------------------ max_token_id


def test_max_token_id_is_computed_once_and_cached(tmp_path, monkeypatch, cache_dir):
    prefix = megatron_write(tmp_path / "ds", [[[4, 9, 2]], [[7, 1]]], np.int32)
    scans = []
    real = IndexedDataset._scan_token_ids
    monkeypatch.setattr(IndexedDataset, "_scan_token_ids", lambda self: scans.append(1) or real(self))
    assert IndexedDataset(prefix).max_token_id == 9 and len(scans) == 1
    assert IndexedDataset(prefix).max_token_id == 9 and len(scans) == 1  # another process would read the cache too
    assert len(list((cache_dir / "token_ids").glob("*.json"))) == 1
    # a new version of the files (other size or mtime) is scanned again
    megatron_write(prefix, [[[4, 99, 2]], [[7, 1]]], np.int32)
    assert IndexedDataset(prefix).max_token_id == 99 and len(scans) == 2


def test_scan_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(mod, "_SCAN_CHUNK", 4)
    docs = [[list(range(i, i + 5))] for i in range(10)] + [[[3, 100, 2]]]
    ds = IndexedDataset(megatron_write(tmp_path / "ds", docs, np.int64))
    assert ds.max_token_id == 100 and ds.tokens.tolist() == sum((d[0] for d in docs), [])


def test_empty_megatron_dataset(tmp_path):
    ds = IndexedDataset(megatron_write(tmp_path / "empty", [], np.uint16))
    assert (ds.num_documents, ds.num_tokens, ds.max_token_id) == (0, 0, -1)


def test_written_by_dufu_is_never_scanned(tmp_path, monkeypatch):
    with IndexedDatasetWriter(tmp_path / "ds", 257, format="megatron") as w:
        w.add_document([5, 200, 3])
    monkeypatch.setattr(IndexedDataset, "_scan_token_ids", lambda self: pytest.fail("scanned the .bin"))
    assert IndexedDataset(tmp_path / "ds").max_token_id == 200


def test_negative_and_fractional_ids_rejected(tmp_path):
    ds = IndexedDataset(megatron_write(tmp_path / "neg", [[[4, -3, 2]]], np.int16))
    with pytest.raises(DataError, match=r"neg\.bin contains token id -3; token ids are never negative"):
        ds.max_token_id
    prefix = str(tmp_path / "frac")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.float32)
    builder.add_item(torch.tensor([1.0, 2.5]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(DataError, match=r"value 2\.5 at token 1 is not a whole number"):
        IndexedDataset(prefix).max_token_id


def test_opening_reads_only_the_index(tmp_path):
    """A pair with an 8.6 GB .bin (a sparse file: no disk used) opens at once: only the index is read."""
    prefix = str(tmp_path / "huge")
    lengths = [(1 << 31) - 8] * 2  # uint16 tokens; a Megatron sequence holds at most 2**31 - 1
    n = sum(lengths)
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 2, 2))
        f.write(np.array(lengths, dtype="<i4").tobytes() + np.array([0, 2 * lengths[0]], dtype="<i8").tobytes())
        f.write(np.array([0, 2], dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(1 << 26)  # first a small one: a file system without sparse files would write all the zeros
        if os.stat(prefix + ".bin").st_blocks * 512 > 1 << 20:
            pytest.skip("this file system does not make sparse files")
        f.truncate(2 * n)
    start = time.perf_counter()
    ds = IndexedDataset(prefix)
    assert time.perf_counter() - start < 2.0  # reading 8.6 GB would take far longer
    assert ds.num_tokens == n and ds.num_documents == 1 and ds.doc_offsets.tolist() == [0, n]
    assert ds.get(n - 3, 3).tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------------------ dufu writes, Megatron reads


@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (70_000, np.int32)])
def test_dufu_writer_opens_in_megatron_core(tmp_path, vocab_size, dtype):
    rng = np.random.default_rng(vocab_size)
    docs = [rng.integers(0, vocab_size, size=n).tolist() for n in (9, 0, 31, 1, 17)]
    with IndexedDatasetWriter(tmp_path / "ds", vocab_size, format="megatron") as w:
        for d in docs:
            w.add_document(d)
    ref = mc.IndexedDataset(str(tmp_path / "ds"))
    assert ref.index.dtype == dtype and len(ref) == len(docs)
    assert ref.document_indices.tolist() == list(range(len(docs) + 1))  # one sequence per document
    assert megatron_documents(tmp_path / "ds") == docs
    ours = IndexedDataset(tmp_path / "ds")
    assert ours.format == "megatron" and [ours.document(i).tolist() for i in range(len(docs))] == docs


def test_long_document_becomes_several_sequences(tmp_path, monkeypatch):
    monkeypatch.setattr(mod, "_MAX_SEQUENCE_TOKENS", 4)
    monkeypatch.setattr(mod, "_FLUSH_TOKENS", 3)
    with IndexedDatasetWriter(tmp_path / "ds", 257, format="megatron") as w:
        w.add_document(list(range(10)))
        w.add_document([42, 43])
    ref = mc.IndexedDataset(str(tmp_path / "ds"))
    assert ref.sequence_lengths.tolist() == [4, 4, 2, 2] and ref.document_indices.tolist() == [0, 3, 4]
    assert megatron_documents(tmp_path / "ds") == [list(range(10)), [42, 43]]
    assert IndexedDataset(tmp_path / "ds").doc_offsets.tolist() == [0, 10, 12]


def test_preprocess_format_megatron(tmp_path, text_dir, byte_tok, capsys):
    prefix = str(tmp_path / "out" / "corpus")
    assert main([str(text_dir), "--output-prefix", prefix, "--format", "megatron", "--quiet"]) == 0
    assert "megatron format" in capsys.readouterr().out
    own = preprocess(text_dir, tmp_path / "own", byte_tok, show_progress=False)  # dufu's format, same text
    texts = ["First document.\nIt has two lines.\n", "jsonl one", "jsonl two, a bit longer", "jsonl three ✓",
             "Zweites Dokument: grüße aus Köln."]
    docs = megatron_documents(prefix)
    assert [byte_tok.decode(d[:-1]) for d in docs] == texts and all(d[-1] == byte_tok.eod_id for d in docs)
    ours, theirs = IndexedDataset(own), IndexedDataset(prefix)
    assert (ours.format, theirs.format) == ("dufu", "megatron")
    assert ours.doc_offsets.tolist() == theirs.doc_offsets.tolist()
    assert open(own + ".bin", "rb").read() == open(prefix + ".bin", "rb").read()  # only the .idx differs
    assert theirs.max_token_id == ours.max_token_id


def test_preprocess_unknown_format(tmp_path):
    with pytest.raises(DataError, match="invalid choice: 'fairseq'"):
        main(["builtin", "--output-prefix", str(tmp_path / "x"), "--format", "fairseq"])
    with pytest.raises(DataError, match="Unknown indexed-dataset format 'fairseq'; choose one of dufu, megatron"):
        IndexedDatasetWriter(tmp_path / "x", 257, format="fairseq")


# ------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def pair(tmp_path):
    """A megatron-core pair of 2 documents, 3 sequences, 80 int32 tokens."""
    return megatron_write(tmp_path / "ds", [[list(range(50))], [list(range(20)), list(range(10))]], np.int32)


def rewrite(path, fn):
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(fn(data)))


def test_unknown_magic_names_the_formats_read(pair):
    rewrite(pair + ".idx", lambda d: b"NOTANIDX!" + d[9:])
    with pytest.raises(DataError) as e:
        IndexedDataset(pair)
    msg = str(e.value)
    assert "ds.idx is not a valid index file: wrong magic bytes b'NOTANIDX!'" in msg
    assert "DUFUIDX" in msg and "MMIDIDX" in msg and "--format megatron" in msg


def test_legacy_megatron_format(pair):
    rewrite(pair + ".idx", lambda d: b"TNTIDX\x00\x00" + d[8:])
    with pytest.raises(DataError, match=r"older, not memory-mapped indexed format.*--dataset-impl mmap"):
        IndexedDataset(pair)


def test_unknown_version(pair):
    rewrite(pair + ".idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:])
    with pytest.raises(DataError, match=r"Megatron format version 2, dufu reads version 1\. dufu reads two"):
        IndexedDataset(pair)


def test_unknown_dtype_code(pair):
    rewrite(pair + ".idx", lambda d: d[:17] + b"\x09" + d[18:])
    with pytest.raises(DataError, match=r"unknown dtype code 9 \(Megatron's codes: 1 uint8, .* 8 uint16\)"):
        IndexedDataset(pair)


def test_truncated_index(pair):
    rewrite(pair + ".idx", lambda d: d[:-8])
    with pytest.raises(DataError, match=r"ds\.idx is not a valid Megatron index/token file: 86 bytes, but a header "
                                        r"saying 3 sequences and 3 document indices needs 94 \(or 97 with"):
        IndexedDataset(pair)
    rewrite(pair + ".idx", lambda d: d[:20])
    with pytest.raises(DataError, match="only 20 bytes, shorter than Megatron's 34-byte header"):
        IndexedDataset(pair)
    rewrite(pair + ".idx", lambda d: d[:5])
    with pytest.raises(DataError, match="only 5 bytes, too short for the header of any index"):
        IndexedDataset(pair)


def test_bin_size_disagrees_with_index(pair):
    rewrite(pair + ".bin", lambda d: d[:-12])
    with pytest.raises(DataError, match=r"ds\.bin is not a valid Megatron index/token file: 308 bytes, but its index "
                                        r"ds\.idx says 80 tokens of 4 bytes = 320 bytes"):
        IndexedDataset(pair)
    rewrite(pair + ".bin", lambda d: d + b"\x00" * 16)
    with pytest.raises(DataError, match=r"324 bytes, but its index ds\.idx says 80 tokens of 4 bytes = 320 bytes"):
        IndexedDataset(pair)


def test_sequences_not_back_to_back(pair):
    # sequence pointers start at 34 + 4*3; make sequence 2 start 4 bytes late
    rewrite(pair + ".idx", lambda d: d[:46 + 16] + struct.pack("<q", 284) + d[46 + 24:])
    with pytest.raises(DataError, match=r"sequence 2 starts at byte 284 of the \.bin, but the sequences before it end "
                                        r"at byte 280"):
        IndexedDataset(pair)


def test_bad_document_indices(pair):
    # document indices start at 34 + 12*3 = 70: [0, 1, 3] -> [0, 1, 2] (the last must be the sequence count)
    rewrite(pair + ".idx", lambda d: d[:70 + 16] + struct.pack("<q", 2))
    with pytest.raises(DataError, match=r"document indices are not increasing from 0 to the number of sequences \(3\)"):
        IndexedDataset(pair)


def test_bad_megatron_data_fails_at_preflight(pair, tmp_path):
    """`dufu train --nproc N` runs these checks in the launching process: one clear error, before any worker."""
    from dufu.engine.preflight import preflight
    from dufu_testing import load_config

    def check(prefix):
        cfg = load_config("gpt_debug", [f"dataloader.train.data_path={prefix}", f"train.output_dir={tmp_path / 'run'}",
                                        "train.dist.data_parallel_size=2"])
        preflight(cfg, world_size=2)

    big = megatron_write(tmp_path / "big", [[[1, 2, 3, 300] * 20]] * 4, np.int32)
    with pytest.raises(DataError, match=r"contains token id 300, but the tokenizer byte has only 257 tokens"):
        check(big)
    rewrite(pair + ".bin", lambda d: d[:-4])
    with pytest.raises(DataError, match=r"316 bytes, but its index ds\.idx says 80 tokens of 4 bytes = 320 bytes"):
        check(pair)
