"""Gradient utilities that are correct in every layout.

``clip_grad_norm_`` computes the global L2 norm over parameters that may be
plain tensors (replicated), DTensors on different meshes (tensor parallel,
FSDP) and split across pipeline stages, counting a tied parameter that lives
on two stages once; then scales all gradients with torch's
``clip_grads_with_norm_``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.models.base import contract_of
from dufu.parallel import env


def tied_parameters(modules) -> tuple[list, list]:
    """(copies, all tied) parameters of the model parts, looked up by name *after* parallelization
    (TP and FSDP replace parameter objects, so they cannot carry flags). Sources come before copies."""
    copies, sources = [], []
    for m in modules:
        for name, role in contract_of(m).tied_parameter_role.items():
            p = m.get_parameter(name)
            (copies if role == "copy" else sources).append(p)
    return copies, sources + copies


def _unique_grads(parameters) -> list[torch.Tensor]:
    seen, grads = set(), []
    for p in parameters:
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        grads.append(p)
    return grads


def total_grad_norm(parameters, pp_group=None, skip=()) -> torch.Tensor:
    params = _unique_grads(parameters)
    skip_ids = {id(p) for p in skip}
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if id(p) in skip_ids:
            continue  # the same gradient is counted on the stage that owns the embedding
        g = p.grad
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else ("local", g.device)
        groups.setdefault(key, []).append(g)
    device = params[0].grad.device if params else None
    if device is None or device.type == "meta":
        # No real gradient to take the device from (a stage whose parameters got none): the sum still has
        # to join the reductions below, so it lives where the pipeline group reduces (CUDA under NCCL).
        device = env.collective_device(pp_group)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=None)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = sq + norm.float().to(sq.device) ** 2
    if pp_group is not None:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Replicated gradients (data parallelism without ZeRO) are normed without a collective, so a
        # non-finite gradient on one rank only (a faulty device, a bad kernel) would be seen by that rank
        # alone: it would stop or skip the update while the others step on (hang, or diverged replicas).
        # One flag, reduced over all ranks, makes the verdict the same everywhere.
        # Decided on the device (no host read: dufu.engine.step_stats).
        bad = (~torch.isfinite(sq)).to(torch.float32).reshape(1)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        sq = torch.where(bad.reshape(()) > 0, torch.full_like(sq, float("nan")), sq)
    return sq.sqrt()


def scale_grads_(parameters, factor) -> None:
    """Multiply every gradient by ``factor`` (a number, or a 0-dim tensor on the gradients' device) in place
    (grouped so plain tensors and DTensors never mix)."""
    groups: dict = {}
    for p in _unique_grads(parameters):
        key = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else ("local", p.grad.device)
        groups.setdefault(key, []).append(p.grad)
    for grads in groups.values():
        torch._foreach_mul_(grads, factor)


def clip_grad_norm_(parameters, max_norm: float | None, pp_group=None, skip=(), grad_scale: float = 1.0) -> torch.Tensor:
    """Unscale (by ``grad_scale``, the fp16 loss scale) and clip to ``max_norm`` in one pass.

    Returns the total norm of the unscaled gradients before clipping (a 0-dim tensor on the device: nothing is
    read on the host); when it is not finite the gradients are left untouched (the caller skips the step).
    ``skip``: parameters left out of the norm (a tied copy whose twin is counted on another stage). None or inf
    ``max_norm``: no clipping. The clip coefficient is torch's (``clip_grads_with_norm_``): ``max_norm / (norm +
    1e-6)`` clamped to 1, computed on the device.
    """
    parameters = list(parameters)
    total = total_grad_norm(parameters, pp_group, skip) / grad_scale
    clipping = max_norm is not None and math.isfinite(max_norm)
    if not clipping and grad_scale == 1.0:
        return total
    factor = torch.full_like(total, 1.0 / grad_scale)
    if clipping:
        factor = factor * torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # a non-finite norm leaves the gradients as they are (the step is skipped or the run stops)
    factor = torch.where(torch.isfinite(total), factor, torch.ones_like(factor))
    scale_grads_(parameters, factor)
    return total


def sync_tied_gradients(tied, group) -> None:
    """Sum the gradients of a tied parameter's copies.

    With a ``group`` the copies live on two pipeline stages (Megatron's embedding group): each rank's
    gradient becomes the sum over the group. Without one, every tied parameter is on this rank (a head that
    holds a sharded copy of the embedding in its own FSDP unit, :mod:`dufu.parallel.data_parallel`): the
    first (the source, see :func:`tied_parameters`) gets the sum of all their gradients and the copies'
    gradients are dropped, so the optimizer updates the source only and the copy follows its values."""
    if group is None:
        _sum_into_source(list(tied))
        return
    for p in tied:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            if p.grad.placements != p.placements:
                # e.g. an embedding's gradient comes out replicated while its table is vocab-sharded:
                # bring both stages' copies to the parameter's own layout so the local shards match.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            g = p.grad.to_local()
        else:
            g = p.grad
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)


@torch.no_grad()
def _sum_into_source(tied: list) -> None:
    if len(tied) < 2:
        return
    source, copies = tied[0], tied[1:]
    for c in copies:
        if c.grad is None:
            continue
        if source.grad is None:
            source.grad = c.grad
        elif isinstance(c.grad, DTensor):
            if (c.grad.device_mesh, c.grad.placements, c.grad.shape) != (
                    source.grad.device_mesh, source.grad.placements, source.grad.shape):
                raise RuntimeError(
                    f"a tied copy's gradient {tuple(c.grad.shape)} {c.grad.placements} is laid out unlike its "
                    f"source's {tuple(source.grad.shape)} {source.grad.placements}; the shards cannot be added "
                    "locally. Both must be sharded alike (dufu.parallel.data_parallel makes them so).")
            source.grad.to_local().add_(c.grad.to_local())
        else:
            source.grad.add_(c.grad)
        c.grad = None
