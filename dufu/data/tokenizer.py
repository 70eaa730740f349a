"""Tokenizers, all through the Hugging Face ``tokenizers`` library.

Three kinds, chosen by :func:`build_tokenizer`:

* ``"byte"`` -- 256 byte tokens (id == byte value) plus ``<|endoftext|>`` (id 256):
  257 tokens, lossless for any UTF-8 text, built in memory with no training.
  The right choice for tests and tiny debug models.
* ``"bpe"`` -- a byte-level BPE trained on a corpus (default: the built-in one)
  to ``vocab_size`` tokens including ``<|endoftext|>``. Training is
  deterministic and its result is cached at
  ``<cache>/tokenizers/bpe-<hash>.json`` (see :mod:`dufu.cache`), the hash
  covering the corpus content, ``vocab_size`` and the library versions.
* ``"pretrained"`` -- a ``tokenizer.json`` file, or a Hugging Face tokenizer
  directory containing one.

Conventions every kind follows (the data pipeline relies on them):

* text is always text: a literal ``"<|endoftext|>"`` inside a document is
  encoded as ordinary characters, never as the end-of-document id -- only the
  pipeline inserts that id, between documents;
* ``encode`` adds no special tokens (no BOS / CLS / SEP from a post-processor)
  and never truncates or pads;
* ``decode`` keeps special tokens, so ``decode(encode(s)) == s`` for the byte and
  BPE kinds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dufu.errors import DataError

from dufu import cache as _cache
from .corpus import BUILTIN, Input, content_fingerprint, read_documents

EOD_TOKEN = "<|endoftext|>"
# Looked up in this order when a pretrained tokenizer does not name its end-of-document token.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "[SEP]", "<eos>", "<|eos|>", "<|im_end|>")
KINDS = ("byte", "bpe", "pretrained")
BYTE_VOCAB_SIZE = 257
# Bump when the way BPE tokenizers are built changes, to invalidate cached ones.
_BPE_RECIPE_VERSION = "1"


class Tokenizer:
    """A text <-> token-id mapping with a known end-of-document id.

    Wraps a ``tokenizers.Tokenizer`` (``backend``); see the module docstring for
    the conventions. ``kind`` is ``"byte"``, ``"bpe"`` or ``"pretrained"``;
    ``name`` is a short human-readable description.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        kind: str = "pretrained",
        name: str | None = None,
        eod_token: str | None = None,
    ):
        self.backend = backend
        self.kind = kind
        self.name = name or kind
        # Raw text never turns into special tokens; the pipeline alone inserts the EOD id.
        backend.encode_special_tokens = True
        backend.no_truncation()
        backend.no_padding()
        candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        for token in candidates:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                self.eod_token, self.eod_id = token, token_id
                break
        else:
            if eod_token is not None:
                raise DataError(
                    f"Tokenizer {self.name} has no token {eod_token!r} to use as end-of-document. "
                    "Pass an eod_token that is in its vocabulary."
                )
            raise DataError(
                f"Tokenizer {self.name} has none of the usual end-of-document tokens "
                f"({', '.join(EOD_CANDIDATES)}). Pass eod_token=... naming the token that separates "
                "documents, or add one of these to the tokenizer."
            )
        vocab = backend.get_vocab(with_added_tokens=True)
        # max id + 1, not the count: a vocabulary with holes still needs embedding rows up to its largest id.
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self._fingerprint: str | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike, eod_token: str | None = None) -> "Tokenizer":
        """Load a ``tokenizer.json`` file or a directory containing one."""
        return _load_pretrained(path, eod_token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel inside the ``tokenizers`` library)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens are kept (so the EOD id decodes to its token text)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        """The tokenizer as a ``tokenizer.json`` string."""
        return self.backend.to_str()

    @property
    def fingerprint(self) -> str:
        """A hash of the full tokenizer definition; equal fingerprints mean equal tokenization."""
        if self._fingerprint is None:
            self._fingerprint = _cache.short_hash(self.backend.to_str())
        return self._fingerprint

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tokenizer as ``tokenizer.json`` (atomically).

        Load it back with ``build_tokenizer("pretrained", path=...)``.
        """
        path = Path(path)
        _cache.atomic_write_text(path, self.backend.to_str(pretty=True))
        return path

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, name={self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def build_tokenizer(
    kind: str = "byte",
    vocab_size: int | None = None,
    path: str | os.PathLike | None = None,
    corpus: Input = BUILTIN,
    cache_dir: str | os.PathLike | None = None,
    json_key: str = "text",
    eod_token: str | None = None,
) -> Tokenizer:
    """Build a tokenizer of the given kind (``"byte"``, ``"bpe"`` or ``"pretrained"``).

    Args:
        kind: see the module docstring.
        vocab_size: ``"bpe"`` only (required): number of tokens including ``<|endoftext|>``,
            at least 257. If the corpus is too small to learn that many merges the
            vocabulary comes out smaller; check ``.vocab_size``.
        path: ``"pretrained"`` only: a ``tokenizer.json`` file or a directory containing one.
        corpus: ``"bpe"`` only: the training text, any input of :func:`read_documents`.
        cache_dir: where trained BPE tokenizers are cached (default ``$DUFU_CACHE_DIR`` or ``~/.cache/dufu``).
        json_key: the text field of ``.jsonl`` corpus files.
        eod_token: ``"pretrained"`` only: the end-of-document token, if not one of the usual ones.
    """
    if kind == "byte":
        if vocab_size not in (None, BYTE_VOCAB_SIZE):
            raise DataError(
                f"The byte tokenizer always has {BYTE_VOCAB_SIZE} tokens (256 bytes + {EOD_TOKEN}), "
                f"but vocab_size={vocab_size} was given. Leave vocab_size unset, or use kind='bpe' "
                "to train a tokenizer of that size."
            )
        return byte_tokenizer()
    if kind == "bpe":
        return _bpe_tokenizer(vocab_size, corpus, cache_dir, json_key)
    if kind == "pretrained":
        if path is None:
            raise DataError(
                "kind='pretrained' needs path=... pointing to a tokenizer.json file or a Hugging Face "
                "tokenizer directory that contains one (CLI: --tokenizer-path)."
            )
        return _load_pretrained(path, eod_token)
    raise DataError(
        f"Unknown tokenizer kind {kind!r}. Use one of: 'byte' (256 bytes + {EOD_TOKEN}, no training), "
        "'bpe' (byte-level BPE trained on a corpus, needs vocab_size) or 'pretrained' "
        "(a tokenizer.json file, needs path)."
    )


def _bytes_to_chars() -> dict[int, str]:
    """The byte -> character table of the ``ByteLevel`` pre-tokenizer.

    Printable Latin-1 bytes stand for themselves; every other byte is given the
    next unused code point from 256 upward, in byte order, so each byte is one
    visible character.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> Tokenizer:
    """The 257-token byte tokenizer: id ``b`` is byte ``b``, id 256 is ``<|endoftext|>``."""
    table = _bytes_to_chars()
    vocab = {table[b]: b for b in range(256)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No merges, so no need for the regex word split: every byte is its own token.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOD_TOKEN])
    return Tokenizer(backend, kind="byte", name="byte")


def _bpe_tokenizer(vocab_size: int | None, corpus: Input, cache_dir, json_key: str) -> Tokenizer:
    if vocab_size is None or int(vocab_size) != vocab_size or vocab_size < BYTE_VOCAB_SIZE:
        raise DataError(
            f"kind='bpe' needs vocab_size >= {BYTE_VOCAB_SIZE} (256 byte tokens + {EOD_TOKEN}), "
            f"got {vocab_size!r}. Set vocab_size (CLI: --vocab-size), e.g. 8192."
        )
    vocab_size = int(vocab_size)
    key = _cache.short_hash(
        content_fingerprint(corpus, json_key),
        str(vocab_size),
        tokenizers.__version__,
        _BPE_RECIPE_VERSION,
    )
    file = _cache.resolve_cache_dir(cache_dir) / "tokenizers" / f"bpe-{key}.json"
    name = f"bpe-{vocab_size}-{key[:8]}"
    with _cache.file_lock(file.with_suffix(".lock")):
        if file.is_file():
            try:
                return Tokenizer(tokenizers.Tokenizer.from_file(str(file)), kind="bpe", name=name)
            except Exception:  # an unreadable cache entry is rebuilt below
                pass
        backend = tokenizers.Tokenizer(models.BPE())
        # GPT-2 style: split into words by regex, map bytes to characters, merge within words.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(read_documents(corpus, json_key=json_key), trainer)
        tokenizer = Tokenizer(backend, kind="bpe", name=name)
        tokenizer.save(file)
        return tokenizer


def _load_pretrained(path: str | os.PathLike, eod_token: str | None) -> Tokenizer:
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        if p.is_dir():
            raise DataError(
                f"Tokenizer directory {p} has no tokenizer.json. dufu loads 'fast' tokenizers only: "
                "a tokenizer.json file, or a Hugging Face tokenizer directory containing one "
                "(transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir) writes it)."
            )
        raise DataError(
            f"Tokenizer file {p} does not exist. Pass a tokenizer.json file or a Hugging Face tokenizer "
            "directory containing tokenizer.json, or use kind='byte' / 'bpe' which need no file."
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"Tokenizer file {file} could not be read as a tokenizer.json ({reason}). "
            "Check that it is a complete tokenizer.json written by the Hugging Face tokenizers "
            "library (or by Tokenizer.save), not a vocab or merges file."
        ) from None
    return Tokenizer(backend, kind="pretrained", name=str(file), eod_token=eod_token)
