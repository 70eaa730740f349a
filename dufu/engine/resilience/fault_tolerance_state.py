"""What a live replica group hands to a (re)joining one through torchft's checkpoint transport, and how the
joining group takes it in (dufu.engine.resilience.fault_tolerance).

The state is this rank's own: its local shards of the weights and of the optimizer state (a DTensor travels as
its local tensor, since rank r of one group heals from rank r of another, which holds the same shard in the same
layout), the trainer's step, learning-rate schedule and position in the sample order. Tensors are not copied:
the sender's Manager keeps its optimizer from stepping until the transfer is over (``should_commit`` waits for
it), and forward and backward do not write weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(value):
    """``value`` with every DTensor replaced by its local tensor (nested dicts and lists)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


class TrainingState:
    """``save()`` and ``load(state)`` for ``Manager.register_state_dict_fn``. Both run in the quorum at a step's
    start, before the loop draws that step's samples, so the sample position saved and loaded is the step's own.
    After a load the replica groups' ``healed_at`` holds the step this group jumped from."""

    def __init__(self, trainer, groups):
        self.trainer, self.groups = trainer, groups

    def save(self) -> dict:
        t = self.trainer
        return {
            "model": [_local(part.state_dict()) for part in t.model_parts],
            "optimizers": [_local(opt.state_dict()) for opt in t.optimizers],
            # The step count: the trainer's loop adds one once the step in progress is done.
            "step": t.step,
            "consumed_samples": t.sampler.consumed_samples,
            "rng_cpu": torch.get_rng_state(),
        }

    @torch.no_grad()
    def load(self, state: dict) -> None:
        t = self.trainer
        for part, saved in zip(t.model_parts, state["model"]):
            for name, value in part.state_dict().items():
                (value.to_local() if isinstance(value, DTensor) else value).copy_(saved[name])
        for opt, saved in zip(t.optimizers, state["optimizers"]):
            opt.load_state_dict(self._as_params(opt, saved))
        self.groups.healed_at = t.step
        t.step = int(state["step"])
        t.set_schedule_step(t.step)
        t.sampler.consumed_samples = int(state["consumed_samples"])
        torch.set_rng_state(state["rng_cpu"])

    @staticmethod
    def _as_params(opt, saved: dict) -> dict:
        """Local optimizer-state tensors back into DTensors shaped like their parameters (FSDP2's state)."""
        params = [p for group in opt.param_groups for p in group["params"]]
        state = {}
        for index, entries in saved["state"].items():
            p = params[int(index)]
            if isinstance(p, DTensor):
                # (the transport delivers CPU tensors; the shard lives where the parameter's does)
                entries = {k: (DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements,
                                                  shape=p.shape, stride=p.stride())
                               if torch.is_tensor(v) and v.shape == p.to_local().shape and v.dim() > 0 else v)
                           for k, v in entries.items()}
            state[index] = entries
        return {"state": state, "param_groups": saved["param_groups"]}
