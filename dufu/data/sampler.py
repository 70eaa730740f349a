"""A resumable, layout-invariant distributed batch sampler (the Megatron / LiBai way).

The sample order depends only on ``(num_samples, seed, shuffle)``: epoch ``e`` is
``np.random.default_rng([seed, e]).permutation(num_samples)`` (``arange`` without
shuffle) and the order is epoch 0, epoch 1, ... back to back. Global batch ``k``
is ``order[k*G : (k+1)*G]`` for ``G = global_batch_size`` -- a batch may span two
epochs, and no sample is ever dropped.

Only then is the layout applied: data-parallel rank ``r`` of ``dp`` takes the
contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of the global batch and cuts it into
micro-batches of ``micro_batch_size``. So the samples a step trains on, and
thus the loss curve, do not change when the run is restarted with another
data-parallel size or micro-batch size (gradient accumulation absorbs the
difference). The only state is ``consumed_samples``, a position in the order,
which is what a checkpoint stores.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from dufu.errors import ConfigError


class ResumableBatchSampler:
    """Yields, per training step, this data-parallel rank's micro-batches of sample indices.

    Args:
        num_samples: size of the dataset.
        global_batch_size: samples per optimizer step over all ranks (``G``).
        micro_batch_size: samples per forward/backward on one rank.
        data_parallel_rank, data_parallel_size: this rank's position on the data-parallel axis.
        seed: seed of the per-epoch permutations.
        shuffle: if False, every epoch is ``0, 1, ..., num_samples - 1``.

    ``G`` must be a multiple of ``micro_batch_size * data_parallel_size``; each
    step then has ``G / (micro_batch_size * data_parallel_size)`` micro-batches
    (the gradient-accumulation steps).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        for name, value in (
            ("num_samples", num_samples),
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("data_parallel_size", data_parallel_size),
        ):
            if int(value) != value or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size}) for "
                f"data_parallel_size {data_parallel_size}."
            )
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step:
            lower = max(per_step, global_batch_size // per_step * per_step)
            raise ConfigError(
                f"global_batch_size {global_batch_size} is not divisible by micro_batch_size x "
                f"data_parallel_size = {micro_batch_size} x {data_parallel_size} = {per_step} "
                f"({global_batch_size} / {per_step} = {global_batch_size / per_step:.3g}). "
                f"Use a global_batch_size that is a multiple of {per_step} (e.g. {lower} or {lower + per_step}), "
                "or change micro_batch_size."
            )
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.consumed_samples = 0
        self._perms: dict[int, np.ndarray] = {}  # the last couple of epoch permutations

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each rank (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // self.num_samples

    def _epoch_order(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            # A batch touches at most the current and the next epoch (unless G > num_samples),
            # so keeping two permutations means each one is generated once.
            for old in [e for e in self._perms if e < epoch - 1]:
                del self._perms[old]
            self._perms[epoch] = perm
        return perm

    def _order_slice(self, start: int, stop: int) -> np.ndarray:
        """``order[start:stop]`` of the infinite epoch-by-epoch order."""
        parts = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(stop - pos, self.num_samples - offset)
            parts.append(self._epoch_order(epoch)[offset : offset + take])
            pos += take
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def global_batch(self, consumed_samples: int | None = None) -> list[int]:
        """All ``G`` sample indices of the global batch starting at ``consumed_samples`` (default: the next one)."""
        start = self.consumed_samples if consumed_samples is None else consumed_samples
        return self._order_slice(start, start + self.global_batch_size).tolist()

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next global batch; advances ``consumed_samples`` by ``G``."""
        per_rank = self.global_batch_size // self.data_parallel_size
        start = self.consumed_samples + self.data_parallel_rank * per_rank
        mine = self._order_slice(start, start + per_rank).tolist()
        self.consumed_samples += self.global_batch_size
        mbs = self.micro_batch_size
        return [mine[i : i + mbs] for i in range(0, per_rank, mbs)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Endless: one :meth:`next_step` per iteration."""
        while True:
            yield self.next_step()

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` left off: the next step is the global batch starting at its ``consumed_samples``.

        The layout (data-parallel size, micro-batch size) may differ from the
        saved run, and so may the global batch size: the position in the sample
        order is what is restored. The dataset size, seed and shuffle must match,
        since they define the order.
        """
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"Cannot resume the data order: the checkpoint was saved with {key}={state[key]!r}, "
                    f"but this run has {key}={getattr(self, key)!r}. The sample order depends on num_samples, "
                    f"seed and shuffle; use the same dataset, seq_length and seed as the saved run, or start "
                    "the data order from scratch."
                )
        consumed = state["consumed_samples"]
        if int(consumed) != consumed or consumed < 0:
            raise ConfigError(
                f"consumed_samples in the sampler state must be a non-negative integer, got {consumed!r}."
            )
        self.consumed_samples = int(consumed)


class Sample(dict):
    """A sample made of several named arrays (``{"input_ids": ..., "labels": ...}``): masked-LM, classification.

    ``shape`` is ``(seq_length + 1,)``, the shape a plain token sample (:class:`~dufu.data.dataset.TokenDataset`)
    feeding the same ``seq_length`` model inputs has, so code that sizes a run from ``dataset[0].shape`` works
    for both kinds of data."""

    @property
    def shape(self) -> tuple[int]:
        return (int(np.shape(self["input_ids"])[-1]) + 1,)


def collate(dataset, indices) -> torch.Tensor | dict[str, torch.Tensor]:
    """Stack ``dataset[i]`` for ``i`` in ``indices``: token samples into a LongTensor of shape
    ``(B, seq_length + 1)``; dict samples key by key into a dict of tensors (integer arrays become int64,
    floating ones keep their dtype)."""
    samples = [dataset[int(i)] for i in indices]
    if samples and isinstance(samples[0], dict):
        out = {}
        for key in samples[0]:
            stacked = np.stack([np.asarray(s[key]) for s in samples])
            out[key] = torch.from_numpy(stacked if stacked.dtype.kind == "f" else stacked.astype(np.int64))
        return out
    return torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))
