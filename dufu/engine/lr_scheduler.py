"""Learning-rate schedules."""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


class WarmupCosineLR(LambdaLR):
    """Linear warmup from ``warmup_factor * lr`` to ``lr`` over ``warmup_iter`` steps, then a cosine
    decay to ``min_lr_ratio * lr`` at ``max_iter`` (GPT-3 / Megatron schedule)."""

    def __init__(self, optimizer, max_iter: int, warmup_iter: int = 0, warmup_factor: float = 0.0, min_lr_ratio: float = 0.1):
        if not 0 <= warmup_iter <= max_iter:
            raise ValueError(f"warmup_iter {warmup_iter} must be between 0 and max_iter {max_iter}")
        self.max_iter = max_iter
        self.warmup_iter = warmup_iter
        self.warmup_factor = warmup_factor
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, self._factor)

    def _factor(self, it: int) -> float:
        if it < self.warmup_iter:
            alpha = it / self.warmup_iter
            return self.warmup_factor + (1.0 - self.warmup_factor) * alpha
        span = max(1, self.max_iter - self.warmup_iter)
        progress = min(1.0, (it - self.warmup_iter) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupConstantLR(LambdaLR):
    """Linear warmup, then a constant learning rate."""

    def __init__(self, optimizer, max_iter: int, warmup_iter: int = 0, warmup_factor: float = 0.0):
        self.max_iter = max_iter
        self.warmup_iter = warmup_iter
        self.warmup_factor = warmup_factor
        super().__init__(optimizer, self._factor)

    def _factor(self, it: int) -> float:
        if it < self.warmup_iter:
            return self.warmup_factor + (1.0 - self.warmup_factor) * it / self.warmup_iter
        return 1.0


def fit_warmup_to_run(scheduler: dict, train_iter: int) -> tuple[dict, str | None]:
    """``scheduler`` (a copy of the config's LazyCall node; changed in place) with its warm-up clamped to the
    run, and a one-line notice when it was longer: a quick try of a recipe (``dufu train train.train_iter=20``)
    should run, not fail on a warm-up sized for the full run. The config keeps the value it was given, so its
    config.yaml reproduces the run (the clamp follows from it again)."""
    warmup = scheduler.get("warmup_iter")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup <= train_iter:
        return scheduler, None
    scheduler["warmup_iter"] = train_iter
    return scheduler, (f"train.scheduler.warmup_iter={warmup} is longer than the run (train.train_iter="
                       f"{train_iter}): the warm-up takes all {train_iter} steps")
