"""Memory-mapped token storage: ``<prefix>.bin`` (the tokens) + ``<prefix>.idx`` (the index).

``<prefix>.bin`` is every document's token ids back to back, little-endian,
``uint16`` when the vocabulary has fewer than 65500 tokens and ``int32``
otherwise. Nothing else is in it, so its size is ``num_tokens * itemsize``.

``<prefix>.idx`` (all little-endian)::

    offset  size  field
    0       8     magic  b"DUFUIDX\\0"
    8       4     format version (uint32, currently 1)
    12      4     dtype code (uint32): 1 = uint16, 2 = int32
    16      8     number of documents N (uint64)
    24      8     total number of tokens T (uint64)
    32      8     largest token id in the file, -1 if empty (int64)
    40      8     vocab_size the file was written for (uint64)
    48      8*(N+1) document offsets (int64): document i is tokens[offsets[i]:offsets[i+1]];
                  offsets[0] == 0 and offsets[N] == T

The reader checks all of this (magic, version, sizes of both files, the offsets)
and raises :class:`~dufu.errors.DataError` naming the file and the problem.

The writer streams tokens to temporary files and renames them into place in
:meth:`IndexedDatasetWriter.finalize` (``.bin`` first, then ``.idx``), so an
interrupted run never leaves a pair that looks valid.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Sequence

import numpy as np

from dufu.errors import DataError

from ._cache import temp_path

MAGIC = b"DUFUIDX\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQqQ")
HEADER_SIZE = _HEADER.size  # 48
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_FLUSH_TOKENS = 1 << 20


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """``uint16`` for vocabularies below 65500 tokens, else ``int32``."""
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

    Call :meth:`add_document` per document, then :meth:`finalize`. Used as a
    context manager it finalizes on success and removes its temporary files on
    error. Token ids must be in ``[0, vocab_size)``.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        if vocab_size <= 0 or vocab_size > np.iinfo(np.int32).max:
            raise DataError(f"vocab_size must be between 1 and {np.iinfo(np.int32).max}, got {vocab_size}.")
        self.prefix = os.fspath(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self._bin_path, self._idx_path = _paths(self.prefix)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = temp_path(self._bin_path)
        self._idx_tmp = temp_path(self._idx_path)
        self._file = open(self._bin_tmp, "wb")
        self._offsets = array("q", [0])
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._max_id = -1
        self._done = False

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
            raise DataError(
                f"A document must be a 1-D sequence of integer token ids, got shape {arr.shape} "
                f"and dtype {arr.dtype}."
            )
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise DataError(
                    f"Document {self.num_documents} has token id {lo if lo < 0 else hi}, outside "
                    f"[0, {self.vocab_size}) for vocab_size={self.vocab_size}. Write with the vocab_size "
                    "of the tokenizer that produced the ids."
                )
            self._max_id = max(self._max_id, hi)
            self._buffer.append(arr.astype(self.dtype, copy=False))
            self._buffered += arr.size
            if self._buffered >= _FLUSH_TOKENS:
                self._flush()
        self._offsets.append(self._offsets[-1] + arr.size)

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
        header = _HEADER.pack(
            MAGIC,
            VERSION,
            1 if self.dtype == _DTYPES[1] else 2,
            self.num_documents,
            self.num_tokens,
            self._max_id,
            self.vocab_size,
        )
        with open(self._idx_tmp, "wb") as f:
            f.write(header)
            f.write(np.frombuffer(self._offsets, dtype=np.int64).astype("<i8", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        # Drop an old index first: an old .idx never sits next to a new .bin.
        if self._idx_path.exists():
            self._idx_path.unlink()
        os.replace(self._bin_tmp, self._bin_path)
        os.replace(self._idx_tmp, self._idx_path)
        self._done = True
        return self.prefix

    def abort(self) -> None:
        """Discard everything written so far (the final files are not touched)."""
        if not self._file.closed:
            self._file.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if p.exists():
                p.unlink()
        self._done = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin`` / ``<prefix>.idx``.

    Attributes:
        tokens: all tokens, a read-only ``np.memmap`` of length ``num_tokens``.
        doc_offsets: int64 array of length ``num_documents + 1``; document ``i`` is
            ``tokens[doc_offsets[i]:doc_offsets[i+1]]``.
        max_token_id: largest id in the file (-1 if empty); ``vocab_size``: what it was written for.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        bin_path, idx_path = _paths(self.prefix)
        missing = [str(p) for p in (bin_path, idx_path) if not p.is_file()]
        if missing:
            raise DataError(
                f"Preprocessed dataset {self.prefix!r} is incomplete: missing {' and '.join(missing)}. "
                f"A dataset prefix needs both <prefix>.bin and <prefix>.idx; create them with "
                f"`dufu preprocess INPUT... --output-prefix {self.prefix}`, or pass the text "
                "input (a .txt / .jsonl file, a directory, or 'builtin') instead of a prefix."
            )
        self._load(bin_path, idx_path)

    def _corrupt(self, path: Path, problem: str) -> DataError:
        return DataError(
            f"{path} is not a valid dufu index/token file: {problem}. It may be truncated or written by "
            f"another tool; delete {self.prefix}.bin and {self.prefix}.idx and run `dufu preprocess` again."
        )

    def _load(self, bin_path: Path, idx_path: Path) -> None:
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise self._corrupt(idx_path, f"only {idx_size} bytes, shorter than the {HEADER_SIZE}-byte header")
            magic, version, code, n_docs, n_tokens, max_id, vocab_size = _HEADER.unpack(head)
            if magic != MAGIC:
                raise self._corrupt(idx_path, f"wrong magic bytes {magic!r} (expected {MAGIC!r})")
            if version != VERSION:
                raise self._corrupt(idx_path, f"format version {version}, this dufu reads version {VERSION}")
            if code not in _DTYPES:
                raise self._corrupt(idx_path, f"unknown dtype code {code}")
            expected = HEADER_SIZE + 8 * (n_docs + 1)
            if idx_size != expected:
                raise self._corrupt(
                    idx_path, f"{idx_size} bytes, but a header saying {n_docs} documents needs {expected}"
                )
            offsets = np.fromfile(f, dtype="<i8", count=n_docs + 1).astype(np.int64, copy=False)
        if offsets[0] != 0 or offsets[-1] != n_tokens or (n_docs and np.any(np.diff(offsets) < 0)):
            raise self._corrupt(idx_path, "document offsets are not increasing from 0 to the number of tokens")
        dtype = _DTYPES[code]
        bin_size = bin_path.stat().st_size
        if bin_size != n_tokens * dtype.itemsize:
            raise self._corrupt(
                bin_path,
                f"{bin_size} bytes, but its index {idx_path.name} says {n_tokens} tokens of "
                f"{dtype.itemsize} bytes = {n_tokens * dtype.itemsize} bytes",
            )
        self.dtype = dtype
        self.doc_offsets = offsets
        self.num_documents = int(n_docs)
        self.num_tokens = int(n_tokens)
        self.max_token_id = int(max_id)
        self.vocab_size = int(vocab_size)
        if n_tokens:
            self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
        else:  # np.memmap cannot map an empty file
            self.tokens = np.zeros(0, dtype=dtype)

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
        return (
            f"IndexedDataset({self.prefix!r}, num_documents={self.num_documents}, "
            f"num_tokens={self.num_tokens}, dtype={self.dtype.name})"
        )
