"""Fixed-length language-model samples over an indexed token file, and the train/validation split.

Samples are cut from the concatenated token stream (documents separated by the
end-of-document id), GPT style: sample ``i`` holds ``seq_length + 1`` tokens and
consecutive samples share one token, so every token is predicted exactly once::

    tokens:   t0 t1 t2 t3 t4 t5 t6 ...         (seq_length = 3)
    sample 0: t0 t1 t2 t3                       input t0..t2, targets t1..t3
    sample 1:          t3 t4 t5 t6              input t3..t5, targets t4..t6

The trainer uses ``sample[:-1]`` as input and ``sample[1:]`` as target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from dufu.errors import DataError

from dufu import cache as _cache
from .blend import BlendedDataset, ValidationSets, dataset_names, parse_blend
from .corpus import BUILTIN, Input, input_fingerprint, resolve_sources
from .indexed_dataset import IndexedDataset, dataset_exists
from .packing import DocumentMaskedDataset
from .preprocess import preprocess
from .tokenizer import Tokenizer

# Bump when preprocessing changes in a way that alters the output, to invalidate cached datasets.
_DATASET_RECIPE_VERSION = "1"


class TokenDataset:
    """Samples of ``seq_length + 1`` tokens from tokens ``[start_token, end_token)`` of ``indexed``.

    ``dataset[i]`` is an int64 array of shape ``(seq_length + 1,)`` equal to
    ``tokens[start_token + i*seq_length : start_token + i*seq_length + seq_length + 1]``.
    The tail that does not fill a whole sample is not used.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, start_token: int = 0, end_token: int | None = None):
        if int(seq_length) != seq_length or seq_length < 1:
            raise DataError(f"seq_length must be a positive integer, got {seq_length!r}.")
        end_token = indexed.num_tokens if end_token is None else end_token
        if not 0 <= start_token <= end_token <= indexed.num_tokens:
            raise DataError(
                f"Token range [{start_token}, {end_token}) is not inside dataset {indexed.prefix!r}, "
                f"which has {indexed.num_tokens} tokens."
            )
        available, needed = end_token - start_token, seq_length + 1
        if available < needed:
            raise DataError(
                f"Token range [{start_token}, {end_token}) of dataset {indexed.prefix!r} has {available} tokens, "
                f"but one sample of seq_length {seq_length} needs {needed}. Use a smaller seq_length or more data."
            )
        self.indexed = indexed
        self.seq_length = int(seq_length)
        self.start_token = int(start_token)
        self.end_token = int(end_token)
        self._len = (available - 1) // self.seq_length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        start = self.start_token + i * self.seq_length
        return np.asarray(self.indexed.get(start, self.seq_length + 1), dtype=np.int64)  # (seq_length + 1,)

    @property
    def num_tokens(self) -> int:
        """Tokens in this dataset's range (including the unused tail)."""
        return self.end_token - self.start_token

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.indexed.prefix!r}, tokens [{self.start_token}, {self.end_token}), "
            f"seq_length={self.seq_length}, samples={self._len})"
        )


def build_lm_datasets(
    data_path: Input | Mapping,
    tokenizer: Tokenizer,
    seq_length: int,
    valid_fraction: float = 0.05,
    json_key: str = "text",
    cache_dir: str | os.PathLike | None = None,
    document_mask: bool = False,
) -> tuple[TokenDataset | BlendedDataset, TokenDataset | ValidationSets | None]:
    """Train and validation datasets for ``data_path``.

    ``data_path`` is either the prefix of a preprocessed dataset (``<p>.bin`` and
    ``<p>.idx`` exist; its token ids must fit ``tokenizer``), or any text input of
    :func:`~dufu.data.corpus.read_documents` ("builtin", .txt, .jsonl, .parquet,
    .arrow, a directory written by ``datasets``' ``save_to_disk``, a directory of
    such files, a list), which is preprocessed once into ``<cache>/datasets/<hash>/``
    and reused afterwards. The hash covers the input files (path, size, mtime), the
    tokenizer and ``json_key`` (the text field of .jsonl lines and of ``datasets``
    rows); see :mod:`dufu.cache` for the cache location.

    ``data_path`` may also be a weighted blend of such paths, ``[0.7, "web", 0.3, "code"]``,
    ``{"web": 0.7, "code": 0.3}`` or ``"0.7 web 0.3 code"`` (:mod:`dufu.data.blend`): every
    path is checked before any is tokenized, each dataset is split on its own, and the
    result is a :class:`~dufu.data.blend.BlendedDataset` of the training splits and
    :class:`~dufu.data.blend.ValidationSets` of the validation splits, named by
    :func:`~dufu.data.blend.dataset_names`.

    The split is by whole documents: the last ``valid_fraction`` of the documents
    (at least one) are validation, the rest train. ``valid_fraction=0`` returns
    ``(train, None)``.

    ``document_mask=True`` (Llama 3's long-context recipe): samples still cut across documents, but each
    carries ``position_ids`` restarting at every document start, so no token attends across a boundary
    (:class:`~dufu.data.packing.DocumentMaskedDataset`, :func:`dufu.layers.attention.document_mask`).
    """
    if not 0 <= valid_fraction < 1:
        raise DataError(
            f"valid_fraction must be in [0, 1), got {valid_fraction}. Use e.g. 0.05 for 5% of the documents, "
            "or 0 for no validation set."
        )
    blend = parse_blend(data_path)
    if blend is None:
        return _split(_open(data_path, tokenizer, json_key, cache_dir), seq_length, valid_fraction, document_mask)
    weights, paths = [w for w, _ in blend], [p for _, p in blend]
    for k, (weight, path) in enumerate(blend):  # every path exists before anything is tokenized
        try:
            if _as_prefix(path) is None:
                resolve_sources(path)
        except DataError as e:
            raise DataError(f"Blend entry {k + 1} of {len(blend)} ({path!r}, weight {weight:g}): {e}") from None
    if len(blend) == 1:
        return _split(_open(paths[0], tokenizer, json_key, cache_dir), seq_length, valid_fraction, document_mask)
    names = dataset_names(paths)
    splits = [_split(_open(p, tokenizer, json_key, cache_dir), seq_length, valid_fraction, document_mask)
              for p in paths]
    train = BlendedDataset([t for t, _ in splits], weights, names)
    valid = ValidationSets([(n, v) for n, (_, v) in zip(names, splits)]) if valid_fraction else None
    return train, valid


def _open(data_path: Input, tokenizer: Tokenizer, json_key: str, cache_dir) -> IndexedDataset:
    """The indexed tokens of one path: a preprocessed prefix as it is, or a text input through the cache."""
    prefix = _as_prefix(data_path)
    if prefix is not None:
        indexed = IndexedDataset(prefix)
        _check_fits(indexed, tokenizer)
        return indexed
    return IndexedDataset(_cached_preprocess(data_path, tokenizer, json_key, cache_dir))


def _split(indexed: IndexedDataset, seq_length: int, valid_fraction: float, document_mask: bool = False):
    """The training and validation samples of one dataset: its last ``valid_fraction`` of documents validate;
    with ``document_mask`` each sample also carries its documents' restarting position ids."""
    if document_mask:
        train, valid = _split(indexed, seq_length, valid_fraction)
        return DocumentMaskedDataset(train), (DocumentMaskedDataset(valid) if valid is not None else None)
    n = indexed.num_documents
    if valid_fraction == 0:
        return TokenDataset(indexed, seq_length), None
    n_valid = max(1, round(n * valid_fraction))
    if n - n_valid < 1:
        raise DataError(
            f"Dataset {indexed.prefix!r} has {n} document(s); a split with valid_fraction={valid_fraction} "
            f"needs at least 2 (one for training, one for validation). Add documents, or set valid_fraction=0."
        )
    boundary = int(indexed.doc_offsets[n - n_valid])
    for name, lo, hi, hint in (
        ("training", 0, boundary, "lower valid_fraction or add data"),
        ("validation", boundary, indexed.num_tokens, "raise valid_fraction or add data"),
    ):
        if hi - lo < seq_length + 1:
            docs = f"{n - n_valid} of {n}" if name == "training" else f"last {n_valid} of {n}"
            raise DataError(
                f"The {name} split of {indexed.prefix!r} ({docs} documents) has {hi - lo} tokens, but one "
                f"sample of seq_length {seq_length} needs {seq_length + 1}. Use a smaller seq_length, or {hint}."
            )
    train = TokenDataset(indexed, seq_length, 0, boundary)
    valid = TokenDataset(indexed, seq_length, boundary, indexed.num_tokens)
    return train, valid


def _as_prefix(data_path: Input) -> str | None:
    """``data_path`` as a preprocessed-dataset prefix, or None if it is a text input."""
    if not isinstance(data_path, (str, os.PathLike)):
        return None
    path = os.fspath(data_path)
    if path == BUILTIN:
        return None
    for suffix in (".bin", ".idx"):  # accept "corpus.bin" for the prefix "corpus"
        if path.endswith(suffix) and dataset_exists(path[: -len(suffix)]):
            return path[: -len(suffix)]
    if dataset_exists(path):
        return path
    if not os.path.exists(path):
        half = [p for p in (path + ".bin", path + ".idx") if os.path.exists(p)]
        if half:
            return path  # IndexedDataset names the missing half
        raise DataError(
            f"Data path {path!r} does not exist, and neither do {path}.bin / {path}.idx. Pass the prefix of a "
            "preprocessed dataset (made by `dufu preprocess`), a .txt, .jsonl, .parquet or .arrow file, a "
            f"directory written by datasets' save_to_disk, a directory of such files, '{BUILTIN}' for the "
            'built-in corpus, or a weighted blend of these such as [0.7, "web", 0.3, "code"].'
        )
    return None


def _check_fits(indexed: IndexedDataset, tokenizer: Tokenizer) -> None:
    if indexed.max_token_id >= tokenizer.vocab_size:
        raise DataError(
            f"Dataset {indexed.prefix!r} contains token id {indexed.max_token_id}, but the tokenizer "
            f"{tokenizer.name} has only {tokenizer.vocab_size} tokens; the data was made with another "
            f"tokenizer. Use the tokenizer saved next to it ({indexed.prefix}.tokenizer.json, "
            "kind='pretrained'), or preprocess the text again with this tokenizer."
        )
    saved = Path(indexed.prefix + ".tokenizer.json")
    if saved.is_file() and Tokenizer.from_file(saved).fingerprint != tokenizer.fingerprint:
        raise DataError(
            f"Dataset {indexed.prefix!r} was preprocessed with the tokenizer in {saved}, which differs from the "
            f"tokenizer in use ({tokenizer.name}): its token ids would be read as other text. Use the data's "
            f"tokenizer (tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path={saved}; `dufu train` "
            "does this by itself), or preprocess the text again with this tokenizer."
        )


def data_tokenizer_file(data_path: Input | Mapping) -> Path | None:
    """The tokenizer a preprocessed dataset was made with (``<prefix>.tokenizer.json``, which ``dufu preprocess``
    writes beside it), for a prefix or a blend of prefixes; None for text inputs (the run's tokenizer tokenizes
    them) and for data that carries none (e.g. Megatron's own files). The datasets of a blend must agree."""
    blend = parse_blend(data_path)
    paths = [data_path] if blend is None else [p for _, p in blend]
    found: dict[str, Path] = {}
    for path in paths:
        prefix = _as_prefix(path)
        saved = Path(prefix + ".tokenizer.json") if prefix is not None else None
        if saved is not None and saved.is_file():
            found.setdefault(Tokenizer.from_file(saved).fingerprint, saved)
    if len(found) > 1:
        raise DataError(
            f"The datasets of the blend were preprocessed with different tokenizers ({', '.join(map(str, found.values()))}): "
            "their token ids mean different text. Preprocess them all with one tokenizer (dufu preprocess "
            "--tokenizer pretrained --tokenizer-path FILE)."
        )
    return next(iter(found.values()), None)


def _cached_preprocess(data_path: Input, tokenizer: Tokenizer, json_key: str, cache_dir) -> str:
    key = _cache.short_hash(
        input_fingerprint(data_path, json_key), tokenizer.fingerprint, json_key, _DATASET_RECIPE_VERSION
    )
    directory = _cache.resolve_cache_dir(cache_dir) / "datasets" / key
    prefix = str(directory / "data")
    with _cache.file_lock(directory.with_name(key + ".lock")):
        if not dataset_exists(prefix):
            preprocess(data_path, prefix, tokenizer, json_key=json_key)
            tokenizer.save(prefix + ".tokenizer.json")
            inputs = [data_path] if isinstance(data_path, (str, os.PathLike)) else list(data_path)
            source = {"inputs": [os.fspath(p) for p in inputs], "json_key": json_key, "tokenizer": tokenizer.name}
            _cache.atomic_write_text(directory / "source.json", json.dumps(source, indent=2) + "\n")
    return prefix
