"""Auxiliary-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2; Wang et al. 2024): after each
optimizer step, every MoE layer built with ``bias_update_rate`` > 0 moves its expert-choice bias by
``bias_update_rate x sign(mean load - load_i)`` (:meth:`dufu.layers.moe.MoE.update_score_bias`).

``load_i`` is the number of token assignments expert ``i`` received in the whole step: every micro-batch of this
rank (the step's counts :class:`~dufu.engine.moe_monitor.MoEMonitor` takes from the layers, the one place that
pops them), summed over the ``data`` axis of the mesh, which holds the data-parallel and context-parallel ranks
and the expert-parallel ranks carved out of them. Every replica therefore computes the same update from the same
numbers and keeps an identical bias, as a single process training on the whole global batch would:

* under expert parallelism a rank counts its own tokens' routing, before the all-to-all sends them away
  (:mod:`dufu.parallel.expert_parallel`), so each assignment is counted once, on the rank of its token;
* tensor-parallel peers route the same tokens (the MoE layer is replicated, :mod:`dufu.layers.moe`): each
  reduces over its own data group and none is counted twice;
* under pipeline parallelism each stage updates its own layers, over its own data group;
* a step whose update the loop skipped (non-finite gradients, an fp16 overflow) leaves the bias as it was:
  the update is multiplied by ``isfinite(grad_norm)`` on the device, without a host read.

torchtitan does the same in an optimizer pre-step hook (``tokens_per_expert`` summed over the step and the dp x
cp mesh); it also subtracts the mean of the update, which the paper does not: dufu follows the paper. The bias
is a persistent buffer of the layer, so checkpoints save it and a resumed run continues from it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dufu.engine.hooks import Hook
from dufu.engine.moe_monitor import MoEMonitor
from dufu.errors import ConfigError
from dufu.layers.moe import MoE
from dufu.parallel.env import collective_device


def balanced_layers(model_parts) -> dict[str, MoE]:
    """The MoE layers of these parts whose bias moves (``bias_update_rate`` > 0), by name."""
    return {n: m for part in model_parts for n, m in part.named_modules()
            if isinstance(m, MoE) and m.bias_update_rate > 0}


def load_balance(trainer) -> Optional["LoadBalance"]:
    """The trainer's :class:`LoadBalance` hook when some MoE layer it trains has ``bias_update_rate`` > 0,
    else None."""
    rt = trainer.runtime
    if not balanced_layers(rt.model_parts):
        return None
    if trainer.cfg.train.fault_tolerance.enabled:
        raise ConfigError(
            "auxiliary-loss-free balancing (a MoE layer's bias_update_rate > 0) with train.fault_tolerance: each "
            "replica group would count only its own tokens and the groups' biases would drift apart. Set the "
            "layers' bias_update_rate=0 (the sequence-wise or load-balancing loss balances through the "
            "gradients, which the groups average), or train.fault_tolerance.enabled=False")
    return LoadBalance(rt.moe)


class LoadBalance(Hook):
    """The update of the module docstring, after each optimizer step. ``monitor``: the run's
    :class:`~dufu.engine.moe_monitor.MoEMonitor`, whose ``step_counts`` (taken after the backward) it reads."""

    def __init__(self, monitor: MoEMonitor):
        self.monitor = monitor

    def after_optimizer(self, trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        rt = trainer.runtime
        layers = balanced_layers(rt.model_parts)
        if not layers:
            return
        names = sorted(layers)  # the same order on every rank of the group (it holds the same stage)
        device = collective_device()
        experts = max(m.num_experts for m in layers.values())
        loads = torch.zeros(len(names), experts, dtype=torch.long, device=device)  # (L, E)
        for i, name in enumerate(names):
            counts = self.monitor.step_counts.get(name)
            if counts is not None:  # no forward this step: zeros, and the bias does not move
                loads[i, :counts.numel()] = counts.to(device)
        group = rt.data_group()
        if group is not None:
            dist.all_reduce(loads, group=group)  # integers: the same sum on every rank, in any order
        taken = torch.isfinite(grad_norm).to(torch.float32)
        for i, name in enumerate(names):
            m = layers[name]
            m.update_score_bias(loads[i, :m.num_experts], scale=taken.to(m.score_bias.device))
