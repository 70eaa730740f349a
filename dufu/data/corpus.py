"""Text inputs: the built-in corpus, ``.txt`` files, ``.jsonl`` files and directories of them.

An *input* is one of

* ``"builtin"`` -- the built-in corpus: the topic texts of CPython's ``pydoc_data``
  (79 documents, about 465 KB of English), always present, so examples and tests
  never need a download;
* a ``.txt`` file -- the whole file is one document;
* a ``.jsonl`` file -- one JSON object per line, the document is the field
  ``json_key`` (default ``"text"``); blank lines are skipped;
* a ``.parquet`` or ``.arrow`` file, or a directory written by ``datasets``'
  ``save_to_disk`` -- one document per row, its text in the column ``json_key``,
  read through the ``datasets`` library (:mod:`~dufu.data.hf_datasets`);
* a directory -- every ``.txt`` / ``.jsonl`` / ``.parquet`` / ``.arrow`` file and
  ``save_to_disk`` directory below it (recursively, hidden files skipped), in
  sorted path order;
* a list of any of these, read in order.

Documents always come out in the same order for the same input, which the
tokenizer training and the train/validation split rely on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence, Union

from pydoc_data.topics import topics

from dufu.errors import DataError

from . import hf_datasets
from dufu.cache import hash_stream, short_hash

BUILTIN = "builtin"
SUFFIXES = (".txt", ".jsonl") + hf_datasets.SUFFIXES

Input = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

_ACCEPTED = (
    f'"{BUILTIN}" (the built-in corpus), a .txt file (one document per file), a .jsonl file '
    "(one JSON object per line), a .parquet or .arrow file or a directory written by datasets' save_to_disk "
    "(one document per row), a directory containing such files, or a list of these"
)


def builtin_documents() -> list[str]:
    """The built-in corpus: one document per ``pydoc_data`` topic, in sorted key order."""
    return [topics[key] for key in sorted(topics)]


def resolve_sources(path: Input) -> list[Union[str, Path]]:
    """Expand an input into its list of sources: ``BUILTIN``, file paths (``.txt`` / ``.jsonl`` / ``.parquet`` /
    ``.arrow``) and ``save_to_disk`` directories.

    Raises :class:`DataError` at once for a missing path, an unsupported file
    type or a directory without any readable file.
    """
    if isinstance(path, (str, os.PathLike)):
        items = [path]
    else:
        items = list(path)
        if not items:
            raise DataError(f"The list of data inputs is empty. Give at least one input: {_ACCEPTED}.")
    sources: list[Union[str, Path]] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise DataError(
                f"Data input {item!r} is a {type(item).__name__}, not a path. Accepted inputs: {_ACCEPTED}."
            )
        if isinstance(item, str) and item == BUILTIN:
            sources.append(BUILTIN)
            continue
        p = Path(item).expanduser()
        if p.is_dir():
            found = _walk(p)
            if not found:
                raise DataError(
                    f"Data directory {p} contains no .txt or .jsonl files (nor .parquet / .arrow files or "
                    "save_to_disk directories). Put the documents in "
                    f".txt files (one document per file) or .jsonl files (one JSON object per line), "
                    f"or pass another input: {_ACCEPTED}."
                )
            sources.extend(found)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(
                    f"Data file {p} has the unsupported type {p.suffix or '(no extension)'!r}. "
                    f"Accepted inputs: {_ACCEPTED}. Rename or convert the file."
                )
            sources.append(p)
        else:
            raise DataError(f"Data input {p} does not exist. Check the path; accepted inputs: {_ACCEPTED}.")
    return sources


def _walk(directory: Path) -> list[Path]:
    """The sources in ``directory``: itself if ``save_to_disk`` wrote it, else every readable file and
    ``save_to_disk`` directory below it (not entering those), hidden ones skipped, in sorted path order."""
    splits = hf_datasets.dataset_dict_splits(directory)
    if splits is not None:
        raise DataError(
            f"Data directory {directory} was written by DatasetDict.save_to_disk and holds the splits {splits}. "
            f"Pass the directory of one split, e.g. {directory / (splits[0] if splits else 'train')}."
        )
    if hf_datasets.is_dataset_dir(directory):
        return [directory]
    found = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        kept = []
        for name in dirs:
            if name.startswith("."):
                continue
            if hf_datasets.is_dataset_dir(here / name):
                found.append(here / name)  # read as one dataset, its own .arrow files not one by one
            else:
                kept.append(name)
        dirs[:] = kept
        found.extend(here / name for name in files if not name.startswith(".") and Path(name).suffix in SUFFIXES)
    return sorted(found)


def read_documents(path: Input, json_key: str = "text") -> Iterator[str]:
    """Iterate over the documents of an input (see the module docstring for the kinds of input).

    The input is checked when this is called (paths, and the text column of
    ``datasets`` files); reading (and errors inside files, such as a bad JSON line,
    reported with its line number) happens lazily.
    """
    sources = resolve_sources(path)
    for source in sources:
        if hf_datasets.is_hf_source(source):
            hf_datasets.check_columns(source, {json_key: ("json_key (--json-key)", "document text")})
    return _iter_sources(sources, json_key)


def _iter_sources(sources: list[Union[str, Path]], json_key: str) -> Iterator[str]:
    for source in sources:
        if source == BUILTIN:
            yield from builtin_documents()
        elif hf_datasets.is_hf_source(source):
            yield from hf_datasets.read_texts(source, json_key)
        elif source.suffix == ".txt":
            yield _read_text(source)
        else:
            yield from _read_jsonl(source, json_key)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"Data file {path} is not valid UTF-8 (byte {e.start}: {e.reason}). "
            "Re-encode it as UTF-8, e.g. with `iconv -t utf-8`."
        ) from None
    except OSError as e:
        raise DataError(f"Cannot read data file {path}: {e.strerror}. Check that it exists and is readable.") from None


def read_jsonl_fields(path: Path, fields: dict[str, tuple[str, str]], what: str = "data") -> Iterator[list[str]]:
    """The string fields of each record of a .jsonl file, in the order of ``fields``: ``{json key: (the
    setting that names it, what it holds)}``, e.g. ``{"text": ("json_key (--json-key)", "text")}``. Every
    problem is a DataError naming the file, the line and the fix. ``what`` names the file in messages."""
    example = "{" + ", ".join(f'"{k}": "..."' for k in fields) + "}"
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"Cannot read {what} file {path}: {e.strerror}. Check that it exists and is readable.") from None
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"Line {lineno} of {path} is not valid JSON ({e.msg} at column {e.colno}). Each line of a "
                        f".jsonl file must be one JSON object such as {example}; fix or remove that line."
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"Line {lineno} of {path} is a JSON {type(record).__name__}, not an object. Each line "
                        f"must be one JSON object such as {example}."
                    )
                values = []
                for key, (setting, role) in fields.items():
                    if key not in record:
                        raise DataError(
                            f"Line {lineno} of {path} has no field {key!r} (found: {sorted(record)[:10]}). Set "
                            f"{setting} to the field that holds the {role}, or fix the line."
                        )
                    if not isinstance(record[key], str):
                        raise DataError(
                            f"Line {lineno} of {path}: field {key!r} is a {type(record[key]).__name__}, not a "
                            f"string. The {role} must be text."
                        )
                    values.append(record[key])
                yield values
        except UnicodeDecodeError as e:
            raise DataError(
                f"{what[0].upper() + what[1:]} file {path} is not valid UTF-8 (after line {lineno}: {e.reason}). "
                "Re-encode it as UTF-8, e.g. with `iconv -t utf-8`."
            ) from None


def _read_jsonl(path: Path, json_key: str) -> Iterator[str]:
    for (text,) in read_jsonl_fields(path, {json_key: ("json_key (--json-key)", "document text")}):
        yield text


def input_fingerprint(path: Input, json_key: str = "text") -> str:
    """A cheap fingerprint of an input: path, size and modification time of every file (of every file in a
    ``save_to_disk`` directory).

    For the built-in corpus it is a hash of its content (it changes with the
    Python version). Used to key cached preprocessed datasets.
    """
    parts: list[str] = [f"json_key={json_key}"]
    for source in resolve_sources(path):
        if source == BUILTIN:
            parts.append("builtin:" + content_fingerprint(BUILTIN))
        else:
            for file in hf_datasets.source_files(source):  # a save_to_disk directory: every file in it
                st = file.stat()
                parts.append(f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return short_hash(*parts)


def content_fingerprint(path: Input, json_key: str = "text") -> str:
    """A hash of the documents themselves (reads the whole input)."""
    return hash_stream(read_documents(path, json_key=json_key))
