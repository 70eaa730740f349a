"""T5's span-corruption pre-training objective (Raffel et al. 2020, section 3.1.4 and 3.3.4).

From each run of raw tokens, about ``noise_density`` (15%) of the tokens are dropped in spans of mean
length ``mean_noise_span_length`` (3). The encoder input keeps the other tokens and puts one sentinel
in place of each dropped span; the target lists each sentinel followed by the span it replaced::

    raw:     Thank you for inviting me to your party last week .
    input:   Thank you <X> me to your party <Y> week . </s>
    target:  <X> for inviting <Y> last </s>

Span lengths are random but their numbers are not: a raw run of ``tokens_length`` tokens always gives
an input of exactly ``inputs_length`` and a target of exactly ``targets_length`` tokens (EOS included),
so batches need no padding. :func:`compute_lengths` picks ``tokens_length`` for a wanted input length.

The corruption of sample ``i`` is drawn from ``numpy.random.default_rng([seed, i])``: the same sample
index and seed always give the same input and target, whatever the layout or resume point.

Sentinels are the ids just above the tokenizer's vocabulary, counted down as T5's ``<extra_id_k>``:
sentinel k is ``tokenizer.vocab_size + num_sentinels - 1 - k``. The model's vocabulary must therefore
hold at least ``tokenizer.vocab_size + num_sentinels`` ids (``dataset.vocab_size``).
"""

from __future__ import annotations

import os

import numpy as np

from dufu.errors import DataError

from .corpus import Input
from .dataset import TokenDataset, build_lm_datasets
from .sampler import Sample
from .tokenizer import Tokenizer


def span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for a raw run of ``length`` tokens."""
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
    return num_noise, num_spans


def corrupted_lengths(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(input length, target length), EOS included, for a raw run of ``tokens_length`` tokens."""
    num_noise, num_spans = span_counts(tokens_length, noise_density, mean_noise_span_length)
    return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1


def compute_lengths(inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """(raw tokens per sample, target length): the longest raw run whose corrupted input fits ``inputs_length``
    (as T5 sizes its pre-training examples: 512 input tokens come from 568 raw tokens, with 114 targets)."""
    if inputs_length < 3:
        raise DataError(f"inputs_length must be at least 3, got {inputs_length}.")
    tokens_length = inputs_length
    while corrupted_lengths(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    return tokens_length, corrupted_lengths(tokens_length, noise_density, mean_noise_span_length)[1]


def _segments(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Random lengths (each >= 1) of ``num_segments`` segments that add up to ``num_items``."""
    cuts = np.sort(rng.choice(num_items - 1, num_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [num_items]]))


def noise_mask(length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean (length,) mask, True = dropped: kept and dropped spans alternate, starting with a kept one."""
    num_noise, num_spans = span_counts(length, noise_density, mean_noise_span_length)
    noise = _segments(num_noise, num_spans, rng)
    kept = _segments(length - num_noise, num_spans, rng)
    mask = np.zeros(length, dtype=bool)
    pos = 0
    for k, n in zip(kept, noise):
        pos += k
        mask[pos:pos + n] = True
        pos += n
    return mask


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, target ids): each dropped span becomes the next sentinel in the input, and the
    target lists every sentinel with its span; both end with ``eos_id``."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # first token of each dropped span
    span_id = np.cumsum(starts) - 1  # which span a token belongs to (valid where mask)
    if starts.sum() > len(sentinels):
        raise DataError(f"{int(starts.sum())} noise spans need more than the {len(sentinels)} sentinels; raise "
                        "num_sentinels or shorten the samples.")
    inputs, targets = [], []
    for t, m, s, sid in zip(tokens, mask, starts, span_id):
        if not m:
            inputs.append(t)
            continue
        if s:
            inputs.append(sentinels[sid])
            targets.append(sentinels[sid])
        targets.append(t)
    inputs.append(eos_id)
    targets.append(eos_id)
    return np.asarray(inputs, dtype=np.int64), np.asarray(targets, dtype=np.int64)


class SpanCorruptionDataset:
    """``dataset[i]`` -> ``{"input_ids": (inputs_length,), "labels": (targets_length,)}`` int64, from raw
    sample ``i`` of a :class:`~dufu.data.dataset.TokenDataset` whose samples hold ``tokens_length`` tokens."""

    def __init__(self, tokens: TokenDataset, tokens_length: int, eos_id: int, sentinel_start: int,
                 num_sentinels: int = 100, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                 seed: int = 0):
        if tokens.seq_length + 1 < tokens_length:
            raise DataError(f"token samples of {tokens.seq_length + 1} tokens are shorter than tokens_length {tokens_length}")
        self.tokens = tokens
        self.tokens_length = tokens_length
        self.eos_id = eos_id
        self.sentinels = sentinel_start - np.arange(num_sentinels)  # <extra_id_0>, <extra_id_1>, ...
        self.noise_density = noise_density
        self.mean_noise_span_length = mean_noise_span_length
        self.seed = seed
        self.inputs_length, self.targets_length = corrupted_lengths(tokens_length, noise_density, mean_noise_span_length)
        self.seq_length = self.inputs_length  # the encoder positions per sample (the trainer's sizing)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        raw = self.tokens[i][: self.tokens_length]
        rng = np.random.default_rng([self.seed, i])
        mask = noise_mask(self.tokens_length, self.noise_density, self.mean_noise_span_length, rng)
        inputs, targets = corrupt(raw, mask, self.sentinels, self.eos_id)
        return Sample(input_ids=inputs, labels=targets)

    def __repr__(self) -> str:
        return (f"SpanCorruptionDataset({len(self)} samples, {self.tokens_length} raw tokens -> inputs "
                f"{self.inputs_length}, targets {self.targets_length})")


def build_span_corruption_datasets(
    data_path: Input,
    tokenizer: Tokenizer,
    inputs_length: int = 128,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    num_sentinels: int = 100,
    valid_fraction: float = 0.05,
    seed: int = 0,
    json_key: str = "text",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[SpanCorruptionDataset, SpanCorruptionDataset | None]:
    """Span-corruption train/validation sets over any input :func:`~dufu.data.build_lm_datasets` takes
    ("builtin", text files, a preprocessed prefix); the split is the same by-document split."""
    tokens_length, _ = compute_lengths(inputs_length, noise_density, mean_noise_span_length)
    num_spans = span_counts(tokens_length, noise_density, mean_noise_span_length)[1]
    if num_spans > num_sentinels:
        raise DataError(f"samples of {tokens_length} raw tokens have {num_spans} noise spans, more than "
                        f"num_sentinels={num_sentinels}; raise num_sentinels or lower inputs_length.")
    train_tokens, valid_tokens = build_lm_datasets(data_path, tokenizer, tokens_length - 1, valid_fraction,
                                                   json_key=json_key, cache_dir=cache_dir)
    kw = dict(tokens_length=tokens_length, eos_id=tokenizer.eod_id,
              sentinel_start=tokenizer.vocab_size + num_sentinels - 1, num_sentinels=num_sentinels,
              noise_density=noise_density, mean_noise_span_length=mean_noise_span_length, seed=seed)
    train = SpanCorruptionDataset(train_tokens, **kw)
    valid = SpanCorruptionDataset(valid_tokens, **kw) if valid_tokens is not None else None
    return train, valid
