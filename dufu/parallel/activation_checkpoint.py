"""Activation checkpointing per transformer block: recompute in the backward pass instead of keeping in memory.

Two modes (``apply_activation_checkpointing(model, mode=...)``):

* ``"full"`` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a block keeps only its
  inputs; the backward pass runs the block's forward again to rebuild everything else. Least memory (one
  hidden-state tensor per block), costs one more forward of every block (~1/3 more compute).
* ``"selective"`` (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models";
  PyTorch's selective checkpointing, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, as
  torchtitan's per-op selective mode uses it): a block keeps its inputs and the outputs of the expensive ops in
  :data:`SAVED_OPS` - matrix multiplies (every ``Linear``), fused attention kernels (``scaled_dot_product_
  attention``: output and log-sum-exp) and tensor-parallel collectives - and recomputes everything else
  in the backward pass: layer norms, activation functions (GELU's 4h-wide output), dropout masks (replayed from
  the saved RNG state), residual adds, autocast's casts of weights and activations, and the attention core of an
  unfused attention (``bmm`` scores, softmax, dropout: the (T, T) tensors Megatron's selective mode is about).
  Recomputation costs a few elementwise passes, no matmul and no communication.

What a GPT-2 block keeps for backward per token, in hidden-size units of fp32 values (h = hidden size; measured by
``benchmarks/activation_checkpoint.py``, results in ``benchmarks/results/activation_checkpoint-2026-11-25.md``):
none 16 h, selective 11 h (0.69x), full 1 h (0.06x); under bf16 autocast selective keeps 0.4-0.6x of none's
bytes, because it also drops autocast's bf16 copies of the weights and activations. With fused attention (SDPA,
what dufu uses) the (T, T) scores are never kept even without checkpointing, so Megatron's selective gain on the
attention core is already in the baseline; what selective mode adds is dropping the elementwise outputs - the
layer norms' (2 h), GELU's (4 h) and the attention output's re-layout (1 h) - while it keeps the outputs of the
two projections into the residual stream (2 h), which the recomputation starts from.

Both modes wrap each block's ``forward`` in non-reentrant ``torch.utils.checkpoint.checkpoint``: parameter
names and the module tree stay unchanged (checkpoints load with and without it), hooks that other transforms put
on the block (tensor parallelism's input/output layouts, FSDP's all-gathers) run outside the recomputed region,
and ``torch.compile`` of the block traces the checkpoint as one region whose saved/recomputed split follows the
same policy. Without autograd (evaluation, generation) the block runs directly.
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch
from torch import nn
# torch's private modules: torch has no public dispatch mode or pytree API
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dufu.parallel.parallelize_utils import transformer_blocks

MODES = ("full", "selective")


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of these aten ops, skipping any this torch build does not have."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


# Ops whose outputs selective checkpointing keeps: matmuls with weights (``Linear`` becomes addmm/mm; fp8 and
# grouped expert matmuls included) and the fused attention kernels (outputs plus log-sum-exp, O(T) per head).
# ``bmm``/``baddbmm`` are left out on purpose: in dufu they only appear in an unfused attention, where they
# produce the (T, T) scores that selective recomputation exists to drop (Korthikanti et al. 2022, section 4.1).
SAVED_OPS = _aten_ops(
    "mm", "addmm", "_scaled_mm", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
# Collectives (tensor/sequence parallelism's all-reduce, all-gather, reduce-scatter and their waits) are kept
# too: recomputing one would repeat the communication in the backward pass.
SAVED_NAMESPACES = frozenset({"_c10d_functional"})


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's decision for one op: keep the outputs of :data:`SAVED_OPS` and collectives,
    recompute the rest."""
    if func in SAVED_OPS or getattr(func, "namespace", None) in SAVED_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple:
    """A fresh pair of (forward, recompute) contexts for one checkpointed call (``checkpoint``'s ``context_fn``)."""
    return create_selective_checkpoint_contexts(selective_policy)


def _checkpointed_forward(self, *args, **kwargs):
    """A block's forward under checkpointing (bound to the block as its ``forward``; see module docstring)."""
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # nothing is saved for backward: evaluation and generation run as they are
        return forward(*args, **kwargs)
    context_fn = selective_context if self._dufu_checkpoint_mode == "selective" else None
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def checkpoint_mode(module: nn.Module) -> Optional[str]:
    """The mode a block was checkpointed with, or None."""
    return getattr(module, "_dufu_checkpoint_mode", None)


def check_mode(mode) -> None:
    """Raise ValueError saying what to write, for a mode that is not one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(map(repr, MODES))}; "
                         "set train.activation_checkpoint.mode to 'selective' (recompute elementwise ops, keep "
                         "matmul outputs) or 'full' (keep only each block's input)")


def checkpoint_block(block: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint one module in place: its ``forward`` becomes the checkpointed one (names unchanged)."""
    check_mode(mode)
    if checkpoint_mode(block) is not None:
        raise ValueError(f"{type(block).__name__} is already checkpointed (mode {checkpoint_mode(block)!r}); "
                         "apply activation checkpointing once")
    if "forward" in vars(block):
        raise ValueError(f"{type(block).__name__} has a forward set on the instance, which checkpointing would "
                         "replace; checkpoint the module before patching its forward")
    block._dufu_checkpoint_mode = mode
    # A method bound to the block (not a closure): a deep copy of the model rebinds it to the copy.
    block.forward = types.MethodType(_checkpointed_forward, block)
    return block


def apply_activation_checkpointing(model: nn.Module, mode: str = "full",
                                   blocks: Optional[Callable[[nn.Module], list]] = None) -> nn.Module:
    """Checkpoint every transformer block of ``model`` in ``mode`` ("full" or "selective", see the module
    docstring), in place. ``blocks`` finds the (name, module) pairs to checkpoint (default:
    :func:`dufu.parallel.parallelize_utils.transformer_blocks`, the entries that carry a ``layer_idx``).

    A model without transformer blocks is an error: checkpointing would silently do nothing."""
    found = (blocks or transformer_blocks)(model)
    if not found:
        raise ValueError(f"activation checkpointing found no transformer block in {type(model).__name__}: it "
                         "checkpoints the entries of a ModuleDict/ModuleList that carry a layer_idx. Give the "
                         "model's repeated layers a layer_idx, or set train.activation_checkpoint.enabled=False")
    for _, block in found:
        checkpoint_block(block, mode)
    return model


class LiveActivations:
    """Counts the storages created by ops under this context that are still alive when asked.

    Autograd's ``saved_tensors_hooks`` cannot measure checkpointing: a checkpointed region installs its own hooks
    (only its inputs reach an outer hook), and selective checkpointing keeps its saved outputs in a cache of its
    own. This context instead records every op's output storage (a ``TorchDispatchMode`` outermost, so it also
    sees the ops inside checkpointed regions) and, when asked, sums the unique storages that something besides
    this record still references (``torch._C._storage_Use_Count``): after a forward, exactly what is kept for
    the backward pass. Storages of ``exclude`` (parameters, inputs) do not count. Eager mode only: compiled
    code allocates without going through the dispatcher.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict = {}
        self._mode = None

    def __enter__(self):
        storages = self._storages

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if type(t) is torch.Tensor or isinstance(t, nn.Parameter):  # not subclasses (DTensor)
                        s = t.untyped_storage()
                        if s.nbytes():
                            storages.setdefault(s.data_ptr(), s)
                return out

        self._mode = _Record()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    def alive_bytes(self, exclude=()) -> int:
        skip = self._exclude | {t.untyped_storage().data_ptr() for t in exclude}
        return sum(s.nbytes() for ptr, s in self._storages.items()
                   if ptr not in skip and torch._C._storage_Use_Count(s._cdata) > 1)
