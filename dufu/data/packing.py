"""Packed samples and document masks: several samples (or documents) in one row, attending only within themselves.

One interface carries both, ``position_ids`` that restart at 0 at every sample or document start, as transformers'
flattening collator writes them (HF-style ``position_ids`` keep their meaning). The models read them twice: the
position embeddings (rotary angles in LLaMA, the learned table in GPT-2) see each sample's own positions
``0 .. len - 1``, exactly as when it is padded alone; and :func:`dufu.layers.attention.document_mask` turns every
break in them into a block-causal attention mask, so no token attends across a sample boundary. Position ids
are model keyword arguments, which every pipeline stage gets; under sequence parallelism the attention sees
the whole sequence, and the mask with it. A batch without them, or with unbroken ones, runs as before.

Two uses:

* **Packed fine-tuning samples** (:class:`PackedDataset`, ``build_sft_datasets(packing=True)``): each right-padded
  sample keeps only its real positions (``lengths[i]``), and the samples are packed into rows of ``seq_length``
  best-fit in dataset order: each sample, in turn, goes into the open row with the least room that still holds
  it (the earliest such row on a tie), else opens a new row. Deterministic, no sample is cut or dropped, and the
  order is kept as far as packing allows (a row may take a later short sample into an earlier gap; sorting by
  length first would pack a little tighter, but would put samples of one length together). Best-fit rather
  than first-fit leaves the roomy rows for the samples still to come. The row's tail
  is padding: the pad id, targets -100, and positions ``0 ..`` of their own, a document of padding no real token
  attends to. The loss stays the mean over the targets: a sample's targets (and -100s) are the ones it has
  padded, and the trainer counts targets per micro-batch as before (:func:`dufu.engine.batch.count_loss_targets`).
* **Document masks for pretraining** (:class:`DocumentMaskedDataset`, Llama 3's long-context recipe): samples
  still cut the token stream across documents, but the positions restart at every document start inside the
  sample (:func:`document_position_ids`), so no token attends across a boundary. The prediction of a
  document's first token from the end of the one before stays a target, as in Megatron-LM's
  ``--reset-attention-mask`` without ``--eod-mask-loss``.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from dufu.errors import DataError

from .sampler import Sample

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------- packing
def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of item indices whose ``lengths`` sum to at most ``capacity`` each: best-fit in the given order (see
    the module docstring). Rows are in the order they were opened; items of a row in the given order. Items of
    length 0 are left out."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row index) of the rows that are not full, sorted
    for i, n in enumerate(lengths):
        n = int(n)
        if n > capacity:
            raise DataError(f"sample {i} has {n} tokens, more than the {capacity} of a packed row.")
        if n <= 0:
            continue
        k = bisect.bisect_left(room, (n, -1))  # the least room that holds n, the earliest row on a tie
        if k < len(room):
            left, r = room.pop(k)
        else:
            left, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if left - n > 0:
            bisect.insort(room, (left - n, r))
    return rows


class PackedDataset:
    """Rows of ``seq_length`` holding several samples of ``dataset`` each: ``dataset[i]`` is
    ``Sample(input_ids=(T,), shift_labels=(T,), position_ids=(T,))`` (``T = seq_length``).

    Args:
        dataset: right-padded samples, ``dataset[i]`` a dict with ``input_ids`` and ``shift_labels`` of length
            ``seq_length`` (e.g. :class:`dufu.data.sft.SFTDataset`).
        lengths: the positions of each sample that hold it (the rest is padding); at most ``seq_length``.
        pad_id: the input id of a row's padding.

    A packed sample has position ids ``0 .. lengths[i] - 1``, so its logits and loss are those it has padded
    alone (up to the order of floating-point sums).
    """

    def __init__(self, dataset, lengths: Sequence[int], pad_id: int):
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(lengths) != len(dataset):
            raise DataError(f"PackedDataset: {len(lengths)} lengths for {len(dataset)} samples.")
        seq_length = getattr(dataset, "seq_length", None) or int(np.shape(dataset[0]["input_ids"])[-1])
        self.dataset = dataset
        self.seq_length = int(seq_length)
        self.pad_id = int(pad_id)
        self.lengths = lengths
        self.rows = pack_best_fit(lengths, self.seq_length)
        if not self.rows:
            raise DataError("PackedDataset: every sample is empty, nothing to pack.")
        self.num_samples = sum(len(r) for r in self.rows)
        self.skipped = len(lengths) - self.num_samples  # samples of length 0: no token, no target

    def __len__(self) -> int:
        return len(self.rows)

    def spans(self, i: int) -> list[tuple[int, int, int]]:
        """(sample index, first position, length) of each sample in row ``i``."""
        out, start = [], 0
        for s in self.rows[int(i)]:
            n = int(self.lengths[s])
            out.append((s, start, n))
            start += n
        return out

    def __getitem__(self, i: int) -> Sample:
        T = self.seq_length
        input_ids = np.full(T, self.pad_id, dtype=np.int64)
        shift_labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.empty(T, dtype=np.int64)
        end = 0
        for s, start, n in self.spans(i):
            sample = self.dataset[s]
            input_ids[start:start + n] = sample["input_ids"][:n]
            shift_labels[start:start + n] = sample["shift_labels"][:n]
            position_ids[start:start + n] = np.arange(n)
            end = start + n
        position_ids[end:] = np.arange(T - end)  # the padding: a document of its own
        return Sample(input_ids=input_ids, shift_labels=shift_labels, position_ids=position_ids)

    @property
    def padding_share(self) -> float:
        """The share of the rows' positions that are padding."""
        return 1.0 - float(self.lengths.sum()) / (len(self.rows) * self.seq_length)

    def __repr__(self) -> str:
        return (f"PackedDataset({self.num_samples} samples in {len(self)} rows of {self.seq_length} tokens, "
                f"{self.padding_share:.1%} padding; best-fit in dataset order)")


# ------------------------------------------------------------------------------------------- document masks
def document_position_ids(start: int, length: int, doc_offsets: np.ndarray) -> np.ndarray:
    """(length,) position ids of tokens ``[start, start + length)`` of a token stream whose documents start at
    ``doc_offsets`` (ascending; an IndexedDataset's ``doc_offsets``): 0 at ``start`` and at every document start
    after it, counting up in between (Megatron-LM's ``reset_position_ids``)."""
    offsets = np.asarray(doc_offsets)
    lo = np.searchsorted(offsets, start, side="right")
    hi = np.searchsorted(offsets, start + length, side="left")
    cuts = offsets[lo:hi].astype(np.int64) - start  # document starts inside (0, length)
    begin = np.zeros(length, dtype=np.int64)
    begin[cuts] = cuts
    return np.arange(length, dtype=np.int64) - np.maximum.accumulate(begin)


class DocumentMaskedDataset:
    """A :class:`~dufu.data.dataset.TokenDataset` whose samples carry their document boundaries:
    ``dataset[i]`` is ``Sample(input_ids=(T,), shift_labels=(T,), position_ids=(T,))`` with the tokens of
    ``tokens[i]`` and position ids that restart at every document start (:func:`document_position_ids`), so the
    models mask attention across documents. Same samples, same order, same targets as ``tokens``."""

    def __init__(self, tokens):
        for need in ("indexed", "start_token", "seq_length"):
            if not hasattr(tokens, need):
                raise DataError(f"DocumentMaskedDataset wraps a TokenDataset (token windows of an indexed dataset "
                                f"with document offsets); {type(tokens).__name__} has no `{need}`.")
        self.tokens = tokens
        self.seq_length = tokens.seq_length

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        window = np.asarray(self.tokens[i], dtype=np.int64)  # (T + 1,)
        if i < 0:
            i += len(self.tokens)
        start = self.tokens.start_token + i * self.seq_length
        positions = document_position_ids(start, self.seq_length, self.tokens.indexed.doc_offsets)
        return Sample(input_ids=window[:-1], shift_labels=window[1:], position_ids=positions)

    def __getattr__(self, name):  # num_tokens, indexed, ... of the wrapped dataset
        if name == "tokens":
            raise AttributeError(name)
        return getattr(self.tokens, name)

    def __repr__(self) -> str:
        return f"DocumentMaskedDataset({self.tokens!r})"
