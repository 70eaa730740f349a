"""Text -> token ids -> ``<prefix>.bin`` / ``<prefix>.idx`` (see :mod:`dufu.data.indexed_dataset`).

As a library call::

    preprocess("corpus.jsonl", "out/corpus", build_tokenizer("byte"))

From the command line (``dufu preprocess`` calls :func:`main`)::

    dufu preprocess docs/ more.jsonl --output-prefix out/corpus --tokenizer bpe --vocab-size 8192

which also saves the tokenizer as ``<prefix>.tokenizer.json`` so the dataset
and its tokenizer travel together.

``--format megatron`` (``format="megatron"``) writes Megatron-LM's indexed
format instead of dufu's, one sequence per document, so the pair trains in
Megatron-LM or LiBai as it is (``--data-path out/corpus``); dufu trains on
either. The ``.bin`` is the same in both formats, only the ``.idx`` differs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from dufu.errors import DataError

from .corpus import Input, read_documents
from .indexed_dataset import FORMATS, IndexedDatasetWriter
from .tokenizer import KINDS, Tokenizer, build_tokenizer

# Documents are encoded in batches so the tokenizers library can use all cores.
_BATCH_DOCS = 512
_BATCH_CHARS = 4 << 20


@dataclass
class PreprocessStats:
    prefix: str
    documents: int
    empty_skipped: int
    tokens: int
    seconds: float


def preprocess(
    inputs: Input,
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    append_eod: bool = True,
    json_key: str = "text",
    show_progress: bool = True,
    format: str = "dufu",
) -> str:
    """Tokenize every document of ``inputs`` and write the indexed dataset ``output_prefix``; returns the prefix.

    Each document becomes one indexed document, followed by the tokenizer's
    end-of-document id if ``append_eod``. Empty documents are skipped. The
    output appears atomically: an interrupted run leaves no ``.bin`` / ``.idx``.
    ``format`` is ``"dufu"`` (the default) or ``"megatron"`` (Megatron-LM's indexed format).
    """
    return _preprocess(inputs, output_prefix, tokenizer, append_eod, json_key, show_progress, format).prefix


def _preprocess(
    inputs, output_prefix, tokenizer, append_eod, json_key, show_progress, format="dufu"
) -> PreprocessStats:
    if format not in FORMATS:  # before the inputs are read
        raise DataError(f"Unknown output format {format!r}; choose one of {', '.join(FORMATS)}.")
    documents = read_documents(inputs, json_key=json_key)  # checks the inputs before any output is created
    start = time.perf_counter()
    skipped = 0
    bar = tqdm(
        desc="tokenizing", unit=" docs", file=sys.stderr, disable=not show_progress, dynamic_ncols=True
    )
    with bar, IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, format=format) as writer:
        for batch in _batches(documents):
            texts = [t for t in batch if t]
            skipped += len(batch) - len(texts)
            for ids in tokenizer.encode_batch(texts):
                if append_eod:
                    ids.append(tokenizer.eod_id)
                writer.add_document(ids)
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{writer.num_tokens:,}", refresh=False)
    return PreprocessStats(
        prefix=writer.prefix,
        documents=writer.num_documents,
        empty_skipped=skipped,
        tokens=writer.num_tokens,
        seconds=time.perf_counter() - start,
    )


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    it = iter(documents)
    while True:
        batch, chars = [], 0
        for text in itertools.islice(it, _BATCH_DOCS):
            batch.append(text)
            chars += len(text)
            if chars >= _BATCH_CHARS:
                break
        if not batch:
            return
        yield batch


class _Parser(argparse.ArgumentParser):
    """argparse, but bad arguments raise DataError (the CLI prints it) instead of exiting."""

    def error(self, message: str):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise DataError(f"dufu preprocess: {message}. Usage: {usage}; see `dufu preprocess --help`.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dufu preprocess",
        description=(
            "Tokenize text into a memory-mapped token file <prefix>.bin + index <prefix>.idx for training, "
            "and save the tokenizer as <prefix>.tokenizer.json."
        ),
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="'builtin', a .txt file (one document), a .jsonl file (one JSON object per line) or a directory of them",
    )
    p.add_argument("--output-prefix", required=True, help="write <prefix>.bin, <prefix>.idx, <prefix>.tokenizer.json")
    p.add_argument("--tokenizer", default="byte", choices=KINDS, help="tokenizer kind (default: byte)")
    p.add_argument("--vocab-size", type=int, default=None, help="bpe: vocabulary size including <|endoftext|>")
    p.add_argument("--tokenizer-path", default=None, help="pretrained: tokenizer.json or a directory containing it")
    p.add_argument("--json-key", default="text", help="field of each .jsonl line that holds the text (default: text)")
    p.add_argument("--no-eod", action="store_true", help="do not append <|endoftext|> after each document")
    p.add_argument(
        "--format",
        default="dufu",
        choices=FORMATS,
        help="index format: dufu (default) or megatron (Megatron-LM's / LiBai's .bin/.idx, which Megatron reads "
        "with --data-path <prefix>); dufu trains on either",
    )
    p.add_argument(
        "--cache-dir", default=None, help="cache for trained tokenizers (default: $DUFU_CACHE_DIR or ~/.cache/dufu)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``dufu preprocess``: returns 0 on success; bad input raises :class:`DataError`."""
    args = build_parser().parse_args(argv)
    prefix = args.output_prefix
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    # A bpe tokenizer is trained on the very inputs being preprocessed.
    tokenizer = build_tokenizer(
        args.tokenizer,
        vocab_size=args.vocab_size,
        path=args.tokenizer_path,
        corpus=args.inputs,
        cache_dir=args.cache_dir,
        json_key=args.json_key,
    )
    stats = _preprocess(args.inputs, prefix, tokenizer, not args.no_eod, args.json_key, not args.quiet, args.format)
    tokenizer_file = tokenizer.save(prefix + ".tokenizer.json")
    rate = stats.tokens / stats.seconds if stats.seconds > 0 else float("inf")
    print(
        f"dufu preprocess: {stats.documents:,} documents, {stats.tokens:,} tokens "
        f"({tokenizer.name} tokenizer, vocab_size {tokenizer.vocab_size:,}; {args.format} format) "
        f"in {stats.seconds:.2f} s, {_human(rate, 'tokens/s')}"
    )
    if stats.empty_skipped:
        print(f"  skipped {stats.empty_skipped:,} empty documents")
    for path in (Path(prefix + ".bin"), Path(prefix + ".idx"), tokenizer_file):
        print(f"  {str(path):<50} {_human(path.stat().st_size, 'B')}")
    return 0


def _human(n: float, unit: str) -> str:
    """1234567 -> "1.2 MB" (unit "B") or "1.2 M tokens/s" (unit "tokens/s")."""
    sep = "" if len(unit) <= 1 else " "
    for scale in ("", "K", "M", "G"):
        if abs(n) < 1000:
            break
        n /= 1000
    number = f"{n:.0f}" if scale == "" else f"{n:.1f}"
    return f"{number} {scale}{sep}{unit}".replace("  ", " ")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
