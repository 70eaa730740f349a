"""Mixture-of-experts layers in the traced step: the routing the planner assumes, and expert parallelism.

A MoE layer's shapes depend on its data: :class:`dufu.layers.moe.MoE` counts the tokens each expert gets
(``bincount``) and its experts loop over ``counts.tolist()``; with a capacity, the dropped assignments are left
out by a boolean mask. Fake tensors have no values, so the trace answers those three questions itself, with
**balanced routing**: ``n`` assignments over ``E`` experts give each ``n / E`` (the first ``n mod E`` one
more), and a capacity keeps ``min(load, capacity)`` of each. That is the load the auxiliary load-balancing loss
trains towards (Switch, Fedus et al. 2021); a run whose router is unbalanced is slower by its busiest expert
(and, under expert parallelism, its busiest rank), which the planner does not predict. Every expert therefore
multiplies ``top_k / E`` of the tokens: the traced FLOPs are the active parameters', as
:func:`dufu.engine.reporting.flops.count_matmul_params` counts them for MFU, while every expert's weights, gradients and
optimizer states are held.

Under expert parallelism (``ep``, :mod:`dufu.parallel.expert_parallel`) the trace is that of one rank: its
experts modules hold ``E / ep`` experts (weights of that shape), and around each the token exchange of
:class:`dufu.parallel.expert_parallel.ExpertDispatch` is stood in for by what it allocates and computes: the
received tokens (a new buffer, and a new one for their gradient in backward), their reordering expert-major
(``index_select``), the same on the way back, and the ``1 / ep`` gradient scaling. Balanced, a rank receives as
many token copies as it sends (``tokens x top_k``), spread evenly over its experts, so each local expert
multiplies ``ep`` times the tokens of an expert without expert parallelism: larger matrix multiplies, and
``1 / ep`` of the loop's ops. The exchanges themselves are priced by :func:`dufu.plan.comm.ep_comm` from the
bytes recorded here (:class:`dufu.plan.shapes.ExpertsCall`).

The trace's recorder applies all of this through :class:`MoERecording`, its part for MoE layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dufu.parallel import expert_parallel

# Small ops ExpertDispatch runs besides the ones stood in for here, counted off dufu.parallel.expert_parallel:
# the dispatch's sums of the counts, the expert-major order (cumulative sums, repeat_interleave, index
# arithmetic); the combine's inverse order. Each costs a dispatch (host time).
DISPATCH_BOOKKEEPING_OPS = 18
COMBINE_BOOKKEEPING_OPS = 3
# Bytes of one expert's token count in the counts exchange (int64).
COUNT_BYTES = 8


def balanced(n: int, groups: int) -> list[int]:
    """``n`` assignments spread over ``groups`` experts as evenly as possible (the first ``n mod groups`` get one
    more)."""
    base, extra = divmod(int(n), int(groups))
    return [base + (1 if i < extra else 0) for i in range(groups)]


def kept_assignments(moe, n: int) -> int:
    """Assignments a MoE layer keeps of ``n`` under balanced routing: all when dropless, else at most its
    capacity per expert (:meth:`dufu.layers.moe.MoE._keep`)."""
    if getattr(moe, "capacity_factor", None) is None:
        return int(n)
    capacity = math.ceil(moe.capacity_factor * n / moe.num_experts)
    return sum(min(load, capacity) for load in balanced(n, moe.num_experts))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules (those that declare the expert-parallel style) of ``model``."""
    return [m for _, m in expert_parallel.expert_modules(model)]


def localize(model: nn.Module, ep: int) -> None:
    """Give every experts module of a fake model the weights of one expert-parallel rank: ``E / ep`` experts
    (dim 0 of each grouped weight), as ``Shard(0)`` leaves them."""
    if ep <= 1:
        return
    for module in expert_modules(model):
        for name, p in list(module.named_parameters(recurse=False)):
            shape = (p.shape[0] // ep,) + tuple(p.shape[1:])
            module._parameters[name] = nn.Parameter(p.new_empty(shape), requires_grad=p.requires_grad)


class _Exchange(torch.autograd.Function):
    """Stands in for a differentiable all-to-all of a balanced exchange: a new buffer of the input's shape in
    forward, and one of the gradient's in backward (the bytes moved are priced apart)."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)


def dispatch(x: torch.Tensor, ep: int) -> torch.Tensor:
    """What :meth:`ExpertDispatch.dispatch` does to a rank's sorted token copies ``x`` (n, H), balanced: the
    received copies, reordered expert-major."""
    x = expert_parallel.ScaleGrad.apply(x, float(ep))
    y = _Exchange.apply(x)  # (n, H): peer-major
    order = torch.arange(y.shape[0], device=y.device)
    return y.index_select(0, order)  # (n, H): expert-major


def combine(out: torch.Tensor, ep: int) -> torch.Tensor:
    """What :meth:`ExpertDispatch.combine` does to the local experts' outputs (n, H): back to peer-major order,
    then to the ranks the tokens came from."""
    inverse = torch.arange(out.shape[0], device=out.device)
    out = expert_parallel.ScaleGrad.apply(out, 1.0 / ep)
    return _Exchange.apply(out.index_select(0, inverse))


class MoERecording:
    """The part of :class:`dufu.plan.recorder.Recorder` that traces mixture-of-experts layers: the token counts a
    MoE layer reads (:func:`balanced`), the assignments its capacity keeps (:func:`kept_assignments`), and around
    every experts module the bytes an expert-parallel exchange moves and, under expert parallelism, the exchange's
    stand-in (:func:`dispatch`, :func:`combine`). It works on the recorder's ``ep``, ``values``, ``moe_stack`` and
    ``experts_calls``, its current ``part`` and ``phase``, and its ``_part_ops`` and ``record``."""

    def counts(self, n: int, groups: int) -> torch.Tensor:
        """A (groups,) token-count tensor whose values (``n`` balanced over ``groups``) reads of it return."""
        out = torch.empty(groups, dtype=torch.long)
        self.values[out.untyped_storage()._cdata] = balanced(n, groups)
        return out

    def _enter_moe(self, module, args) -> None:
        self.moe_stack.append(module)

    def _leave_moe(self, module, args, output) -> None:
        self.moe_stack.pop()

    def _experts_in(self, module, args):
        x, counts = args
        self.experts_calls.append(dict(part=self.part, in_bytes=x.numel() * x.element_size(), out_bytes=0,
                                       num_experts=module.num_experts, recomputed=self.phase != "fwd"))
        if self.ep <= 1:
            return None
        self._part_ops().ops += DISPATCH_BOOKKEEPING_OPS
        x = dispatch(x, self.ep)
        return x, self.counts(x.shape[0], module.num_experts // self.ep)

    def _experts_out(self, module, args, out):
        self.experts_calls[-1]["out_bytes"] = out.numel() * out.element_size()
        if self.ep <= 1:
            return None
        self._part_ops().ops += COMBINE_BOOKKEEPING_OPS
        return combine(out, self.ep)

    def _data_dependent(self, func, args, kwargs):
        """The result of an op whose output depends on values a fake tensor lacks, under balanced routing; None
        for every other op."""
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            t = args[0]
            values = self.values.get(t.untyped_storage()._cdata)
            if values is not None:
                return values[t.storage_offset()]
            return None
        if func is aten.bincount.default:
            x = args[0]
            weights = args[1] if len(args) > 1 else kwargs.get("weights")
            length = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if weights is None and length > 0:
                out = self.counts(x.numel(), length)  # the token counts of a MoE layer's experts
                self.record(func, args, kwargs, out)
                return out
            return None
        if func is aten.index.Tensor and self.moe_stack:
            x, indices = args[0], args[1]
            if len(indices) == 1 and indices[0] is not None and indices[0].dtype == torch.bool:
                mask = indices[0]  # the assignments within capacity (MoE._keep)
                kept = kept_assignments(self.moe_stack[-1], mask.numel())
                out = torch.empty((kept,) + tuple(x.shape[mask.dim():]), dtype=x.dtype)
                self.record(func, args, kwargs, out)
                return out
        return None
