"""Weighted blends of datasets: Megatron-LM's ``--data-path 0.7 web 0.3 code``, LiBai's ``weights``.

A blend is written as ``dataloader.train.data_path`` in one of three forms, each path being anything a single
``data_path`` may be (a preprocessed prefix or a text input)::

    [0.7, "data/web", 0.3, "data/code"]          # Megatron's list: weight, path, weight, path, ...
    {"data/web": 0.7, "data/code": 0.3}          # a {path: weight} dict
    "0.7 data/web 0.3 data/code"                 # Megatron's command line as one string (for overrides)

Weights are normalised to sum to 1; a weight of 0 keeps a dataset out of training (Megatron's rule would still
draw it on ties) but in evaluation.

**The order** is Megatron's rule (megatron-core's ``build_blending_indices`` in
``megatron/core/datasets/helpers.cpp``): sample ``i`` of the blend comes from the dataset furthest behind its
share, the one with the largest error ``w_d * max(i, 1) - drawn_d`` (ties to the lowest index; step 0 thus
takes the heaviest dataset), and is that dataset's next sample, its samples taken cyclically in their own
order. No dataset is ever a whole sample ahead of its share, so every prefix of the stream follows the weights
as closely as whole samples allow. The blend is an index map over datasets, nothing else: deterministic without
a seed, the same in every layout, and the trainer's :class:`~dufu.data.sampler.ResumableBatchSampler` orders
its samples (and resumes them) like those of any dataset.

dufu computes the errors exactly (below), Megatron in floating point: where two errors are exactly equal,
rounding can make Megatron take the other dataset (``0.7 * 90 = 62.99999999999999``: at step 90 of a
0.7 / 0.3 blend Megatron draws from the second dataset, dufu, by the tie rule, from the first). With weights
exact in binary (0.5, 0.25, 0.375 ...) the two orders are identical (tests/data/test_blend.py compares them with
megatron-core's); otherwise each dataset's count in every prefix differs from Megatron's by at most one.

**No loop over the samples.** With the weights as integers ``a_d`` summing to ``A`` (``w_d = a_d / A``), the
errors times ``A`` are integers, and the rule repeats with period ``A`` from step ``A`` on: a dataset is drawn
only when its error is the largest, hence >= 0 (the errors sum to 0), and the draw changes it by w_d - 1 > -1,
so no error ever reaches -1; at step ``mA`` (m >= 1) every error ``m a_d - drawn_d`` is an integer above -1 and they
sum to 0, so all are 0, and from there the rule sees the same errors every ``A`` steps. So two periods are built,
steps ``[0, A)`` and ``[A, 2A)`` (they differ only when the first dataset is not the heaviest: step 0 takes the
heaviest, step ``A``, all errors 0, the first) -- for two datasets by a closed form (``blend_periods``), for
more by a loop over ``2A`` steps, ``A`` being 10 for weights like 0.5 / 0.3 / 0.2 -- and any position is then
found in O(1): ``m, r = divmod(i, A)``, dataset ``d = period[min(m, 1)][r]``, its sample
``(drawn_before[min(m, 1)][r] + a_d m) mod n_d``. Weights are taken as the simplest fractions within 1e-9 of
them with a denominator of at most 2**20, and otherwise rounded to 2**20ths (an error below 1e-6); a blend of
any length then costs at most a few MB, and nothing is built per sample.

One pass of the blend (its ``len``) holds every sample of every dataset at least once:
``max_d ceil(n_d / w_d)`` samples over the datasets with a positive weight.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from dufu.errors import DataError

# The largest period of a blend: weights are used as fractions with at most this denominator.
MAX_PERIOD = 1 << 20
_WEIGHT_TOLERANCE = 1e-9

_FORMS = ('[0.7, "data/web", 0.3, "data/code"] (Megatron\'s list: a weight before each path), '
          '{"data/web": 0.7, "data/code": 0.3} (a {path: weight} dict), or the string "0.7 data/web 0.3 data/code"')


# ------------------------------------------------------------------------------------------------ parsing
def _is_weight(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_path(x: Any) -> bool:
    if isinstance(x, (str, os.PathLike)):
        return True
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(p, (str, os.PathLike)) for p in x)


def parse_blend(data_path: Any) -> list[tuple[float, Any]] | None:
    """``data_path`` as ``[(weight, path), ...]`` if it is a blend (see the module docstring), else None.

    A list or tuple is a blend when any element is a number; a plain list of paths stays what it always was,
    one input read in order. A string is a blend when it is not an existing path and reads as
    ``weight path [weight path ...]``. Bad weights or pairing raise :class:`DataError` with what was given and
    the expected form.
    """
    if isinstance(data_path, Mapping):
        pairs = []
        for path, weight in data_path.items():
            if not _is_path(path):
                raise DataError(f"data_path {data_path!r}: the key {path!r} is not a path. A blend dict maps each "
                                f"path to its weight. Accepted blend forms: {_FORMS}.")
            pairs.append((weight, path))
        return _checked(pairs, data_path)
    if isinstance(data_path, (list, tuple)):
        if not any(_is_weight(x) for x in data_path):
            return None
        if len(data_path) % 2:
            raise DataError(f"data_path {_short(data_path)} has {len(data_path)} elements, so its weights and paths "
                            f"do not pair up. Give a weight before every path: {_FORMS}.")
        for k in range(0, len(data_path), 2):
            weight, path = data_path[k], data_path[k + 1]
            if not _is_weight(weight):
                raise DataError(f"data_path {_short(data_path)}: element {k} ({weight!r}) should be a weight (a "
                                f"number) before the path {path!r}. Expected {_FORMS}.")
            if not _is_path(path):
                raise DataError(f"data_path {_short(data_path)}: element {k + 1} ({path!r}) should be the path "
                                f"that weight {weight!r} belongs to. Expected {_FORMS}.")
        return _checked([(data_path[k], data_path[k + 1]) for k in range(0, len(data_path), 2)], data_path)
    if isinstance(data_path, str) and not os.path.exists(data_path):
        words = data_path.split()
        if len(words) >= 2 and _float_or_none(words[0]) is not None:
            if len(words) % 2:
                raise DataError(f"data_path {data_path!r} reads as Megatron's 'weight path weight path ...' but has "
                                f"{len(words)} words, so weights and paths do not pair up. Expected {_FORMS}.")
            pairs = []
            for k in range(0, len(words), 2):
                weight = _float_or_none(words[k])
                if weight is None:
                    raise DataError(f"data_path {data_path!r}: word {k + 1} ({words[k]!r}) should be the weight "
                                    f"of {words[k + 1]!r}. Expected {_FORMS}.")
                pairs.append((weight, words[k + 1]))
            return _checked(pairs, data_path)
    return None


def _float_or_none(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _checked(pairs: list[tuple[Any, Any]], given: Any) -> list[tuple[float, Any]]:
    if not pairs:
        raise DataError(f"data_path {given!r} is an empty blend. Give at least one weighted path: {_FORMS}.")
    for weight, path in pairs:
        if not _is_weight(weight):
            raise DataError(f"data_path {_short(given)}: the weight of {path!r} is {weight!r}, not a number. "
                            f"Expected {_FORMS}.")
        if not math.isfinite(weight):
            raise DataError(f"data_path {_short(given)}: the weight of {path!r} is {weight}; weights are finite "
                            "numbers >= 0.")
        if weight < 0:
            raise DataError(f"data_path {_short(given)}: the weight of {path!r} is {weight}, which is negative. "
                            "Weights are >= 0 (0 keeps a dataset out of training but evaluates it).")
    if sum(float(w) for w, _ in pairs) <= 0:
        raise DataError(f"data_path {_short(given)}: the weights sum to 0, so no dataset would be drawn. Give at "
                        "least one dataset a positive weight.")
    return [(float(w), p) for w, p in pairs]


def dataset_names(paths: Sequence[Any]) -> list[str]:
    """A short unique name per blended path, for ``eval_loss/<name>``: the path's stem (``data/web.jsonl`` and the
    prefix ``data/web`` are ``web``; a list input is named by its first path), with ``_2``, ``_3`` ... added to
    repeats."""
    names, seen = [], {}
    for path in paths:
        first = path[0] if isinstance(path, (list, tuple)) else path
        text = os.fspath(first).rstrip("/\\") or "data"
        stem = Path(text).name
        for suffix in (".bin", ".idx", ".jsonl", ".txt", ".parquet", ".arrow"):
            if stem.endswith(suffix) and len(stem) > len(suffix):
                stem = stem[: -len(suffix)]
                break
        stem = stem or "data"
        seen[stem] = seen.get(stem, 0) + 1
        names.append(stem if seen[stem] == 1 else f"{stem}_{seen[stem]}")
    # a generated "web_2" may collide with a dataset really named "web_2": number those again
    while len(set(names)) < len(names):
        counts: dict[str, int] = {}
        fixed = []
        for n in names:
            counts[n] = counts.get(n, 0) + 1
            fixed.append(n if counts[n] == 1 else f"{n}_{counts[n]}")
        names = fixed
    return names


# ------------------------------------------------------------------------------------------------ the rule
def integer_weights(weights: Sequence[float]) -> np.ndarray:
    """The weights as integers ``a_d`` (int64) whose ratios are the weights: the smallest denominator
    ``A = sum(a_d) <= MAX_PERIOD`` within 1e-9 of every normalised weight (0.7 / 0.3 -> 7, 3; three equal
    weights -> 1, 1, 1), else the weights rounded to ``MAX_PERIOD``-ths with the largest remainders. A positive
    weight always gets at least 1, a zero weight 0."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise DataError(f"Blend weights must be finite numbers >= 0 with a positive sum, got {list(weights)}.")
    w = w / w.sum()
    positive = w > 0
    start = 1
    while start <= MAX_PERIOD:  # 1..1024 first (almost every blend), then the rest in chunks of bounded memory
        stop = min(1024 if start == 1 else start + (1 << 16) - 1, MAX_PERIOD)
        denominators = np.arange(start, stop + 1, dtype=np.int64)
        ideal = w[None, :] * denominators[:, None]  # (candidates, K)
        a = np.rint(ideal)
        ok = ((a.sum(axis=1) == denominators)
              & np.all(np.abs(a - ideal) <= _WEIGHT_TOLERANCE * denominators[:, None], axis=1)
              & np.all((a >= 1) | ~positive[None, :], axis=1))
        if ok.any():
            return a[int(np.argmax(ok))].astype(np.int64)  # the smallest such A: already in lowest terms
        start = stop + 1
    ideal = w * MAX_PERIOD
    a = np.floor(ideal).astype(np.int64)
    a[positive & (a == 0)] = 1
    short = MAX_PERIOD - int(a.sum())
    order = np.argsort(-(ideal - np.floor(ideal)), kind="stable")  # largest remainders first
    for d in order:
        if short == 0:
            break
        if short > 0 and positive[d]:
            a[d] += 1
            short -= 1
    for d in np.argsort(-a, kind="stable"):  # too many after the minimum of 1: take from the largest
        while short < 0 and a[d] > 1:
            a[d] -= 1
            short += 1
    return a // np.gcd.reduce(a)


def blend_periods(a: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's rule for integer weights ``a`` (``A = sum(a)``, every ``a_d > 0``), as its two periods: steps
    ``[0, A)`` and steps ``[A, 2A)``, after which the second repeats (module docstring). Each period is the
    dataset of each step (uint8 / uint16) and how many samples that dataset had given before the step, counted
    from the period's start (int64).

    Step ``i`` takes the dataset with the largest ``a_d max(i, 1) - A drawn_d`` (exact integers; ties to the
    lowest index): Megatron's ``w_d max(i, 1) - drawn_d`` times ``A``."""
    a = [int(x) for x in a]
    K, A = len(a), sum(a)
    if K < 1 or min(a) < 1 or math.gcd(*a) != 1:
        raise ValueError(f"blend_periods needs positive integer weights in lowest terms, got {a}")
    dtype = np.uint8 if K <= 256 else np.uint16
    if K == 1:
        steps = np.arange(A, dtype=np.int64)
        return np.zeros(A, dtype), steps, np.zeros(A, dtype), steps.copy()
    if K == 2:
        # Two datasets: dataset 0 is drawn at step i >= 1 exactly when A drawn_0 <= a_0 i (the errors are
        # a_0 i - A drawn_0 and its negative), so from step 1 on drawn_0(i) = floor(a_0 (i - 1) / A) + 1 if step 0
        # took dataset 0 (a_0 >= a_1: the larger weight) and ceil(a_0 (i - 1) / A) if it took dataset 1, the
        # latter only up to step A (a_0 and A are coprime, so a_0 i / A is a whole number first at i = A).
        i = np.arange(2 * A + 1, dtype=np.int64)
        after = (a[0] * np.maximum(i - 1, 0)) // A + 1
        first = after if a[0] >= a[1] else -((-a[0] * np.maximum(i - 1, 0)) // A)
        drawn0 = np.concatenate([first[: A + 1], after[A + 1:]])
        drawn0[0] = 0
        picks = (1 - np.diff(drawn0)).astype(dtype)  # (2A,)
        before = np.where(picks == 0, drawn0[:-1], i[:-1] - drawn0[:-1])
    else:
        # Three or more datasets: no closed form is known (the errors move by a piecewise translation of a
        # (K-1)-dimensional region); the two periods are a loop over 2A steps (A = 10 for 0.5 / 0.3 / 0.2).
        picks = np.empty(2 * A, dtype)
        before = np.empty(2 * A, np.int64)
        drawn = [0] * K
        order = range(1, K)
        for step in range(2 * A):
            t = max(step, 1)
            best, best_error = 0, a[0] * t - A * drawn[0]
            for d in order:
                error = a[d] * t - A * drawn[d]
                if error > best_error:
                    best, best_error = d, error
            picks[step] = best
            before[step] = drawn[best]
            drawn[best] += 1
    counts = np.bincount(picks[:A], minlength=K)
    assert counts.tolist() == a, f"blend period drew {counts.tolist()}, not {a}"  # the module docstring's argument
    steady_before = before[A:] - np.asarray(a, dtype=np.int64)[picks[A:]]
    return picks[:A], before[:A], picks[A:], steady_before


# ------------------------------------------------------------------------------------------------ datasets
class BlendedDataset:
    """Samples of several datasets mixed by weight (see the module docstring for the order).

    Args:
        datasets: the datasets (anything with ``len`` and ``[]``), each with at least one sample.
        weights: one number >= 0 per dataset, with a positive sum (normalised here).
        names: one name per dataset (default ``"0"``, ``"1"`` ...), used in reports.
        num_samples: the blend's length; default ``max_d ceil(n_d / w_d)``, the shortest pass that holds every
            sample of every dataset with a positive weight.

    ``blend[i]`` is ``datasets[d][j]`` for ``(d, j) = blend.locate(i)``.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], names: Sequence[str] | None = None,
                 num_samples: int | None = None):
        if not datasets or len(datasets) != len(weights):
            raise DataError(f"A blend needs one weight per dataset, got {len(datasets)} datasets and "
                            f"{len(weights)} weights.")
        self.datasets = list(datasets)
        self.names = [str(n) for n in names] if names is not None else [str(d) for d in range(len(datasets))]
        if len(self.names) != len(self.datasets):
            raise DataError(f"A blend needs one name per dataset, got {len(self.names)} for {len(datasets)}.")
        self.sizes = np.array([len(ds) for ds in self.datasets], dtype=np.int64)
        if np.any(self.sizes < 1):
            empty = [n for n, s in zip(self.names, self.sizes) if s < 1]
            raise DataError(f"Blended dataset(s) {empty} have no samples.")
        w = np.asarray(weights, dtype=np.float64)
        self.ratio = integer_weights(w)  # (K,) int64: a_d, 0 for a zero weight
        self.weights = w / w.sum()  # (K,) the normalised weights as given
        self.period = int(self.ratio.sum())  # A
        # The rule runs over the datasets with a positive weight only; a zero weight is never drawn.
        active = np.flatnonzero(self.ratio > 0)
        first_d, first_before, steady_d, steady_before = blend_periods(self.ratio[active])
        index_dtype = np.uint8 if len(self.datasets) <= 256 else np.uint16
        # (2, A): row 0 the first period (steps [0, A)), row 1 every later one (steps [mA, (m+1)A), m >= 1)
        self._dataset = np.stack([active[first_d], active[steady_d]]).astype(index_dtype)
        self._before = np.stack([first_before, steady_before])
        if num_samples is None:
            # n_d / w_d with w_d = a_d / A, exactly: ceil(n_d A / a_d)
            num_samples = max(-(-int(self.sizes[d]) * self.period // int(self.ratio[d])) for d in active)
        if int(num_samples) != num_samples or num_samples < 1:
            raise DataError(f"num_samples of a blend must be a positive integer, got {num_samples!r}.")
        self._len = int(num_samples)
        self.seed = None  # set by order_by_seed: then each dataset's passes are shuffled here
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # dataset -> (pass, its permutation)

    def order_by_seed(self, seed: int, num_samples: int | None = None) -> None:
        """Make the blend the training order itself, as Megatron's datasets are: each dataset's samples are taken
        in a permutation per pass over that dataset (seeded by ``seed``, the dataset and the pass), so the trainer's
        sampler keeps the blend's order (``orders_samples``) and every prefix of what trains follows the weights.
        ``num_samples``: lengthen the blend to the whole run, so it never wraps around to its own start."""
        self.seed = int(seed)
        self._perms = {}
        if num_samples is not None:
            self._len = max(self._len, int(num_samples))

    @property
    def orders_samples(self) -> bool:
        """True once :meth:`order_by_seed` has made the blend the training order (the sampler must not shuffle)."""
        return self.seed is not None

    def _permuted(self, d: int, drawn: int) -> int:
        """The sample of dataset ``d`` at its ``drawn``-th draw: plain cyclic order, or the pass's permutation."""
        size = int(self.sizes[d])
        epoch, j = divmod(drawn, size)
        if self.seed is None:
            return j
        cached = self._perms.get(d)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, d, epoch]))
            cached = self._perms[d] = (epoch, rng.permutation(size))
        return int(cached[1][j])

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[int, int]:
        """``(dataset, sample)`` of blend sample ``i``."""
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range [0, {self._len})")
        m, r = divmod(i, self.period)
        row = min(m, 1)
        d = int(self._dataset[row, r])
        drawn = int(self._before[row, r]) + int(self.ratio[d]) * m  # samples of d before this one
        return d, self._permuted(d, drawn)

    def __getitem__(self, i: int):
        d, j = self.locate(i)
        return self.datasets[d][j]

    def index_map(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's two arrays for blend samples ``[start, stop)``: the dataset of each sample and its index in
        that dataset (vectorised; ``stop`` may exceed ``len(self)``: the rule goes on)."""
        stop = self._len if stop is None else stop
        i = np.arange(start, stop, dtype=np.int64)
        m, r = np.divmod(i, self.period)
        row = np.minimum(m, 1)
        d = self._dataset[row, r]
        drawn = self._before[row, r] + self.ratio[d] * m
        if self.seed is not None:
            return d, np.array([self._permuted(int(k), int(n)) for k, n in zip(d, drawn)], dtype=np.int64)
        return d, drawn % self.sizes[d]

    def draws(self, num_samples: int | None = None) -> np.ndarray:
        """How many of the first ``num_samples`` blend samples (default: one pass) come from each dataset."""
        n = self._len if num_samples is None else int(num_samples)
        m, r = divmod(n, self.period)
        return self.ratio * m + np.bincount(self._dataset[min(m, 1), :r], minlength=len(self.datasets))

    @property
    def seq_length(self) -> int | None:
        lengths = {getattr(ds, "seq_length", None) for ds in self.datasets}
        return lengths.pop() if len(lengths) == 1 else None

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {w:.3g} of {s} samples" for n, w, s in zip(self.names, self.weights, self.sizes))
        return f"BlendedDataset({parts}; {self._len} samples per pass, period {self.period})"


class ValidationSets:
    """The validation splits of a blend's datasets, one after another; evaluation reports each by name.

    ``parts`` is ``[(name, dataset), ...]``; ``sets[i]`` indexes the concatenation, ``len`` is the total.
    """

    def __init__(self, parts: Sequence[tuple[str, Any]]):
        self.parts = [(str(name), ds) for name, ds in parts]
        self._ends = np.cumsum([len(ds) for _, ds in self.parts], dtype=np.int64)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.parts]

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, i: int):
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._ends, i, side="right"))
        start = int(self._ends[k - 1]) if k else 0
        return self.parts[k][1][i - start]

    @property
    def seq_length(self) -> int | None:
        lengths = {getattr(ds, "seq_length", None) for _, ds in self.parts}
        return lengths.pop() if len(lengths) == 1 else None

    def __repr__(self) -> str:
        return "ValidationSets(" + ", ".join(f"{n}: {len(ds)} samples" for n, ds in self.parts) + ")"
