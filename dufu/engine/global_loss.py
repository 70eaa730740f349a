"""The loss over the global batch: how micro-batch losses are weighted, summed and reduced so that every layout
and every number of micro-batches gives the mean over all the global batch's targets — one big batch on one
device — and what is logged is that mean.

The rule: a micro-batch's mean loss gets the weight ``targets in it x data ranks / targets in the global batch``.
Summed over a rank's micro-batches and averaged over data-parallel ranks (as gradients are), that is the mean
over the global batch's targets, also when micro-batches hold different numbers of targets (masked LM, SFT with
prompt masking). The count of the global batch's targets is taken once per batch by :meth:`begin`, before any
micro-batch is weighted: the step (and evaluation) call it explicitly, and a pipeline schedule's loss function
reads it while the schedule runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dufu.engine.batch import count_loss_targets, local_scalar


class GlobalBatchLoss:
    """Bound to one :class:`~dufu.engine.runtime.Runtime` (its dims, device, groups, fp16 loss scaler and
    teacher); ``stage_loss_fn``: the model's ``pipeline_loss`` (a pipeline's last stage computes the loss from
    its output and the labels)."""

    def __init__(self, runtime, stage_loss_fn):
        self.runtime, self.stage_loss_fn = runtime, stage_loss_fn
        self.teacher = None  # set once the runtime has built it: distillation changes the stage loss
        self.global_targets = None  # set by begin(); None outside a batch

    def begin(self, batches: list[dict]) -> torch.Tensor:
        """Count the targets of the global batch whose local part is ``batches`` (micro-batches of this rank):
        summed over data-parallel ranks (tensor and pipeline peers hold the same samples; with context
        parallelism each rank counts its chunks' targets). Returns the count it keeps for :meth:`weight`: a
        float64 tensor on the device (at least 1), never read on the host (:mod:`dufu.engine.host_reads`)."""
        rt = self.runtime
        n = sum(count_loss_targets(b).to(rt.device, torch.float64) for b in batches)
        if rt.dims.data_axis_size > 1:
            dist.all_reduce(n, group=rt.data_group())
        self.global_targets = n.clamp(min=1.0)
        return self.global_targets

    def weight(self, inputs: dict) -> torch.Tensor:
        """The weight of a micro-batch's mean loss (module docstring), a float64 tensor on the device."""
        if self.global_targets is None:
            raise RuntimeError("GlobalBatchLoss.begin() must count the global batch before a micro-batch is weighted")
        count = count_loss_targets(inputs).to(self.global_targets.device, torch.float64)
        return count * self.runtime.dims.data_axis_size / self.global_targets

    def weighted(self, loss: torch.Tensor, inputs: dict) -> torch.Tensor:
        """``loss`` x :meth:`weight`. A micro-batch without targets (a context-parallel chunk of prompt or
        padding, whose mean loss is 0 / 0 = nan) adds 0 and a zero gradient, not nan x 0: decided on the device
        (``torch.where`` passes no gradient to the branch it does not take)."""
        weight = self.weight(inputs)
        return torch.where(weight > 0, loss * weight.to(loss.dtype), torch.zeros_like(loss))

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (a no-op without fp16) for its backward."""
        scaler = self.runtime.scaler
        return loss * scaler.scale if scaler is not None else loss

    def pipeline_loss(self, output, target):
        """The loss function a pipeline schedule calls on its last stage for each micro-batch. The schedule divides
        each micro-batch's loss by their number; the weight makes the sum the mean over the global batch's
        targets. The schedule runs backward itself, so fp16 loss scaling happens here (undone for logging by
        :meth:`unscaled_mean`). Distillation: the target carries the teacher's logits."""
        if self.teacher:
            loss, target = self.teacher.stage_loss(output, target)
        else:
            loss = self.stage_loss_fn(output, target)
        loss = self.weighted(loss, {"labels": target}) * self.runtime.num_accumulation_steps
        return self.scaled(loss)

    def unscaled_mean(self, losses: list) -> torch.Tensor:
        """The mean of a schedule's micro-batch losses, without the fp16 loss scale :meth:`pipeline_loss` applied."""
        scaler = self.runtime.scaler
        return torch.stack([local_scalar(l) for l in losses]).mean() / (scaler.scale if scaler is not None else 1.0)

    def reduce(self, local: torch.Tensor) -> torch.Tensor:
        """The mean over the global batch from each rank's share: averaged over the data ranks of the last
        pipeline stage (tensor peers hold the same value, and are divided out). A tensor on the device: the
        loop reads it once per log period (:class:`dufu.engine.step_stats.StepStats`)."""
        rt = self.runtime
        if rt.world_size == 1:
            return local.float()
        share = local.float() * (1.0 if rt.parts.last else 0.0)
        share = share / (rt.dims.data_axis_size * rt.dims.tensor_parallel_size)
        dist.all_reduce(share)
        return share
