"""Sequence-classification data: padded token samples with one label each.

The built-in task needs no download: **pydoc topic groups**. Every sentence of the built-in corpus (CPython's
``pydoc_data`` topics) is labelled with the group its topic belongs to:

=================  ====================================================================================
label              topics
=================  ====================================================================================
0 statements       ``assert``, ``assignment``, ``compound``, ``for``, ``function``, ``import``, ``try`` ...
1 expressions      ``binary``, ``calls``, ``comparisons``, ``lambda``, ``slicings``, ``strings`` ...
2 data model       ``customization``, ``specialnames``, ``attribute-access``, ``types``, ``objects`` ...
3 built-in types   ``string-methods``, ``typesseq``, ``typesmapping``, ``formatstrings``, ``dict`` ...
=================  ====================================================================================

(``debugger`` is left out: it is about a tool, not the language.) Each distinct sentence counts once. The classes are balanced by keeping the same
number of sentences of each (a seeded choice), so chance accuracy is 1/4, and sentences are split into train and
validation by a seeded shuffle. A sample is ``[CLS] sentence [SEP]`` padded to ``seq_length`` (longer sentences
are cut), with its ``attention_mask`` and ``labels``.
"""

from __future__ import annotations

import re

import numpy as np
from pydoc_data.topics import topics

from dufu.errors import DataError

from .sampler import Sample
from .tokenizer import Tokenizer

TOPIC_GROUPS: dict[str, tuple[str, ...]] = {
    "statements": (
        "assert", "assignment", "async", "augassign", "await", "break", "class", "compound", "continue", "del",
        "else", "exceptions", "execmodel", "for", "function", "global", "if", "import", "naming", "nonlocal",
        "pass", "raise", "return", "try", "while", "with", "yield",
    ),
    "expressions": (
        "atom-identifiers", "atom-literals", "attribute-references", "binary", "bitwise", "booleans", "calls",
        "comparisons", "conversions", "exprlists", "floating", "identifiers", "imaginary", "in", "integers",
        "lambda", "numbers", "operator-summary", "power", "shifting", "slicings", "strings", "subscriptions",
        "unary",
    ),
    "data model": (
        "attribute-access", "callable-types", "context-managers", "customization", "id-classes",
        "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames", "truth", "types",
    ),
    "built-in types": (
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object", "bltin-type-objects", "dict",
        "formatstrings", "lists", "string-methods", "typesfunctions", "typesmapping", "typesmethods",
        "typesmodules", "typesseq", "typesseq-mutable",
    ),
}
LABELS = tuple(TOPIC_GROUPS)


def split_sentences(text: str, min_chars: int = 40, max_chars: int = 300) -> list[str]:
    """Prose sentences of ``text``: split after ``.!?`` before a capital letter; code lines and tables (few
    letters), fragments and very long runs are dropped."""
    text = re.sub(r"\s+", " ", text)
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
        s = s.strip()
        if min_chars <= len(s) <= max_chars and sum(c.isalpha() for c in s) > 0.6 * len(s):
            out.append(s)
    return out


def topic_sentences() -> list[tuple[str, int]]:
    """(sentence, label) for every distinct sentence of the grouped pydoc topics, in topic and text order.
    Some topics repeat others' text (``compound`` holds ``for``, ``while`` ...): a sentence is kept once, and not
    at all if it appears under two groups."""
    labels: dict[str, set[int]] = {}
    for label, group in enumerate(TOPIC_GROUPS.values()):
        for topic in group:
            if topic in topics:  # the topic set varies a little across Python versions
                for s in split_sentences(topics[topic]):
                    labels.setdefault(s, set()).add(label)
    return [(s, next(iter(ls))) for s, ls in labels.items() if len(ls) == 1]


def _special_id(tokenizer: Tokenizer, candidates: tuple[str, ...]) -> int | None:
    for token in candidates:
        token_id = tokenizer.backend.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


class ClassificationDataset:
    """``dataset[i]`` is ``Sample(input_ids=(T,), attention_mask=(T,), labels=())`` for text ``i``:
    ``[CLS] tokens [SEP]`` (BERT's layout; RoBERTa's ``<s> ... </s>``), padded to ``seq_length``."""

    def __init__(self, texts: list[str], labels: list[int], tokenizer: Tokenizer, seq_length: int = 64,
                 label_names: tuple[str, ...] = ()):
        if len(texts) != len(labels):
            raise DataError(f"{len(texts)} texts but {len(labels)} labels; give one label per text.")
        if seq_length < 3:
            raise DataError(f"seq_length {seq_length} leaves no room for text between [CLS] and [SEP].")
        cls_id = _special_id(tokenizer, ("[CLS]", "<s>"))
        sep_id = _special_id(tokenizer, ("[SEP]", "</s>"))
        pad_id = _special_id(tokenizer, ("[PAD]", "<pad>"))
        sep_id = tokenizer.eod_id if sep_id is None else sep_id
        pad_id = tokenizer.eod_id if pad_id is None else pad_id
        head = [cls_id] if cls_id is not None else []
        room = seq_length - len(head) - 1
        n = len(texts)
        self.input_ids = np.full((n, seq_length), pad_id, dtype=np.int64)
        self.attention_mask = np.zeros((n, seq_length), dtype=np.int64)
        for i, ids in enumerate(tokenizer.encode_batch(texts)):
            row = head + ids[:room] + [sep_id]
            self.input_ids[i, : len(row)] = row
            self.attention_mask[i, : len(row)] = 1
        self.labels = np.asarray(labels, dtype=np.int64)
        self.texts = list(texts)
        self.seq_length = seq_length
        self.label_names = tuple(label_names)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        return Sample(input_ids=self.input_ids[i], attention_mask=self.attention_mask[i], labels=self.labels[i])

    def __repr__(self) -> str:
        return f"ClassificationDataset({len(self)} samples of {self.seq_length} tokens, labels {self.label_names})"


def build_topic_classification_datasets(
    tokenizer: Tokenizer,
    seq_length: int = 64,
    valid_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[ClassificationDataset, ClassificationDataset]:
    """The pydoc topic-group task (see the module docstring): balanced classes, a seeded train/validation split."""
    if not 0 < valid_fraction < 1:
        raise DataError(f"valid_fraction must be in (0, 1), got {valid_fraction}.")
    pairs = topic_sentences()
    rng = np.random.default_rng(seed)
    labels = np.asarray([y for _, y in pairs])
    per_class = min(int((labels == c).sum()) for c in range(len(LABELS)))
    keep = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False)
                           for c in range(len(LABELS))])
    keep = rng.permutation(keep)
    n_valid = max(1, round(len(keep) * valid_fraction))

    def make(idx):
        return ClassificationDataset([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], tokenizer,
                                     seq_length, LABELS)

    return make(keep[n_valid:]), make(keep[:n_valid])
