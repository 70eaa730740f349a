"""Data parallelism and ZeRO on FSDP2.

=========================  ==================================================================
train config               what runs
=========================  ==================================================================
dp > 1, ZeRO off           ``replicate`` (DDP on the FSDP2 runtime): parameters replicated,
                           gradients all-reduced (averaged) after backward
ZeRO stage 1 and 2         ``fully_shard``, blocks with ``reshard_after_forward=False``:
                           optimizer state and gradients sharded (reduce-scatter), each block's
                           parameters gathered once per step and kept until its backward
ZeRO stage 3               ``fully_shard``, blocks with ``reshard_after_forward=True``: each
                           block's parameters also freed after forward, gathered again for backward
=========================  ==================================================================

**ZeRO-1 runs with stage-2 sharding: same communication, less memory.** ZeRO-1 (Rajbhandari et al. 2020)
all-reduces full gradients and shards only the optimizer state. FSDP2 has no such mode: it always
reduce-scatters gradients into shards. A reduce-scatter plus the next step's all-gather is one all-reduce,
so stage 2 sends what ZeRO-1 (and DDP) send, and it holds 4/dp instead of 4 bytes of gradient per
parameter. A separate ZeRO-1 (``torch.distributed.optim.ZeroRedundancyOptimizer``) would be strictly
worse here: more gradient memory for the same traffic, and it partitions whole parameters by rank and
broadcasts them, which fits neither tensor-parallel DTensor parameters nor the optimizer the trainer builds
from the config. So stage 1 is accepted and run as stage 2 (:func:`describe_zero_stage` says so).

FSDP units under stage 3 (torchtitan's layout, read off the model's ``pipeline_layout``):

* every transformer block;
* the input embedding tables (``pipeline_layout["first"]`` modules that are ``nn.Embedding``): freed right
  after forward and never gathered in backward (FSDP2's ``set_unshard_in_backward(False)``): an
  embedding's backward scatters the output gradient into the table's gradient and needs only the indices;
* the output end (``pipeline_layout["last"]``: final norm and head): kept gathered from its forward to its
  backward, which follows at once;
* the root: whatever is left (e.g. BERT's embedding LayerNorm, a model without ``pipeline_layout``).

Under stages 1 and 2 the units are the blocks and the root (embeddings, final norm and head, a tied head
sharing the embedding's parameter): every block stays gathered from its forward to its backward there, and a
head unit of its own would reduce its gradient at the start of backward, on top of all of them.

On gloo (CPU), gradients are reduce-scattered by :class:`InPlaceReduceScatter`.

**Hybrid sharding (HSDP)**, ``train.dist.data_parallel_replicate_size`` R > 1: the same units on a 2-D mesh
("dp_replicate", "dp_shard") of the data axis (:meth:`dufu.parallel.parallel_dims.ParallelDims.build_world`),
FSDP2's own HSDP: each unit is sharded over the dp / R x cp ranks of its replica and gathered from them only, and
after the reduce-scatter inside a replica the gradient shards are all-reduced across the R replicas; FSDP2 divides
by both sizes, so the gradient is the average over all dp x cp ranks, as without it (torchtitan's
dp_replicate x dp_shard). It applies to every ZeRO stage: stages 1 and 2 shard gradients and optimizer state
within a replica and keep the blocks gathered through the step (Megatron's distributed-optimizer instances), stage
3 also frees parameters after forward. Without ZeRO every rank already holds whole parameters: R > 1 is refused
there (:func:`dufu.parallel.checks.validate_layout`).

**Mixed precision** (:func:`mixed_precision_policy`, torchtitan's recipe on FSDP2's ``MixedPrecisionPolicy``): when
the run computes in bf16 or fp16 under autocast, every unit gathers its parameters in that dtype
(``train.amp.param_dtype``) and reduces its gradients in fp32 (``train.amp.reduce_dtype``). Each weight is cast
once per gather, on its shard, instead of by autocast in every forward, and the gathered copy is half the size;
autocast stays on, and its casts of these weights are no-ops. The sharded parameters stay fp32: they are the
optimizer's master weights, and gradients arrive on them in fp32. A unit's floating-point inputs are cast to the
compute dtype too (FSDP's ``cast_forward_inputs``), so the residual stream between blocks is bf16 / fp16, where
one process under autocast keeps it in fp32 (the parity tests' tolerances cover both): CPU's ``layer_norm`` takes
a bf16 input with fp32 weights but not an fp32 input with bf16 weights (CUDA's autocast runs norms in fp32
either way), and in a block every norm's weight is gathered in bf16.

Were the root to hold embeddings, head and final norm under stage 3, they would stay gathered from the first
forward op to the last backward op, and the tied embedding/head weight's two gradients would be summed in
full size until the end of backward. One parameter cannot live in two FSDP units, so a tied head
(``tied_parameter_names``) whose twin lands in another unit gets a *sharded copy* of the embedding's
weight, as a last pipeline stage does (Megatron's embedding group; :mod:`dufu.parallel.pipeline`). Here
both live on one rank with the same sharding, so the copy costs 4/dp bytes per table entry and no
communication: each unit reduce-scatters its own gradient as soon as its backward ends;
:func:`dufu.parallel.grads.sync_tied_gradients` adds the copy's gradient shard to the embedding's (the
optimizer updates the embedding only; the copy's gradient is dropped), and the copy takes the embedding's
values before every forward, every ``state_dict`` and whenever the model ties its weights
(:class:`TiedCopies`). Parameter names are unchanged, so checkpoints load across layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dufu.models.base import contract_of
from dufu.parallel.parallelize_utils import transformer_blocks


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARAM_DTYPES = ("auto", *DTYPES)
REDUCE_DTYPES = tuple(DTYPES)


def mixed_precision_policy(compute_dtype: torch.dtype | None, param_dtype: str = "auto",
                           reduce_dtype: str = "fp32") -> MixedPrecisionPolicy | None:
    """The policy of the FSDP units for a run computing in ``compute_dtype`` (None: fp32), gathering in
    ``param_dtype`` ("auto": the compute dtype) and reducing gradients in ``reduce_dtype``; None where both are
    fp32 (FSDP's default). Raises ValueError, saying what to write instead, for a gather dtype that is neither
    fp32 nor the compute dtype (autocast would cast the gathered weights again, rounding them twice) and for a
    reduction in a low-precision dtype the run does not compute in (fp16 gradients would overflow unscaled)."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"train.amp.param_dtype = {param_dtype!r} is not a dtype name; use one of {PARAM_DTYPES} "
                         "(e.g. train.amp.param_dtype=auto: the dtype the run computes in).")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"train.amp.reduce_dtype = {reduce_dtype!r} is not a dtype name; use one of "
                         f"{REDUCE_DTYPES} (e.g. train.amp.reduce_dtype=fp32).")
    compute = compute_dtype or torch.float32
    compute_name = next(n for n, d in DTYPES.items() if d == compute)
    param = compute if param_dtype == "auto" else DTYPES[param_dtype]
    reduce = DTYPES[reduce_dtype]
    if param not in (torch.float32, compute):
        raise ValueError(
            f"train.amp.param_dtype = {param_dtype!r}, but the run computes in {compute_name}: FSDP gathers the "
            f"parameters in fp32 or in the compute dtype. Use train.amp.param_dtype=auto (or fp32), or make the "
            f"run compute in {param_dtype} (train.amp.enabled={param_dtype}).")
    if reduce not in (torch.float32, compute):
        raise ValueError(
            f"train.amp.reduce_dtype = {reduce_dtype!r}, but the run computes in {compute_name}: gradients are "
            f"reduced in fp32 or in the compute dtype. Use train.amp.reduce_dtype=fp32.")
    if param == torch.float32 and reduce == torch.float32:
        return None
    # reduce_dtype None would reduce in param_dtype; inputs are cast to param_dtype (see the module docstring)
    return MixedPrecisionPolicy(param_dtype=None if param == torch.float32 else param, reduce_dtype=reduce)


def _policy_kwargs(mp_policy: MixedPrecisionPolicy | None) -> dict:
    return {} if mp_policy is None else {"mp_policy": mp_policy}


def describe_zero_stage(stage: int) -> str:
    """How a ZeRO stage is run, for the start-up summary."""
    if stage == 1:
        return "ZeRO stage 1 (run with stage-2 sharding: same communication, less memory)"
    return f"ZeRO stage {stage}"


def _present(model: nn.Module, names) -> list[nn.Module]:
    """The modules of ``names`` (dotted) that this model part holds and that have parameters."""
    found = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if module is not None and any(True for _ in module.parameters()):
            found.append(module)
    return found


def _is_plain_embedding(module: nn.Module) -> bool:
    """An embedding whose backward needs only the indices (not the table): dense, no max_norm renorm."""
    return isinstance(module, nn.Embedding) and not module.sparse and module.max_norm is None


def end_units(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(input embedding tables, output-end modules) that get FSDP units of their own; [] where absent."""
    layout = contract_of(model).pipeline_layout or {}
    embeddings = [m for m in _present(model, layout.get("first", ())) if _is_plain_embedding(m)]
    blocks = {id(p) for _, b in transformer_blocks(model) for p in b.parameters()}
    last = [m for m in _present(model, layout.get("last", ())) if not any(id(p) in blocks for p in m.parameters())]
    return embeddings, last


def _unit_of(model: nn.Module, name: str, units: list[list[nn.Module]]) -> int:
    """Index of the unit (in ``units``) holding the module that owns parameter ``name``; -1 for the root."""
    owner = model.get_submodule(name.rpartition(".")[0])
    for i, modules in enumerate(units):
        if any(owner is m or any(owner is s for s in m.modules()) for m in modules):
            return i
    return -1


class TiedCopies:
    """Tied weights of one model part held as sharded copies (``alias`` copies ``source``), see the module
    docstring. ``sync`` copies each source's local shard into its alias's: the same placements on the same
    mesh, so the local tensors correspond element for element."""

    def __init__(self, model: nn.Module, pairs: list[tuple[str, str]]):
        self.model, self.pairs = model, pairs

    @torch.no_grad()
    def sync(self, *unused) -> None:
        for alias, source in self.pairs:
            dst, src = self.model.get_parameter(alias), self.model.get_parameter(source)
            if isinstance(dst, DTensor) != isinstance(src, DTensor):
                # The copy's unit is gathered: a forward without gradients (evaluation) leaves a unit that is
                # not resharded after forward gathered until its next backward. It was gathered from a
                # copy synced at that forward, and no update can come before a backward reshards it.
                continue
            if isinstance(dst, DTensor):
                dst, src = dst.to_local(), src.to_local()
            if not dst.is_meta:
                dst.copy_(src)

    def before_forward(self, *unused) -> None:
        """Sync, and let the copies take gradients from now on (see :func:`untie_across_units`)."""
        for alias, source in self.pairs:
            self.model.get_parameter(alias).requires_grad_(self.model.get_parameter(source).requires_grad)
        self.sync()


def untie_across_units(model: nn.Module, units: list[list[nn.Module]]) -> list[tuple[str, str]]:
    """Give every tied parameter whose two users fall into different FSDP ``units`` a copy of its own (see the
    module docstring). Returns the (alias, source) pairs it untied."""
    pairs = []
    for alias, source in contract_of(model).tied_parameter_names.items():
        try:
            a, s = model.get_parameter(alias), model.get_parameter(source)
        except AttributeError:
            continue  # a pipeline stage holding one of the two (the pipeline keeps its own copy)
        if a is not s or _unit_of(model, alias, units) == _unit_of(model, source, units):
            continue
        module_name, _, leaf = alias.rpartition(".")
        # requires_grad stays off until the first forward (TiedCopies.sync turns it on): the optimizer, built
        # before, leaves the copy out, so a checkpoint of a tied layout (no optimizer state under the copy's
        # name) loads here and the copy never holds optimizer state.
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(s.detach().clone(), requires_grad=False))
        pairs.append((alias, source))
    if pairs:
        copies = TiedCopies(model, pairs)
        # Re-tying would assign the embedding's parameter to the head again (one parameter in two units):
        # within this part, tying means copying the values (materialize_ and pretrained loading call it).
        model.tie_weights = copies.sync
        model.register_state_dict_pre_hook(copies.sync)  # a checkpoint or export sees equal twins
        # Roles for dufu.parallel.grads: the copy's gradient shard is added to the source's after backward.
        model.tied_parameter_role = {**{s: "source" for _, s in pairs}, **{a: "copy" for a, _ in pairs}}
        model._dufu_tied_copies = copies
    return pairs


def _bare_new(cls, *args, **kwargs):
    return object.__new__(cls)


def _allow_bare_copies(modules: list[nn.Module]) -> None:
    """Let ``type(m).__new__(type(m))`` make a bare instance of FSDP-sharded modules that own parameters.

    :func:`dufu.parallel.materialize.materialize_` fills a module's own tensors through a bare copy made that
    way. FSDP2 gives a sharded module a class whose ``__new__`` runs the original constructor again (for
    indexing into containers), which fails without the constructor's arguments. Blocks and the root own no
    parameters directly, the end units' modules do; a bare ``__new__`` is what an ``nn.Module`` has. (Were
    ``_full_copy`` to build its copy with ``object.__new__``, this would not be needed.)"""
    for m in modules:
        cls = type(m)
        m.__class__ = type(cls.__name__, (cls,), {"__new__": _bare_new, "__module__": cls.__module__})


class InPlaceReduceScatter:
    """FSDP2's gradient reduce-scatter as one in-place ``all_reduce`` and a copy of this rank's chunk (the
    ``ReduceScatter`` interface of ``FSDPModule.set_custom_reduce_scatter``), used on gloo only.

    gloo's ``reduce_scatter_tensor`` stages a full-size copy of its input (measured on 2 and 4 ranks with a
    16 MiB input: +21.7 MiB above input and output, against +2 MiB for an in-place ``all_reduce``, which also
    took half the time). At the end of backward that copy comes on top of the largest unit's gradient and
    FSDP's reduce-scatter buffer. NCCL reduce-scatters without a copy and keeps FSDP's default."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        dist.all_reduce(input_tensor, op=op, group=group)
        # FSDP lays the input out as world-size chunks of the output's size, chunk r for rank r.
        chunk = input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        output_tensor.copy_(chunk.view_as(output_tensor))
        return None


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """ZeRO ``stage`` (1, 2 or 3) on ``dp_mesh`` with the units of the module docstring, each with ``mp_policy``
    (:func:`mixed_precision_policy`; None: gather and reduce in the parameters' dtype). ``dp_mesh``: the data axis
    (1-D: shard over all of it), or under hybrid sharding the 2-D ("dp_replicate", "dp_shard") mesh
    (:attr:`dufu.parallel.parallel_dims.World.fsdp_mesh`: replicate across its first axis, shard over its
    second)."""
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp shards over a 1-D data mesh or a 2-D (replicate, shard) mesh, got a "
                         f"{dp_mesh.ndim}-D mesh {dp_mesh.mesh_dim_names}")
    kwargs = {"mesh": dp_mesh, **_policy_kwargs(mp_policy)}
    # Under stages 1 and 2 every block stays gathered from its forward to its backward anyway; a head unit of
    # its own would reduce its gradient at the start of backward, on top of all of them (measured: +11 MiB at
    # dp2 on the benchmark's model), so the root keeps the embeddings, final norm and head there.
    embeddings, last = end_units(model) if stage >= 3 else ([], [])
    units = [u for u in (embeddings, last) if u]
    untie_across_units(model, units)
    for _, block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=stage >= 3, **kwargs)
    if embeddings:
        fully_shard(embeddings if len(embeddings) > 1 else embeddings[0], reshard_after_forward=True, **kwargs)
        embeddings[0].set_unshard_in_backward(False)
        _allow_bare_copies(embeddings)
    if last:
        # Used last in forward and first in backward: freeing it in between would only add an all-gather.
        fully_shard(last if len(last) > 1 else last[0], reshard_after_forward=False, **kwargs)
        _allow_bare_copies(last)
    # The root spans the whole forward and backward: its own parameters (if any) are needed at both ends.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    # the shard axis (the last): its reduce-scatter (the all-reduce across replicas is FSDP's own)
    if dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) == "gloo":
        comm = InPlaceReduceScatter()
        for unit in [b for _, b in transformer_blocks(model)] + embeddings[:1] + last[:1] + [model]:
            unit.set_custom_reduce_scatter(comm)
    copies = getattr(model, "_dufu_tied_copies", None)
    if copies is not None:
        # After FSDP's own root pre-forward hook (registered first, prepended): the copy is current before
        # its unit gathers it, also for evaluation and generation.
        model.register_forward_pre_hook(copies.before_forward)
    return model


def apply_replicate(model: nn.Module, dp_mesh, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Data parallelism without ZeRO on ``dp_mesh``, every unit with ``mp_policy`` (as :func:`apply_fsdp`)."""
    for _, block in transformer_blocks(model):
        replicate(block, mesh=dp_mesh, **_policy_kwargs(mp_policy))
    replicate(model, mesh=dp_mesh, **_policy_kwargs(mp_policy))
    return model
