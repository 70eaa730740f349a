"""The training loop's declared hook points: what a feature that changes or watches a step may attach to.

Features that act on a step (test faults, torchft replica groups, the MoE monitor, benchmarks' timers and
profilers) are :class:`Hook` objects the Trainer calls at these points, in the order they were given; nothing
replaces a Trainer's methods. The points, in the order one step meets them (``trainer.step`` counts the steps
already taken, so the step under way is ``trainer.step + 1`` throughout)::

    on_start                      after a resume and the start-up summary, before the first step
    for each step:
        on_step_start             before the step's micro-batches are drawn from the sampler
        before_forward_backward   the micro-batches (lists of sample indices) are known
        after_backward            gradients accumulated (and reduced inside the job); may replace the local loss,
                                  or raise RetryStep to take the step again
        before_optimizer          gradients clipped; ``grad_norm`` is the global norm before clipping
        after_optimizer           the update is taken (or skipped), the loss reduced over the global batch
        on_save                   a checkpoint of this step was written
    on_end                        the loop is over (the summary is written)

``on_resume`` is called once a checkpoint has been loaded, with the trainer state it held.

Points that come before the work they name (``on_start``, ``on_resume``, ``on_step_start``,
``before_forward_backward``, ``before_optimizer``) call the hooks in order; points after it (``after_backward``,
``on_step_retry``, ``after_optimizer``, ``on_save``, ``on_end``) call them in reverse order, so a hook given
earlier wraps the ones after it, as nested context managers do (a replica group's quorum is taken before a test
fault fires at step start, and its gradient average comes after the fault's NaN).

Hooks come from three places, in this order: the ones dufu itself attaches from the config (the MoE monitor,
``train.fault_tolerance``, ``DUFU_FAULT``'s test faults), ``train.hooks`` (a list of ``LazyCall``'d hook
objects: part of the config, so ``config.yaml`` reproduces them), and ``Trainer(..., hooks=[...])``.
"""

from __future__ import annotations

from typing import Optional

import torch


class RetryStep(Exception):
    """Raised from ``after_backward`` to drop this step's gradients and take it again from ``on_step_start``:
    torchft's replica groups when the live groups do not agree to commit the step."""


class Hook:
    """A no-op at every point: subclass and override the points you need. Every point gets the Trainer."""

    def on_start(self, trainer) -> None:
        pass

    def on_resume(self, trainer, state: dict) -> None:
        pass

    def on_step_start(self, trainer) -> None:
        pass

    def before_forward_backward(self, trainer, micro_batches: list[list[int]]) -> None:
        pass

    def after_backward(self, trainer, local_loss: torch.Tensor) -> Optional[torch.Tensor]:
        """Return a tensor to replace this rank's loss share, or None to keep it."""
        return None

    def on_step_retry(self, trainer, error: RetryStep) -> None:
        pass

    def before_optimizer(self, trainer, grad_norm: torch.Tensor) -> None:
        pass

    def after_optimizer(self, trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """``loss``, ``grad_norm``: 0-dim tensors on the device; ``float()`` of one is a host read (a GPU
        waits for the step to finish), which the loop itself does only once per log period."""
        pass

    def on_save(self, trainer, path) -> None:
        pass

    def on_end(self, trainer, summary: dict) -> None:
        pass


POINTS = tuple(name for name in vars(Hook) if name.startswith(("on_", "before_", "after_")))
# the points after the work they name: hooks are called last-given first
AFTER_POINTS = frozenset({"after_backward", "on_step_retry", "after_optimizer", "on_save", "on_end"})


class Hooks:
    """The hooks of one Trainer, called in order."""

    def __init__(self, hooks=()):
        self.hooks = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook) -> None:
        if not any(callable(getattr(hook, point, None)) for point in POINTS):
            raise TypeError(f"{type(hook).__name__} is not a training hook: it defines none of the points "
                            f"{', '.join(POINTS)} (subclass dufu.engine.hooks.Hook)")
        self.hooks.append(hook)

    def __iter__(self):
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)

    def _ordered(self, point: str):
        return reversed(self.hooks) if point in AFTER_POINTS else iter(self.hooks)

    def call(self, point: str, trainer, *args) -> None:
        if point not in POINTS:
            raise ValueError(f"{point!r} is not a hook point; the points are {', '.join(POINTS)}")
        for hook in self._ordered(point):
            fn = getattr(hook, point, None)
            if fn is not None:
                fn(trainer, *args)

    def after_backward(self, trainer, local_loss: torch.Tensor) -> torch.Tensor:
        for hook in self._ordered("after_backward"):
            fn = getattr(hook, "after_backward", None)
            if fn is not None:
                replaced = fn(trainer, local_loss)
                local_loss = local_loss if replaced is None else replaced
        return local_loss
