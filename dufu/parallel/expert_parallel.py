"""Expert parallelism: the experts of every MoE layer split over an axis carved out of data parallelism.

Megatron-core and torchtitan carve expert parallelism out of data parallelism, and so does dufu: the world
stays dp x tp x pp, and the ``data`` axis of ``dp`` ranks is seen as ``expert_data`` x ``expert``
(``dp / ep`` x ``ep``, ``expert`` inner, so an expert group is ``ep`` neighbouring data-parallel ranks)::

    dp 4, ep 2:   data ranks 0 1 2 3      expert groups [0,1] [2,3]      expert_data groups [0,2] [1,3]

* **Experts** (every :class:`dufu.layers.moe.GroupedExperts`) become DTensors ``Shard(0)`` on the ``expert``
  axis: rank ``e`` of a group holds experts ``e x E/ep ... (e+1) x E/ep - 1``. Being DTensors, they are
  initialised like one device's (:mod:`dufu.parallel.materialize`), their norm is the global one
  (:mod:`dufu.parallel.grads`) and checkpoints reshard across expert-parallel sizes (DCP).
* **Tokens travel by all-to-all** around the experts module only (:class:`ExpertDispatch`): every rank routes
  its own tokens (the router is replicated), sends each token copy to the rank holding its expert
  (``all_to_all_single``, uneven splits, differentiable), the local experts run, and the outputs come back by
  the reverse all-to-all. Token counts are exchanged first (a fixed-size all-to-all of E integers); the rows
  sent to and received from each peer are then read on the host as one tensor, once per layer and forward (the
  all-to-all takes its split sizes as Python ints; a recomputation reads again): the layer's only read of the
  counts, the experts reading none where torch has a grouped GEMM (:mod:`dufu.layers.moe`).
* **Gradients**: an expert's gradient already sums over the ``ep`` ranks whose tokens it served; the
  data-parallel reduction of expert parameters runs over ``expert_data`` only (FSDP2 or ``replicate`` on that
  axis, applied before the blocks' own units, which then leave the experts out) and averages over its
  ``dp / ep`` ranks, so the experts' gradients also need a factor ``1 / ep`` to equal one device's. The
  dispatch applies it in backward, to the experts' output gradient, and undoes it on the token gradients going
  back (:class:`ScaleGrad`), so only the expert weights see it. (FSDP2's ``set_gradient_divide_factor`` would
  say this directly, but torch 2.13 divides twice by it when the shard group has one rank: ``replicate``,
  and ZeRO with ``dp == ep``.) Everything else reduces over ``data``.
* **ZeRO** shards the experts over ``expert_data`` and every other parameter over ``data``: torchtitan's layout.
* **Tensor parallelism**: the MoE layer is replicated on the tensor-parallel ranks (see :mod:`dufu.layers.moe`),
  each of which runs the same all-to-all within its own expert group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from dufu.errors import LayoutError
from dufu.parallel.data_parallel import InPlaceReduceScatter, _allow_bare_copies


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (name, module) of every experts module that declares the expert-parallel style."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "expert_parallel", False)]


def check_experts_divisible(model: nn.Module, ep: int) -> None:
    """A clear error when some MoE layer's experts do not split evenly over ``ep`` ranks."""
    for name, m in expert_modules(model):
        if m.num_experts % ep:
            valid = [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]
            raise LayoutError(
                f"train.dist.expert_parallel_size = {ep} does not divide the {m.num_experts} experts of {name}: "
                f"{m.num_experts} / {ep} = {m.num_experts / ep:g} experts per rank. Use an expert-parallel size "
                f"among {valid} that divides train.dist.data_parallel_size.")


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class ExpertDispatch:
    """Before the experts: send each token copy to the rank of its expert; after: bring the outputs back.

    The experts module receives its tokens sorted by (global) expert with the count of each. Chunk ``r`` of that
    order (experts ``r x E/ep ...``) goes to expert rank ``r``; a rank receives, from every peer in turn, that
    peer's tokens for each of its local experts, and reorders them expert-major for its experts."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep
        self._saved: list[tuple] = []

    def dispatch(self, module, inputs, mesh):
        x, counts = inputs  # (n, H) sorted by expert, (E,)
        x = ScaleGrad.apply(x, float(self.ep))  # undoes, for the tokens, the 1 / ep of combine (docstring)
        local = counts.numel() // self.ep
        received = torch.empty_like(counts)  # (ep x local,): from each peer, its counts for my experts
        dist.all_to_all_single(received, counts, group=self.group)
        recv_blocks = received.view(self.ep, local)  # (peer, local expert)
        # The one host read of the layer: the all-to-all takes its split sizes as Python ints. The rows sent to
        # and received from each peer are read together, one (2, ep) tensor, one synchronisation per dispatch.
        split_sizes = torch.stack([counts.view(self.ep, local).sum(1), recv_blocks.sum(1)])  # (2, ep)
        send, recv = split_sizes.tolist()
        y = all_to_all_single_autograd(x, recv, send, self.group)  # (m, H): peer-major, then expert
        # Peer-major -> expert-major: the start of each (peer, expert) block, then its rows in expert order.
        sizes = recv_blocks.flatten()
        starts = (sizes.cumsum(0) - sizes).view(self.ep, local).t().flatten()  # expert-major blocks
        lengths = recv_blocks.t().flatten()
        # output_size: the rows received, known from the read above (repeat_interleave would read it again on a GPU)
        block_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths,
                                               output_size=sum(recv))
        first_row = lengths.cumsum(0) - lengths
        order = starts[block_of_row] + torch.arange(block_of_row.numel(), device=x.device) - first_row[block_of_row]
        self._saved.append((order, send, recv))
        return y.index_select(0, order), recv_blocks.sum(0)

    def combine(self, module, out, mesh):
        order, send, recv = self._saved.pop()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = ScaleGrad.apply(out, 1.0 / self.ep)  # the experts' gradients: summed over ep, averaged over dp / ep
        return all_to_all_single_autograd(out.index_select(0, inverse), send, recv, self.group)


def selective_checkpoint_notice(dist_cfg, checkpoint_cfg) -> str:
    """The start-up notice for selective activation checkpointing under expert parallelism (see parallelize)."""
    if dist_cfg.expert_parallel_size > 1 and checkpoint_cfg.enabled and checkpoint_cfg.mode == "selective":
        return ("activation checkpointing: blocks with a MoE layer are checkpointed in full, not selectively, "
                "under expert parallelism (the experts' data-parallel unit inside the block records profiler "
                "ranges torch's selective checkpointing cannot replay); the other blocks stay selective")
    return ""


def apply_expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Split every experts module of ``model`` over the 1-D ``ep_mesh`` (the ``expert`` axis), in place."""
    ep = ep_mesh.size()
    check_experts_divisible(model, ep)
    group = ep_mesh.get_group()

    def partition(name, module, mesh):
        for n, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(n, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]), p.requires_grad))

    for _, experts in expert_modules(model):
        comm = ExpertDispatch(group, ep)
        distribute_module(experts, ep_mesh, partition, input_fn=comm.dispatch, output_fn=comm.combine)
    return model


def apply_expert_data_parallel(model: nn.Module, expert_data_mesh, zero_stage,
                               mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """The data-parallel units of the experts on ``expert_data`` (before the blocks' units, which then leave them
    out); see the module docstring. ``mp_policy``: FSDP2's mixed precision for those units (None: FSDP2's
    default, fp32)."""
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for _, experts in expert_modules(model):
        if zero_stage:
            fully_shard(experts, mesh=expert_data_mesh, reshard_after_forward=zero_stage >= 3, **kwargs)
        else:
            replicate(experts, mesh=expert_data_mesh, **kwargs)
        _allow_bare_copies([experts])  # it owns its parameters: materialize_ copies it bare
        if zero_stage and dist.get_backend(expert_data_mesh.get_group()) == "gloo":
            experts.set_custom_reduce_scatter(InPlaceReduceScatter())
