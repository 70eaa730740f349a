"""Memory-mapped token storage: ``<prefix>.bin`` (the tokens) + ``<prefix>.idx`` (the index), in two formats.

The ``.bin`` is every document's token ids back to back, little-endian. The ``.idx`` is either **dufu's own**
(magic ``DUFUIDX``: what ``dufu preprocess`` and the data cache write) or **Megatron's** memory-mapped indexed
dataset (magic ``MMIDIDX``: what Megatron-LM's ``tools/preprocess_data.py`` and LiBai write, and
``dufu preprocess --format megatron``, so data tokenized by dufu trains in Megatron). One reader,
:class:`IndexedDataset`, tells them apart by the magic and gives the same view of both: a flat token stream
and the offsets where documents start. A dufu document is a Megatron document: its sequences, concatenated.

**Why dufu keeps its own format beside Megatron's.** The ``.bin`` files are byte for byte the same (``uint16``
below 65500 tokens of vocabulary, else ``int32``: Megatron's ``optimal_dtype`` rule is dufu's), so only the
index differs, and dufu's holds what Megatron's lacks: the largest token id and the vocabulary size the data
was written for. With them the start-up check "do the token ids fit the model?" is free, where a Megatron file
needs one pass over its whole ``.bin`` (below). Keeping the format also keeps every existing cache entry and
preprocessed file valid. Megatron's index holds what dufu does not use (sentences as sequences, a byte pointer
per sequence, multimodal modes); moving to it would gain nothing the reader does not already give.

dufu's ``.idx`` (little-endian)::

    0   8      magic b"DUFUIDX\\0"
    8   4      version (uint32, 1)
    12  4      dtype code (uint32): 1 = uint16, 2 = int32
    16  8      number of documents N (uint64)
    24  8      number of tokens T (uint64)
    32  8      largest token id, -1 if empty (int64)
    40  8      vocab_size the file was written for (uint64)
    48  8(N+1) document offsets (int64): document i is tokens[offsets[i]:offsets[i+1]]; 0 ... T

Megatron's ``.idx`` (megatron-core's ``megatron/core/datasets/indexed_dataset.py``; little-endian)::

    0   9      magic b"MMIDIDX\\0\\0"
    9   8      version (uint64, 1)
    17  1      dtype code (uint8): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    18  8      number of sequences S (uint64)
    26  8      number of document indices D = documents + 1 (uint64)
    34  4S     sequence lengths in tokens (int32)
        8S     sequence pointers: byte offset of each sequence in the .bin (int64)
        8D     document indices (int64): document i is sequences [idx[i], idx[i+1]); 0 ... S
        1S     sequence modes (int8), only in multimodal files: read, not interpreted

A Megatron file's sequences must lie back to back from byte 0 (as every Megatron writer puts them): its ``.bin``
is then one token stream. Opening reads the index, never the ``.bin``: for Megatron, one chunked pass over the
memory-mapped index arrays checks them (~20 bytes a sequence); ``doc_offsets`` takes 8 bytes a document.

**The largest id of a Megatron file** is not stored: :attr:`IndexedDataset.max_token_id` finds it on first use
by one chunked pass over the ``.bin`` (disk-bound; ~1 s per GB from the page cache; it also rejects negative and
fractional ids) and keeps it in ``<cache>/token_ids/<hash>.json`` (:mod:`dufu.cache`; key: both files'
path, size, mtime; one process builds it). dufu's writer stores it there itself: its output is never scanned.
Every check raises :class:`~dufu.errors.DataError` naming the file and the problem.

The writer streams tokens to temporary files and renames them into place in :meth:`IndexedDatasetWriter.finalize`
(``.bin`` first, then ``.idx``), so an interrupted run never leaves a pair that looks valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from array import array
from pathlib import Path
from typing import Sequence

import numpy as np

from dufu.errors import DataError

from dufu import cache as _cache
from dufu.cache import temp_path

FORMATS = ("dufu", "megatron")

MAGIC = b"DUFUIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQqQ")
HEADER_SIZE = _HEADER.size  # 48
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")
MEGATRON_HEADER_SIZE = _MEGATRON_HEADER.size  # 34
MEGATRON_DTYPES = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                   5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")}
_MEGATRON_CODES = {dtype: code for code, dtype in MEGATRON_DTYPES.items()}
_LEGACY_MAGIC = b"TNTIDX\x00\x00"  # fairseq's / Megatron-LM's older, not memory-mapped format

_FLUSH_TOKENS = 1 << 20
_SCAN_CHUNK = 1 << 24  # elements per step of a pass over a memory map: bounded memory on any file size
_MAX_SEQUENCE_TOKENS = np.iinfo(np.int32).max  # Megatron stores sequence lengths as int32

_READS = ("dufu reads two index formats: its own (magic b'DUFUIDX\\x00', version 1; written by `dufu preprocess`) "
          "and Megatron-LM's / LiBai's memory-mapped indexed dataset (magic b'MMIDIDX\\x00\\x00', version 1; written "
          "by Megatron's tools/preprocess_data.py or `dufu preprocess --format megatron`)")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` for vocabularies below 65500 tokens, else ``int32`` (Megatron's rule too)."""
    return _DTYPES[1] if vocab_size < 65500 else _DTYPES[2]


def _paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = os.fspath(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """True if both ``<prefix>.bin`` and ``<prefix>.idx`` exist."""
    bin_path, idx_path = _paths(prefix)
    return bin_path.is_file() and idx_path.is_file()


class IndexedDatasetWriter:
    """Write documents of token ids to ``<prefix>.bin`` / ``<prefix>.idx``.

    ``format``: ``"dufu"`` (default) or ``"megatron"``, one sequence per document as Megatron's
    ``preprocess_data.py`` writes without ``--split-sentences`` (a document over 2**31 - 1 tokens becomes
    several). Call :meth:`add_document` per document, then :meth:`finalize`. Used as a context manager it
    finalizes on success and removes its temporary files on error. Token ids must be in ``[0, vocab_size)``.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, format: str = "dufu"):
        if vocab_size <= 0 or vocab_size > np.iinfo(np.int32).max:
            raise DataError(f"vocab_size must be between 1 and {np.iinfo(np.int32).max}, got {vocab_size}.")
        if format not in FORMATS:
            raise DataError(f"Unknown indexed-dataset format {format!r}; choose one of {', '.join(FORMATS)}.")
        self.prefix, self.vocab_size, self.format = os.fspath(prefix), int(vocab_size), format
        self.dtype = dtype_for_vocab(self.vocab_size)
        self._bin_path, self._idx_path = _paths(self.prefix)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp, self._idx_tmp = temp_path(self._bin_path), temp_path(self._idx_path)
        self._file = open(self._bin_tmp, "wb")
        self._offsets = array("q", [0])
        self._sequence_lengths, self._document_indices = array("i"), array("q", [0])  # Megatron's index
        self._buffer: list[np.ndarray] = []
        self._buffered, self._min_id, self._max_id, self._done = 0, None, -1, False

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (a 1-D sequence of token ids; may be empty)."""
        if self._done:
            raise RuntimeError("add_document() after finalize()")
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise DataError(f"A document must be a 1-D sequence of integer token ids, got shape {arr.shape} and dtype "
                            f"{arr.dtype}.")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise DataError(f"Document {self.num_documents} has token id {lo if lo < 0 else hi}, outside "
                                f"[0, {self.vocab_size}) for vocab_size={self.vocab_size}. Write with the vocab_size "
                                "of the tokenizer that produced the ids.")
            self._min_id = lo if self._min_id is None else min(self._min_id, lo)
            self._max_id = max(self._max_id, hi)
            self._buffer.append(arr.astype(self.dtype, copy=False))
            self._buffered += arr.size
            if self._buffered >= _FLUSH_TOKENS:
                self._flush()
        self._offsets.append(self._offsets[-1] + arr.size)
        if self.format == "megatron":
            full, rest = divmod(arr.size, _MAX_SEQUENCE_TOKENS)
            self._sequence_lengths.extend([_MAX_SEQUENCE_TOKENS] * full)
            if rest or not full:  # an empty document is one empty sequence
                self._sequence_lengths.append(rest)
            self._document_indices.append(len(self._sequence_lengths))

    def _flush(self) -> None:
        if self._buffer:
            np.concatenate(self._buffer).tofile(self._file)
            self._buffer, self._buffered = [], 0

    def finalize(self) -> str:
        """Write the index and move both files into place; returns the prefix."""
        if self._done:
            return self.prefix
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        with open(self._idx_tmp, "wb") as f:
            (self._write_megatron_index if self.format == "megatron" else self._write_dufu_index)(f)
            f.flush()
            os.fsync(f.fileno())
        # Drop an old index first: an old .idx never sits next to a new .bin.
        self._idx_path.unlink(missing_ok=True)
        os.replace(self._bin_tmp, self._bin_path)
        os.replace(self._idx_tmp, self._idx_path)
        self._done = True
        if self.format == "megatron":  # what is known here need not be found by a pass over the .bin
            with contextlib.suppress(OSError):
                stats = {"min_token_id": self._min_id, "max_token_id": self._max_id}
                _write_id_range(_id_range_path(self._bin_path, self._idx_path), stats)
        return self.prefix

    def _write_dufu_index(self, f) -> None:
        code = 1 if self.dtype == _DTYPES[1] else 2
        f.write(_HEADER.pack(MAGIC, VERSION, code, self.num_documents, self.num_tokens, self._max_id, self.vocab_size))
        f.write(np.frombuffer(self._offsets, dtype=np.int64).astype("<i8", copy=False).tobytes())

    def _write_megatron_index(self, f) -> None:
        lengths, code = np.frombuffer(self._sequence_lengths, dtype=np.int32), _MEGATRON_CODES[self.dtype]
        f.write(_MEGATRON_HEADER.pack(MEGATRON_MAGIC, MEGATRON_VERSION, code, lengths.size, len(self._document_indices)))
        f.write(lengths.astype("<i4", copy=False).tobytes())
        base = 0  # sequence pointers: where each sequence starts, in bytes (an exclusive cumulative sum), in chunks
        for lo in range(0, lengths.size, _SCAN_CHUNK):
            ends = base + np.cumsum(lengths[lo : lo + _SCAN_CHUNK], dtype=np.int64) * self.dtype.itemsize
            f.write(np.concatenate(([base], ends[:-1])).astype("<i8").tobytes())
            base = int(ends[-1])
        f.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8", copy=False).tobytes())

    def abort(self) -> None:
        """Discard everything written so far (the final files are not touched)."""
        if not self._file.closed:
            self._file.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finalize() if exc_type is None else self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin`` / ``<prefix>.idx`` in dufu's or Megatron's format.

    Attributes:
        format: ``"dufu"`` or ``"megatron"``, from the index's magic bytes.
        tokens: all tokens, a read-only ``np.memmap`` of length ``num_tokens`` (in the file's dtype).
        doc_offsets: int64 array of length ``num_documents + 1``; document ``i`` is
            ``tokens[doc_offsets[i]:doc_offsets[i+1]]``.
        max_token_id: largest id in the file (-1 if empty): in dufu's header; found once and cached for Megatron's.
        vocab_size: what a dufu file was written for; None for a Megatron file (not stored).
        sequence_lengths, sequence_pointers, document_indices, sequence_modes: a Megatron file's index arrays,
            memory-mapped (modes None unless the file has them); None for a dufu file.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self._bin_path, self._idx_path = bin_path, idx_path = _paths(self.prefix)
        missing = [str(p) for p in (bin_path, idx_path) if not p.is_file()]
        if missing:
            raise DataError(f"Preprocessed dataset {self.prefix!r} is incomplete: missing {' and '.join(missing)}. "
                            f"A dataset prefix needs both <prefix>.bin and <prefix>.idx; create them with "
                            f"`dufu preprocess INPUT... --output-prefix {self.prefix}`, or pass the text "
                            "input (a .txt / .jsonl file, a directory, or 'builtin') instead of a prefix.")
        self.sequence_lengths = self.sequence_pointers = self.document_indices = self.sequence_modes = None
        self.vocab_size, self._max_token_id = None, None
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
        self.format = {MAGIC: "dufu", MEGATRON_MAGIC[:8]: "megatron"}.get(head[:8])
        if self.format == "dufu":
            self._load_dufu(head, idx_size)
        elif self.format == "megatron" and head[8:9] == MEGATRON_MAGIC[8:]:
            self._load_megatron(head, idx_size)
        else:
            self.format = None
            if idx_size < len(MAGIC):
                raise self._corrupt(idx_path, f"only {idx_size} bytes, too short for the header of any index. {_READS}")
            legacy = (". This is the older, not memory-mapped indexed format of fairseq / Megatron-LM (--dataset-impl "
                      "lazy or cached); write the data again with --dataset-impl mmap")
            legacy = legacy if head.startswith(_LEGACY_MAGIC) else ""
            raise self._corrupt(idx_path, f"wrong magic bytes {head[:9]!r}{legacy}. {_READS}")

    def _corrupt(self, path: Path, problem: str) -> DataError:
        if self.format == "megatron":
            return DataError(f"{path} is not a valid Megatron index/token file: {problem}. It may be truncated, or its "
                             ".bin and .idx may come from different runs; write the pair again (Megatron's "
                             "tools/preprocess_data.py, or `dufu preprocess ... --format megatron`).")
        if self.format == "dufu":
            return DataError(f"{path} is not a valid dufu index/token file: {problem}. It may be truncated or written "
                             f"by another tool; delete {self.prefix}.bin and {self.prefix}.idx and run `dufu "
                             "preprocess` again.")
        return DataError(f"{path} is not a valid index file: {problem}.")

    def _map_tokens(self, n_tokens: int, dtype: np.dtype) -> None:
        bin_size = self._bin_path.stat().st_size
        if bin_size != n_tokens * dtype.itemsize:
            raise self._corrupt(self._bin_path, f"{bin_size} bytes, but its index {self._idx_path.name} says "
                                f"{n_tokens} tokens of {dtype.itemsize} bytes = {n_tokens * dtype.itemsize} bytes")
        self.dtype, self.num_tokens = dtype, int(n_tokens)
        # np.memmap cannot map an empty file
        self.tokens = np.memmap(self._bin_path, dtype, "r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype)

    def _load_dufu(self, head: bytes, idx_size: int) -> None:
        idx_path = self._idx_path
        if len(head) < HEADER_SIZE:
            raise self._corrupt(idx_path, f"only {idx_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        magic, version, code, n_docs, n_tokens, max_id, vocab_size = _HEADER.unpack(head)
        if version != VERSION:
            raise self._corrupt(idx_path, f"format version {version}, this dufu reads version {VERSION}. {_READS}")
        if code not in _DTYPES:
            raise self._corrupt(idx_path, f"unknown dtype code {code} (dufu's format has 1 = uint16, 2 = int32)")
        expected = HEADER_SIZE + 8 * (n_docs + 1)
        if idx_size != expected:
            raise self._corrupt(idx_path, f"{idx_size} bytes, but a header saying {n_docs} documents needs {expected}")
        offsets = np.fromfile(idx_path, dtype="<i8", count=n_docs + 1, offset=HEADER_SIZE).astype(np.int64, copy=False)
        if offsets[0] != 0 or offsets[-1] != n_tokens or (n_docs and np.any(np.diff(offsets) < 0)):
            raise self._corrupt(idx_path, "document offsets are not increasing from 0 to the number of tokens")
        self._map_tokens(n_tokens, _DTYPES[code])
        self.doc_offsets, self.num_documents = offsets, int(n_docs)
        self._max_token_id, self.vocab_size = int(max_id), int(vocab_size)

    def _load_megatron(self, head: bytes, idx_size: int) -> None:
        idx_path = self._idx_path
        if len(head) < MEGATRON_HEADER_SIZE:
            raise self._corrupt(idx_path, f"only {idx_size} bytes, shorter than Megatron's 34-byte header")
        _, version, code, n_seq, n_idx = _MEGATRON_HEADER.unpack(head[:MEGATRON_HEADER_SIZE])
        if version != MEGATRON_VERSION:
            raise self._corrupt(idx_path, f"Megatron format version {version}, dufu reads version {MEGATRON_VERSION}. "
                                f"{_READS}")
        if code not in MEGATRON_DTYPES:
            codes = ", ".join(f"{c} {d.name}" for c, d in MEGATRON_DTYPES.items())
            raise self._corrupt(idx_path, f"unknown dtype code {code} (Megatron's codes: {codes})")
        dtype = MEGATRON_DTYPES[code]
        end_of_indices = MEGATRON_HEADER_SIZE + 12 * n_seq + 8 * n_idx
        if idx_size not in (end_of_indices, end_of_indices + n_seq):  # without or with sequence modes
            raise self._corrupt(idx_path, f"{idx_size} bytes, but a header saying {n_seq} sequences and {n_idx} "
                                f"document indices needs {end_of_indices} (or {end_of_indices + n_seq} with sequence "
                                "modes)")
        if n_idx < 1:
            raise self._corrupt(idx_path, "no document indices (even an empty dataset has one, 0)")

        def mapped(offset: int, dt: str, count: int) -> np.ndarray:
            return np.memmap(idx_path, dt, "r", offset, (count,)) if count else np.zeros(0, dtype=dt)

        lengths = mapped(MEGATRON_HEADER_SIZE, "<i4", n_seq)
        pointers = mapped(MEGATRON_HEADER_SIZE + 4 * n_seq, "<i8", n_seq)
        doc_idx = mapped(MEGATRON_HEADER_SIZE + 12 * n_seq, "<i8", n_idx)
        # dufu reads the .bin as one token stream: sequences must lie back to back from byte 0.
        end = 0  # byte where the next sequence must start
        for lo in range(0, n_seq, _SCAN_CHUNK):
            lens = lengths[lo : lo + _SCAN_CHUNK].astype(np.int64)
            if lens.min() < 0:
                i = lo + int(np.argmax(lens < 0))
                raise self._corrupt(idx_path, f"sequence {i} has a negative length {int(lengths[i])}")
            ends = end + np.cumsum(lens) * dtype.itemsize
            starts = np.concatenate(([end], ends[:-1]))
            wrong = pointers[lo : lo + _SCAN_CHUNK] != starts
            if wrong.any():
                i = int(np.argmax(wrong))
                raise self._corrupt(idx_path, f"sequence {lo + i} starts at byte {int(pointers[lo + i])} of the .bin, "
                                    f"but the sequences before it end at byte {int(starts[i])}; dufu reads only files "
                                    "whose sequences lie back to back (as Megatron writes them)")
            end = int(ends[-1])
        if doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
            raise self._corrupt(idx_path, f"document indices are not increasing from 0 to the number of sequences "
                                f"({n_seq}): first {int(doc_idx[0])}, last {int(doc_idx[-1])}")
        self._map_tokens(end // dtype.itemsize, dtype)
        # Document i starts where its first sequence starts; documents of no sequence at the end start at the end.
        offsets = np.full(n_idx, self.num_tokens, dtype=np.int64)
        inside = np.asarray(doc_idx < n_seq)
        if n_seq:
            offsets[inside] = pointers[np.asarray(doc_idx)[inside]] // dtype.itemsize
        self.doc_offsets, self.num_documents = offsets, int(n_idx - 1)
        self.sequence_lengths, self.sequence_pointers, self.document_indices = lengths, pointers, doc_idx
        self.sequence_modes = mapped(end_of_indices, "i1", n_seq) if idx_size > end_of_indices else None

    @property
    def max_token_id(self) -> int:
        """The largest token id in the file, -1 if it has no tokens.

        Free for a dufu file (in its header). For a Megatron file, one pass over the ``.bin`` the first time, then
        read from dufu's cache (module docstring); the pass raises DataError on a negative or fractional id.
        """
        if self._max_token_id is None:
            cache = _id_range_path(self._bin_path, self._idx_path)
            with contextlib.ExitStack() as lock:
                with contextlib.suppress(OSError):  # an unwritable cache directory: no lock, no cache
                    lock.enter_context(_cache.file_lock(cache.with_suffix(".lock")))
                stats = _read_id_range(cache)
                if stats is None:
                    stats = self._scan_token_ids()
                    _write_id_range(cache, stats)
            lo = stats["min_token_id"]
            if lo is not None and lo < 0:
                raise DataError(f"{self._bin_path} contains token id {lo}; token ids are never negative. The file "
                                "holds something other than token ids, or its index gives the wrong dtype "
                                f"({self.dtype.name}, from {self._idx_path.name}).")
            self._max_token_id = int(stats["max_token_id"])
        return self._max_token_id

    def _scan_token_ids(self) -> dict:
        """Smallest and largest token id by one chunked pass over the memory map (None and -1 if empty)."""
        lo, hi = None, -1
        for start in range(0, self.num_tokens, _SCAN_CHUNK):
            chunk = self.tokens[start : start + _SCAN_CHUNK]
            if self.dtype.kind == "f":
                whole = np.isfinite(chunk) & (chunk == np.trunc(chunk))
                if not whole.all():
                    i = start + int(np.argmin(whole))
                    raise DataError(f"{self._bin_path} holds {self.dtype.name} values, and value "
                                    f"{self.tokens[i].item()!r} at token {i} is not a whole number, so it is no token "
                                    "id. Write the data with an integer dtype.")
            lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
            hi = max(hi, int(chunk.max()))
        return {"min_token_id": lo, "max_token_id": hi}

    def get(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens starting at token ``start`` (a view into the memory map)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) out of range [0, {self.num_tokens})")
        return self.tokens[start : start + length]

    def document(self, i: int) -> np.ndarray:
        """The tokens of document ``i``."""
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range [0, {self.num_documents})")
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    # Pickle (e.g. for DataLoader workers started with 'spawn') by prefix, not by copying the tokens.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, format={self.format}, num_documents={self.num_documents}, "
                f"num_tokens={self.num_tokens}, dtype={self.dtype.name})")


def _id_range_path(bin_path: Path, idx_path: Path) -> Path:
    """``<cache>/token_ids/<hash>.json``, the hash of both files' real path, size and mtime."""
    files = [(os.path.realpath(p), p.stat()) for p in (bin_path, idx_path)]
    key = _cache.short_hash(*(f"{path}:{st.st_size}:{st.st_mtime_ns}" for path, st in files))
    return _cache.resolve_cache_dir() / "token_ids" / f"{key}.json"


def _read_id_range(path: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        stats = json.loads(path.read_text(encoding="utf-8"))
        return stats if isinstance(stats, dict) and {"min_token_id", "max_token_id"} <= set(stats) else None


def _write_id_range(path: Path, stats: dict) -> None:
    with contextlib.suppress(OSError):  # a read-only cache directory only costs the next run another pass
        _cache.atomic_write_text(path, json.dumps(stats) + "\n")

