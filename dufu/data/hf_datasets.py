"""Hugging Face ``datasets`` files as input: ``.parquet`` and ``.arrow`` files and ``save_to_disk`` directories.

What a torchtitan or transformers user has on disk reads as any other text input of
:func:`~dufu.data.corpus.read_documents` (so as a ``data_path``, a blend entry, a BPE training corpus or an
input of ``dufu preprocess``):

* a ``.parquet`` file, read by ``datasets``' packaged ``parquet`` builder, streaming (no copy into a cache);
* an ``.arrow`` file (Arrow IPC, stream or file format: what ``datasets`` writes, or ``pyarrow``), by its
  ``arrow`` builder, streaming;
* a directory written by ``Dataset.save_to_disk`` (recognised by its ``state.json`` / ``dataset_info.json``),
  by ``load_from_disk``, which memory-maps its Arrow files. A ``DatasetDict``'s directory holds one such
  directory per split: name the split's.

Each row is one document, its text the column named by ``json_key`` (the same setting as for ``.jsonl`` lines,
default ``"text"``). Only local files are read: the packaged builders and ``load_from_disk`` never look a name
up on the Hub. ``.jsonl`` files keep dufu's own reader (:mod:`~dufu.data.corpus`), which needs no ``datasets``
and reports a bad line by its number; a ``.jsonl`` file written by ``Dataset.to_json`` reads the same there.

Tokenization is :func:`~dufu.data.preprocess.preprocess`'s, as for every text input: documents are encoded in
batches by the ``tokenizers`` library on all cores, behind a progress bar, and the result is cached under a key
of the input files' paths, sizes and modification times (:func:`~dufu.data.corpus.input_fingerprint`).

``datasets`` is an optional dependency (``pip install torch==2.13.0 -e ".[hf]"``); it is imported only when such
an input is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, Union

from dufu.errors import DataError

SUFFIXES = (".parquet", ".arrow")
_DATASET_DIR_FILES = ("state.json", "dataset_info.json")
_BATCH_ROWS = 1024

Fields = Union[Mapping[str, tuple[str, str]], Sequence[str]]


def is_dataset_dir(path: Path) -> bool:
    """True for a directory written by ``Dataset.save_to_disk`` (it holds ``state.json`` or ``dataset_info.json``)."""
    return path.is_dir() and any((path / name).is_file() for name in _DATASET_DIR_FILES)


def dataset_dict_splits(path: Path) -> list[str] | None:
    """The split names of a directory written by ``DatasetDict.save_to_disk``, or None if it is not one."""
    index = path / "dataset_dict.json"
    if not (path.is_dir() and index.is_file()):
        return None
    try:
        splits = json.loads(index.read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        splits = None
    return [str(s) for s in splits] if isinstance(splits, list) else sorted(
        p.name for p in path.iterdir() if is_dataset_dir(p))


def is_hf_source(source: Any) -> bool:
    """True for a source this module reads: a ``.parquet`` / ``.arrow`` file or a ``save_to_disk`` directory."""
    return isinstance(source, Path) and (source.suffix in SUFFIXES or is_dataset_dir(source))


def source_files(source: Path) -> list[Path]:
    """The files whose path, size and modification time key a source's cache entry (a directory: all of them)."""
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file())
    return [source]


def _describe(source: Path, what: str, capital: bool = True) -> str:
    """``"Data file x.parquet"`` / ``"SFT data directory saved"``: how messages name a source."""
    kind = "directory" if source.is_dir() else "file"
    return f"{what[0].upper() + what[1:] if capital else what} {kind} {source}"


def _datasets():
    try:
        import datasets  # optional (dufu[hf]), and about a second to import
    except ImportError:
        raise DataError(
            "Reading .parquet / .arrow files and save_to_disk directories needs the datasets library, which is "
            'not installed: pip install "dufu[hf]" torch==2.13.0 (or convert the data to .jsonl).'
        ) from None
    return datasets


def open_dataset(source: Path, what: str = "data"):
    """A ``datasets`` view of one source: a memory-mapped ``Dataset`` for a ``save_to_disk`` directory, a
    streaming ``IterableDataset`` for a file."""
    datasets = _datasets()
    try:
        if source.is_dir():
            loaded = datasets.load_from_disk(str(source))
            if not isinstance(loaded, datasets.Dataset):
                raise DataError(f"{_describe(source, what)} holds a {type(loaded).__name__}, not one dataset. "
                                "Pass the directory of one split.")
            return loaded
        builder = "parquet" if source.suffix == ".parquet" else "arrow"
        return datasets.load_dataset(builder, data_files=[str(source)], split="train", streaming=True)
    except DataError:
        raise
    except Exception as e:  # a damaged or foreign file: say which, with the library's reason
        raise DataError(f"{_describe(source, what)} cannot be read with the datasets library ({type(e).__name__}: "
                        f"{e}). Check that it is a complete .parquet / .arrow file or a save_to_disk "
                        "directory.") from None


def column_names(dataset) -> list[str]:
    """The columns of a ``Dataset`` or ``IterableDataset`` (from its features, else from its first row)."""
    names = getattr(dataset, "column_names", None)
    if names is None and getattr(dataset, "features", None) is not None:
        names = list(dataset.features)
    if names is None:
        first = next(iter(dataset), None)
        names = list(first) if first is not None else []
    return list(names)


def _fields(fields: Fields) -> dict[str, tuple[str, str]]:
    if isinstance(fields, Mapping):
        return dict(fields)
    return {name: ("the field name", name) for name in fields}


def check_columns(source: Path, fields: Fields, what: str = "data") -> None:
    """Raise :class:`DataError` listing the columns of ``source`` if any of ``fields`` is not one of them."""
    _checked_dataset(source, _fields(fields), what)


def _checked_dataset(source: Path, fields: dict[str, tuple[str, str]], what: str):
    dataset = open_dataset(source, what)
    columns = column_names(dataset)
    for name, (setting, role) in fields.items():
        if name not in columns:
            raise DataError(f"{_describe(source, what)} has no column {name!r}; its columns are {columns}. Set "
                            f"{setting} to the column that holds the {role}.")
    return dataset


def read_records(source: Path, fields: Fields, what: str = "data") -> Iterator[dict[str, str]]:
    """``{field: text}`` for each row of ``source`` (a ``.parquet`` / ``.arrow`` file or a ``save_to_disk``
    directory), in file order, reading only those columns.

    ``fields`` is a list of column names, or ``{column: (the setting that names it, what it holds)}`` as
    :func:`~dufu.data.corpus.read_jsonl_fields` takes, e.g. ``{"prompt": ("dataloader.train.prompt_key",
    "prompt")}``, which the messages then use. A missing column is a :class:`DataError` listing the columns
    there are (raised when this is called); a value that is not a string (a null, a number) is one naming
    its row (raised while reading). ``what`` names the input in messages.
    """
    fields = _fields(fields)
    dataset = _checked_dataset(source, fields, what)
    return _rows(dataset.select_columns(list(fields)), source, fields, what)


def _rows(dataset, source: Path, fields: dict[str, tuple[str, str]], what: str) -> Iterator[dict[str, str]]:
    names = list(fields)
    row = 0
    for batch in dataset.iter(batch_size=_BATCH_ROWS):
        for values in zip(*(batch[name] for name in names)):
            for name, value in zip(names, values):
                if not isinstance(value, str):
                    setting, role = fields[name]
                    kind = "null" if value is None else f"a {type(value).__name__}"
                    raise DataError(f"Row {row} of {_describe(source, what, capital=False)}: column {name!r} is "
                                    f"{kind}, not a string. The {role} must be text; fix the row, or set {setting} "
                                    "to another column.")
            yield dict(zip(names, values))
            row += 1


def read_texts(source: Path, json_key: str = "text") -> Iterator[str]:
    """The documents of ``source``: column ``json_key`` of each row."""
    for record in read_records(source, {json_key: ("json_key (--json-key)", "document text")}):
        yield record[json_key]
