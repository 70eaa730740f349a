"""The numbers of the steps since the last read — loss, gradient norm, whether the gradients were finite, the
updates skipped so far — kept on the device and read back to the host in one transfer.

Why not read them every step (as ``loss.item()`` does): on a GPU a read waits for the device to finish
everything queued, so the host cannot run ahead and queue the next step's kernels, and across ranks each read is a
moment where one slow rank holds up the rest (torchtitan reads its loss only at its log frequency for the same
reason). The loop (:class:`dufu.engine.trainer.Trainer`) adds each step's tensors here and reads them when it
needs them on the host: at a log step, before an evaluation or a checkpoint, at the end, and when a run stops.
A non-finite gradient is acted on by the device meanwhile (the optimizer skips the update, ``found_inf``), so
reading later changes no number a run computes; ``train.nan_policy="stop"`` stops at the first read after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepRecord:
    """One step's numbers on the host. ``finite``: the step's gradients were finite (its update was taken);
    ``skipped``: updates dropped for non-finite gradients so far in this process's run."""

    step: int
    loss: float
    grad_norm: float
    finite: bool
    skipped: int
    parts: tuple = ()  # (name, value) of the loss's named parts, e.g. DeepSeek-V3's lm_loss and mtp_loss


class StepStats:
    """Steps added with :meth:`add` (device tensors) until :meth:`read` turns them into :class:`StepRecord` s with
    one host read. ``skipped`` counts non-finite steps on the device from ``skipped`` (a resumed count)."""

    def __init__(self, device: torch.device, skipped: int = 0):
        self.device = device
        self.skipped = torch.tensor(float(skipped), device=device)
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.last: StepRecord | None = None

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, parts: dict | None = None) -> None:
        """One step's loss and gradient norm, and ``parts``: {name: 0-dim tensor} of the loss's named parts."""
        finite = torch.isfinite(grad_norm.detach().float().to(self.device))
        self.skipped = self.skipped + (~finite).float()
        names = tuple(sorted(parts or {}))
        row = torch.stack([loss.detach().float().to(self.device).reshape(()),
                           grad_norm.detach().float().to(self.device).reshape(()), finite.float(), self.skipped,
                           *(parts[n].detach().float().to(self.device).reshape(()) for n in names)])
        self.pending.append((step, names, row))

    def read(self) -> list[StepRecord]:
        """The steps added since the last read, oldest first (one host read for all of them)."""
        if not self.pending:
            return []
        steps, names, rows = zip(*self.pending)
        self.pending = []
        values = torch.cat(rows).tolist()  # the one read (rows of different lengths: one flat list)
        records, at = [], 0
        for s, n, row in zip(steps, names, rows):
            loss, norm, finite, skipped, *parts = values[at:at + row.numel()]
            at += row.numel()
            records.append(StepRecord(s, loss, norm, finite > 0.5, int(skipped), tuple(zip(n, parts))))
        self.last = records[-1]
        return records


def first_non_finite(records: list[StepRecord]) -> StepRecord | None:
    """The first step whose gradient norm was not finite, or None."""
    return next((r for r in records if not r.finite), None)


def first_non_finite_loss(records: list[StepRecord]) -> StepRecord | None:
    """The first step whose loss was not finite, or None."""
    return next((r for r in records if not math.isfinite(r.loss)), None)
