"""Masked-language-model data (BERT, Devlin et al. 2019, section 3.1) over fixed-length token samples.

Of every sample's tokens, ``mask_prob`` (15%) are chosen as prediction targets; of those, 80% are replaced by
the mask token, 10% by a random token and 10% are left unchanged. ``labels`` hold the original token at the
chosen positions and -100 (ignored by the loss) everywhere else::

    tokens     T  h  e     c  a  t     s  a  t
    input_ids  T  h  [M]   c  a  t     s  q  t      (e -> [MASK], a -> random q)
    labels     -  -  e  -  -  -  -  -  -  a  -      (- = -100)

The choice is a pure function of ``(seed, sample index)`` (``np.random.default_rng([seed, index])``), not of
the order samples are drawn in: every parallel layout, micro-batch size and resumed run sees exactly the same
masks, so their losses can be compared step by step. This is BERT's original static masking (one mask per
sample); every sample has at least one target, so no micro-batch has an empty loss.
"""

from __future__ import annotations

import os

import numpy as np

from dufu.errors import DataError

from .corpus import BUILTIN, Input
from .dataset import build_lm_datasets
from .sampler import Sample
from .tokenizer import Tokenizer

IGNORE_INDEX = -100
MASK_TOKENS = ("[MASK]", "<mask>")


class MaskedLMDataset:
    """``dataset[i]`` is ``Sample(input_ids=(T,), labels=(T,))`` made from the first ``T`` tokens of
    ``base[i]`` (a :class:`~dufu.data.dataset.TokenDataset` sample of ``T + 1`` tokens).

    Args:
        base: token samples (arrays of ``seq_length + 1`` ids).
        mask_token_id: the id written at 80% of the targets.
        random_vocab_size: random replacements are drawn from ``[0, random_vocab_size)``.
        mask_prob: fraction of (non-special) tokens chosen as targets.
        seed: with the sample index, determines every choice.
        special_ids: ids never chosen as targets (e.g. the end-of-document separator).
    """

    def __init__(self, base, mask_token_id: int, random_vocab_size: int, mask_prob: float = 0.15, seed: int = 0,
                 special_ids: tuple[int, ...] = ()):
        if not 0.0 < mask_prob < 1.0:
            raise DataError(f"mask_prob must be in (0, 1), got {mask_prob}; BERT uses 0.15.")
        self.base = base
        self.mask_token_id = int(mask_token_id)
        self.random_vocab_size = int(random_vocab_size)
        self.mask_prob = float(mask_prob)
        self.seed = int(seed)
        self.special_ids = np.asarray(sorted(set(special_ids)), dtype=np.int64)
        self.seq_length = int(np.shape(base[0])[0]) - 1

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        if i < 0:
            i += len(self)
        tokens = np.asarray(self.base[i], dtype=np.int64)[: self.seq_length]  # (T,)
        rng = np.random.default_rng([self.seed, i])
        eligible = ~np.isin(tokens, self.special_ids)
        chosen = (rng.random(tokens.shape[0]) < self.mask_prob) & eligible
        if not chosen.any() and eligible.any():
            chosen[rng.choice(np.flatnonzero(eligible))] = True
        action = rng.random(tokens.shape[0])  # < 0.8: mask, < 0.9: random token, else keep
        random_ids = rng.integers(0, self.random_vocab_size, tokens.shape[0])
        input_ids = tokens.copy()
        input_ids[chosen & (action < 0.8)] = self.mask_token_id
        swap = chosen & (action >= 0.8) & (action < 0.9)
        input_ids[swap] = random_ids[swap]
        labels = np.where(chosen, tokens, IGNORE_INDEX)
        return Sample(input_ids=input_ids, labels=labels)

    def __repr__(self) -> str:
        return (f"MaskedLMDataset({len(self)} samples of {self.seq_length} tokens, mask id {self.mask_token_id}, "
                f"mask_prob {self.mask_prob}, seed {self.seed})")


def mask_token_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's mask token (``[MASK]`` / ``<mask>``); a tokenizer without one (byte, BPE) gets the first
    id past its vocabulary, ``tokenizer.vocab_size`` -- so the model's ``vocab_size`` must exceed that."""
    for token in MASK_TOKENS:
        token_id = tokenizer.backend.token_to_id(token)
        if token_id is not None:
            return token_id
    return tokenizer.vocab_size


def build_mlm_datasets(
    tokenizer: Tokenizer,
    data_path: Input = BUILTIN,
    seq_length: int = 128,
    valid_fraction: float = 0.05,
    mask_prob: float = 0.15,
    seed: int = 1234,
    json_key: str = "text",
    cache_dir: str | os.PathLike | None = None,
) -> tuple[MaskedLMDataset, MaskedLMDataset | None]:
    """Train and validation masked-LM datasets of ``seq_length`` tokens from any input of
    :func:`~dufu.data.build_lm_datasets` (the built-in corpus by default). The end-of-document token is never
    a target."""
    train, valid = build_lm_datasets(data_path, tokenizer, seq_length, valid_fraction=valid_fraction,
                                     json_key=json_key, cache_dir=cache_dir)
    mask_id = mask_token_id(tokenizer)
    specials = (tokenizer.eod_id,)

    def wrap(ds, s):
        return MaskedLMDataset(ds, mask_id, tokenizer.vocab_size, mask_prob, s, specials) if ds is not None else None

    # Validation masks come from another stream than training's (its index 0 is not training's index 0).
    return wrap(train, seed), wrap(valid, seed + 1)
