"""``dufu train CONFIG --dry-run --world-size N [--rank R]``: rehearse a big run's layout on one machine.

For each rank asked for, torch's fake process group (every collective returns at once) stands in for a world of
``N`` processes, one rank at a time in this one process, and dufu builds that rank's part of the run with the
code a real run uses: the start-up checks for ``N`` processes (:func:`dufu.engine.preflight.plan_run`, so a layout
dufu refuses fails here with its usual message, before any GPU is paid for), the device mesh
(:meth:`~dufu.parallel.parallel_dims.ParallelDims.build_world`), the pipeline split, tensor parallelism, FSDP2 or
``replicate``, expert placement (:func:`dufu.parallel.build.build_model_parts`), all on the meta device: a 70B
model costs no memory, and nothing is initialised.

What the rank holds is counted from its local shards' shapes and dtypes (``DTensor.to_local()``): parameters;
gradients, one per trained parameter in its dtype and sharding (FSDP2 keeps the shard, ``replicate`` the whole);
the optimizer's state, AdamW's two moments of what trains (Muon's one momentum buffer for its matrices, SGD's
one or none; the parameters are dufu's fp32 master weights:
autocast computes in low precision from them, so no further copy exists). Activations are not measured (a meta
step has no memory to measure): the planner's estimate for the rank is shown, labelled as such.

The collectives one step issues are derived from the parallelized module structure, not recorded from a run:
FSDP2's all-gather and reduce-scatter per unit (the unit's unsharded bytes), ``replicate``'s gradient all-reduce,
tensor parallelism's all-reduce (reduce-scatter / all-gather with sequence parallelism) per row- or column-split
linear and split embedding, from the activation shapes of one micro-batch; context parallelism's K/V all-gather and
reduce-scatter per attention layer; expert parallelism's all-to-all per MoE layer; the pipeline's send and receive
of a micro-batch's boundary activations. An activation-checkpointed block's recomputation repeats its forward
collectives; those repeats are not listed. Counts are per optimizer step (times the micro-batches where that applies).

The rank then **executes** one micro-batch's forward and backward (:func:`executed_collectives`): its parameters
materialised as fake tensors (shapes, no memory), the run's own data as inputs, the fake process group answering
at once; every collective torch dispatches is recorded with its group and bytes, beside the derived list, which
agrees with it (tests/plan/test_dry_run.py). Not executed, and said so in the report: pipeline layouts (the
schedule's point-to-point traffic), context parallelism (its batch split) and mixture-of-experts models (routing
sizes that depend on the data, which fake tensors do not have).

Beside every memory category stands :mod:`dufu.plan`'s prediction for the same pipeline rank (what
``dufu plan --json`` reports, in bytes).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from dufu.engine.precision import DTYPES
from dufu.engine.preflight import plan_run
from dufu.engine.schema import auto_layout_keys
from dufu.errors import ConfigError, LayoutError
from dufu.parallel.build import build_model_parts
from dufu.parallel.context_parallel import build_context_parallel
from dufu.plan.auto import resolve_auto_layout
from dufu.plan.hardware import get_hardware
from dufu.plan.layout import optimizer_of, setup_from_config
from dufu.plan.memory import estimate_memory
from dufu.plan.report import _bytes
from dufu.plan.search import check_layout, layout_from_config, model_info
from dufu.plan.trace import get_trace

STATE_KEYS = ("parameters", "gradients", "optimizer")


@dataclass
class RankReport:
    """What one rank holds and issues in the rehearsal, beside the planner's prediction for it."""

    rank: int
    coordinate: dict  # {"pipeline": p, "data": d, "tensor": t}
    memory: dict  # category -> bytes (activations: the planner's, see ``sources``)
    planned: dict  # category -> bytes, the planner's for this pipeline rank
    sources: dict  # category -> "rehearsal" | "planner"
    collectives: list = field(default_factory=list)  # {"op", "group", "ranks", "bytes", "count", "what"}
    # what one micro-batch's forward and backward really issued ({"op", "group", "ranks", "bytes", "count"}), or
    # None with the reason in ``executed_note``
    executed: Optional[list] = None
    executed_note: str = ""

    def as_dict(self) -> dict:
        return {"rank": self.rank, "coordinate": self.coordinate, "memory": self.memory, "planned": self.planned,
                "sources": self.sources, "collectives": self.collectives,
                "collectives_source": "derived from the parallelized modules and one micro-batch's shapes",
                "executed_collectives": self.executed, "executed_note": self.executed_note}


def default_ranks(cfg, world_size: int) -> list[int]:
    """The first rank of the first and of the last pipeline stage (rank order: pipeline, data, tensor)."""
    pp = int(cfg.train.dist.pipeline_parallel_size)
    last = (pp - 1) * (world_size // pp) if pp > 0 and world_size % pp == 0 else 0
    return sorted({0, last})


def rehearse(cfg, world_size: int, ranks=None, hardware="h100-80gb", resume=False) -> list[RankReport]:
    """Build ``ranks`` (default: :func:`default_ranks`) of ``cfg``'s run on ``world_size`` processes, one at a time,
    and report each. ``hardware``: the device the planner's activation estimate is for; ``resume``: as for
    :func:`~dufu.engine.preflight.plan_run`."""
    plan = plan_run(cfg, world_size, resume)  # every start-up check for world_size processes, with dufu's messages
    ranks = default_ranks(cfg, world_size) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world_size:
            raise LayoutError(f"--rank {r}: a rank of {world_size} processes is 0 to {world_size - 1}.")
    predicted = planned_by_pipeline_rank(cfg, world_size, hardware)
    return [_rehearse_rank(cfg, plan, world_size, r, predicted) for r in ranks]


def planned_by_pipeline_rank(cfg, world_size: int, hardware) -> list[dict]:
    """The planner's bytes per category for every pipeline rank: model states at rest (the optimizer step), the
    rest at that rank's peak."""
    hw = get_hardware(hardware)
    info, setup, layout = model_info(cfg), setup_from_config(cfg, hw), layout_from_config(cfg, world_size)
    check_layout(info, cfg, layout)
    trace = get_trace(info, setup.dtype, layout.activation_checkpoint or None, "cpu" if hw.synchronous else "cuda",
                      layout.expert_parallel_size, layout.context_parallel_size)
    _, ranks = estimate_memory(info, trace, layout, setup, asynchronous=not hw.synchronous)
    out = []
    for r in ranks:
        d = {k: int(round(max(v, 0.0))) for k, v in r.breakdown.items()}
        d.update({k: int(round(r.states[k])) for k in STATE_KEYS})
        out.append(d)
    return out


def _rehearse_rank(cfg, plan, world_size: int, rank: int, predicted: list[dict]) -> RankReport:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake backend, only for a rehearsal

    t, dims = cfg.train, plan.dims
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        world = dims.build_world("cpu") if world_size > 1 else None
        mesh = world.mesh if world is not None else None
        model = copy.deepcopy(plan.model)  # parallelize works in place: every rank cuts its own meta copy
        zero = t.zero_optimization
        parts = build_model_parts(
            model, mesh, torch.device("meta"), stage_ids=plan.stage_ids, meta_init=True, seed=t.seed,
            init_parameters=False, virtual_pipeline_size=t.dist.virtual_pipeline_size or 1,
            pipeline_schedule=t.dist.pipeline_schedule, num_microbatches=plan.batch_sizes[2],
            loss_fn=_no_loss, tensor_parallel=dims.tp_enabled, sequence_parallel=bool(t.dist.sequence_parallel),
            data_parallel=dims.dp_enabled, zero_stage=zero.stage if zero.enabled else None,
            activation_checkpoint=t.activation_checkpoint.mode if t.activation_checkpoint.enabled else None,
            compile=False, expert_mesh=world.expert_mesh if world else None,
            context_parallel=build_context_parallel(dims, world) if world is not None else None,
            data_mesh=world.fsdp_mesh if world is not None else None)
        coordinate = dict(zip(("pipeline", "data", "tensor"), mesh.get_coordinate())) if mesh is not None else \
            {"pipeline": 0, "data": 0, "tensor": 0}
        memory = held_bytes(parts.modules, *optimizer_of(cfg)[:2])
        collectives = step_collectives(cfg, plan, parts.modules, world, coordinate)
        executed, executed_note = executed_collectives(cfg, plan, parts.modules, world)
    finally:
        dist.destroy_process_group()
    planned = predicted[coordinate["pipeline"]]
    sources = {k: "rehearsal" for k in STATE_KEYS}
    for k, v in planned.items():
        if k not in STATE_KEYS:
            memory[k] = v
            sources[k] = "planner"
    return RankReport(rank, coordinate, memory, planned, sources, collectives, executed, executed_note)


# torch's collective ops as dispatched (functional and in-place forms) -> the names dufu reports
_OPS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
        "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter", "all_to_all_single": "all_to_all",
        "alltoall_base_": "all_to_all"}


def executed_collectives(cfg, plan, modules: list[nn.Module], world) -> tuple[Optional[list], str]:
    """Run one micro-batch's forward and backward through this rank's parallelized modules and record every
    collective torch dispatches, with its group and bytes: ([{"op", "group", "ranks", "bytes", "count"}], note).

    The parameters are materialised as fake tensors (``FakeTensorMode``: shapes and dtypes, no memory, no
    arithmetic), the inputs are a micro-batch of the run's own data, the loss runs under ``loss_parallel`` with
    tensor parallelism and autocast as configured, and the fake process group returns every collective at once:
    what is recorded is what FSDP2, DTensor and dufu's layers issue, not a model of it. Gradients are reduced
    after this micro-batch (as after a step's last). Pipeline schedules (point-to-point between stages) and
    context parallelism (its batch split) are not run: ``(None, reason)``."""
    if world is None:
        return [], "one process: no collectives"
    if plan.stage_ids is not None:
        return None, "not executed under pipeline parallelism (the schedule's sends and receives): derived only"
    if world.context_mesh is not None:
        return None, "not executed under context parallelism: derived only"
    from torch._subclasses.fake_tensor import FakeTensorMode  # shapes without memory: only for a rehearsal
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils._python_dispatch import TorchDispatchMode

    from dufu.data.sampler import collate
    from dufu.engine.batch import to_model_inputs

    axes = {}  # ranks of a group -> its axis name
    for mesh in (world.mesh, world.fsdp_mesh, world.expert_mesh):
        for axis in (mesh.mesh_dim_names or ()) if mesh is not None else ():
            axes.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group(axis))), axis)
    seen: dict = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = _OPS.get(func.__name__.split(".")[0])
            if op is not None:
                flat = [a for a in args if isinstance(a, torch.Tensor)] + [
                    t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                # the functional ops name their group by its last string argument (a reduce op may come first);
                # the in-place ones pass the process group itself
                group = next((a for a in reversed(args) if isinstance(a, str) or (
                    isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))), None)
                if isinstance(group, str):
                    group = _resolve_process_group(group)
                elif isinstance(group, torch.ScriptObject):
                    group = dist.ProcessGroup.unbox(group)
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
                nbytes = max((t.numel() * t.element_size() for t in flat), default=0)  # the full-size side
                key = (op, axes.get(ranks, "other"), ranks, nbytes)
                seen[key] = seen.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    amp = _autocast_dtype(cfg)
    inputs = to_model_inputs(collate(plan.train_ds, list(range(plan.batch_sizes[0]))))
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            for module in modules:
                module.to_empty(device="cpu")
            with Record(), (loss_parallel() if plan.dims.tp_enabled else contextlib.nullcontext()):
                with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                    loss = modules[0](**inputs).loss
                loss.backward()
    except (DataDependentOutputException, DynamicOutputShapeException) as e:  # e.g. MoE routing's token counts
        return None, (f"not executed: a size depends on the data ({e.func}; mixture-of-experts routing), which "
                      "fake tensors do not have: derived only")
    return ([dict(op=op, group=group, ranks=list(ranks), bytes=nbytes, count=count)
             for (op, group, ranks, nbytes), count in seen.items()],
            "executed: one micro-batch's forward and backward on fake tensors, gradients reduced after it")


def _no_loss(output, target):  # the schedule needs a loss function; a rehearsal never runs one
    raise RuntimeError("a dry run does not compute a loss")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def held_bytes(modules: list[nn.Module], optimizer: str = "adamw", sgd_momentum: bool = True) -> dict:
    """Parameters, gradients and the optimizer's state this rank keeps, from its local shards' shapes and dtypes (a
    last stage's own copy of a tied embedding included: it trains and has its moments). ``optimizer``
    (:func:`dufu.plan.layout.optimizer_of`): "adamw" two moments per parameter; "muon" one momentum buffer for the
    matrices :func:`dufu.optim.muon_param_groups` gives Muon, two moments for the rest; "sgd" one buffer (none
    without momentum)."""
    muon: set = set()
    if optimizer == "muon":
        from dufu.optim import muon_param_groups

        muon = {id(p) for m in modules for g in muon_param_groups(m) if g["use_muon"] for p in g["params"]}
    states = {"adamw": 2, "muon": 2, "sgd": 1 if sgd_momentum else 0}.get(optimizer, 2)
    seen, out = set(), {k: 0 for k in STATE_KEYS}
    for module in modules:
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = _local(p)
            nbytes = local.numel() * local.element_size()
            out["parameters"] += nbytes
            if p.requires_grad:
                out["gradients"] += nbytes  # FSDP2 keeps the gradient shard, replicate / DDP the whole
                # AdamW's exp_avg and exp_avg_sq, like the parameter; Muon's momentum; SGD's momentum
                out["optimizer"] += (1 if id(p) in muon else states) * nbytes
    return out


def _group(mesh, axis: str) -> dict:
    """The group of ``axis`` this rank belongs to: its name and member ranks."""
    group = mesh.get_group(axis)
    return {"group": axis, "ranks": dist.get_process_group_ranks(group)}


def step_collectives(cfg, plan, modules: list[nn.Module], world, coordinate: dict) -> list[dict]:
    """The collectives one optimizer step of this rank issues (see the module docstring), with group and bytes."""
    if world is None:
        return []
    mesh, t, dims = world.mesh, cfg.train, plan.dims
    micro, _, accum = plan.batch_sizes
    dtype = _compute_bytes(cfg)
    tokens = micro * plan.seq_length // dims.context_parallel_size
    width = _boundary_width(plan.model)
    out = []
    if dims.data_axis_size > 1:
        groups = {"data": _group(mesh, "data")}
        if world.fsdp_mesh is not None:  # hybrid sharding: FSDP2 shards within a replica, all-reduces across
            groups["dp_shard"] = _group(world.fsdp_mesh, "dp_shard")
            groups["dp_replicate"] = _group(world.fsdp_mesh, "dp_replicate")
        if world.expert_mesh is not None:
            groups["expert_data"] = _group(world.expert_mesh, "expert_data")
        out += _data_parallel(modules, groups, bool(t.zero_optimization.enabled), int(t.zero_optimization.stage),
                              accum, plan.stage_ids is not None)
    if dims.tp_enabled:
        out += _tensor_parallel(modules, _group(mesh, "tensor"), tokens, dtype, bool(t.dist.sequence_parallel),
                                accum)
    if world.context_mesh is not None:
        out += _context_parallel(modules, _group(world.context_mesh, "context"), tokens, dtype, accum)
    if world.expert_mesh is not None:
        out += _expert_parallel(modules, _group(world.expert_mesh, "expert"), tokens * width * dtype, accum)
    if plan.stage_ids is not None:
        nbytes = tokens * width * dtype // (dims.tensor_parallel_size if t.dist.sequence_parallel else 1)
        group = _group(mesh, "pipeline")
        pp, p = dims.pipeline_parallel_size, coordinate["pipeline"]
        if p > 0:
            out.append(dict(op="recv activations + send gradients", **group, bytes=nbytes, count=2 * accum,
                            what=f"with pipeline rank {p - 1}"))
        if p < pp - 1:
            out.append(dict(op="send activations + recv gradients", **group, bytes=nbytes, count=2 * accum,
                            what=f"with pipeline rank {p + 1}"))
    return out


def _autocast_dtype(cfg) -> Optional[torch.dtype]:
    """The dtype the rehearsed step computes in: None with train.amp off, else the one it names
    (``enabled=bf16`` / ``fp16``, else ``amp.dtype``; ``auto`` is taken as on)."""
    amp = cfg.train.amp
    if amp.enabled is False:
        return None
    name = amp.enabled if amp.enabled in DTYPES else {"bfloat16": "bf16", "float16": "fp16"}.get(str(amp.dtype),
                                                                                                  str(amp.dtype))
    return DTYPES.get(name, torch.bfloat16)


def _compute_bytes(cfg) -> int:
    dtype = _autocast_dtype(cfg)
    return 4 if dtype is None else dtype.itemsize


def _boundary_width(model: nn.Module) -> int:
    """The hidden size a pipeline stage sends on (the model's declared hidden size)."""
    for name in ("hidden_size", "d_model", "n_embd"):
        for holder in (model, getattr(model, "config", None)):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int):
                return value
    emb = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    return emb.embedding_dim


def _data_parallel(modules, groups: dict, zero: bool, stage: int, accum: int, pipelined: bool) -> list[dict]:
    """FSDP2's per-unit all-gather and reduce-scatter (ZeRO), or replicate's gradient all-reduce, on the unit's
    data axis (``expert_data`` for experts under expert parallelism). Gradients are reduced once per step: while
    they accumulate over micro-batches, dufu turns the synchronisation off. A unit is gathered for every
    micro-batch's forward (it is resharded after each backward), and again for its backward when resharded after
    forward; under a pipeline schedule torch's stages keep it gathered from the first forward (one gather per
    step) and gather a resharded unit again for each backward."""
    from torch.distributed.fsdp import FSDPModule  # FSDP2's unit type: only for layouts that use it

    out, done = [], set()
    for module in modules:
        for name, unit in module.named_modules():
            if not isinstance(unit, FSDPModule):
                continue
            # modules sharded together (``fully_shard([wte, wpe])``) are one unit: one gather, one reduction
            group_id = id(getattr(unit._get_fsdp_state(), "_fsdp_param_group", None) or unit)
            if group_id in done:
                continue
            done.add(group_id)
            members = [m for _, m in module.named_modules() if isinstance(m, FSDPModule)
                       and id(getattr(m._get_fsdp_state(), "_fsdp_param_group", None) or m) == group_id]
            params = list({id(p): p for m in members for p in m.parameters()
                           if not _inside_other_unit(m, p, FSDPModule)}.values())
            if not params:
                continue
            names = getattr(getattr(params[0], "device_mesh", None), "mesh_dim_names", None) or ()
            group = groups["expert_data"] if "expert_data" in names and "expert_data" in groups else groups["data"]
            replicas = None
            if zero and "dp_shard" in names and "dp_shard" in groups:  # HSDP: a 2-D mesh (dp_replicate, dp_shard)
                group, replicas = groups["dp_shard"], groups["dp_replicate"]
            local = sum(_local(p).numel() * p.element_size() for p in params)
            # FSDP2 gathers the shards of the group (padding aside); replicate reduces the whole local tensors
            full = local * len(group["ranks"]) if zero else local
            if not full:
                continue
            label = name or "root"
            # resharded after forward (ZeRO-3's blocks; not the output end): gathered again for backward, except
            # lookup tables (their backward needs the indices only, not the weights)
            param_group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
            resharded = param_group is not None and param_group.post_forward_mesh_info is not None
            tables = all(isinstance(m, nn.Embedding) for m in members)
            again = resharded and not tables
            gathers = (1 if pipelined else accum) + (accum if again else 0)
            if zero:
                out.append(dict(op="all_gather", **group, bytes=full, count=gathers, what=f"FSDP unit {label}"))
                out.append(dict(op="reduce_scatter", **group, bytes=full, count=1,
                                what=f"FSDP unit {label} gradients"))
                if replicas is not None:
                    out.append(dict(op="all_reduce", **replicas, bytes=local, count=1,
                                    what=f"FSDP unit {label} gradient shards across replicas"))
            else:
                out.append(dict(op="all_reduce", **group, bytes=full, count=1, what=f"replicate unit {label} "
                                "gradients"))
    return out


def _context_parallel(modules, group: dict, tokens: int, dtype: int, accum: int) -> list[dict]:
    """Every attention layer's all-gather of its K and V chunks over the context group (this rank's ``tokens``
    gathered ``cp`` times) in forward, and the reduce-scatter of their gradients in backward."""
    out, cp = [], len(group["ranks"])
    for module in modules:
        for name, sub in module.named_modules():
            k, v = getattr(sub, "k_proj", None), getattr(sub, "v_proj", None)
            if not (isinstance(k, nn.Linear) and isinstance(v, nn.Linear)):
                continue
            width = _local(k.weight).shape[0] + _local(v.weight).shape[0]  # this rank's K and V heads
            nbytes = tokens * cp * width * dtype
            out.append(dict(op="all_gather", **group, bytes=nbytes, count=accum, what=f"{name} K and V"))
            out.append(dict(op="reduce_scatter", **group, bytes=nbytes, count=accum,
                            what=f"{name} K and V gradients"))
    return out


def _expert_parallel(modules, group: dict, token_bytes: int, accum: int) -> list[dict]:
    """Every MoE layer's all-to-all of its tokens' ``top_k`` copies to their experts and back, in forward and
    backward (balanced routing: each rank sends as many as it receives)."""
    out = []
    for module in modules:
        for name, sub in module.named_modules():
            top_k = getattr(sub, "top_k", None)
            if isinstance(top_k, int) and any(getattr(m, "expert_parallel", False) for m in sub.children()):
                out.append(dict(op="all_to_all", **group, bytes=token_bytes * top_k, count=4 * accum,
                                what=f"{name} tokens to experts and back, forward and backward"))
    return out


def _inside_other_unit(unit, p, kind) -> bool:
    """Whether ``p`` belongs to a nested unit of ``unit`` (so to that unit's collectives, not this one's)."""
    for sub in unit.modules():
        if sub is not unit and isinstance(sub, kind) and any(q is p for q in sub.parameters()):
            return True
    return False


def _tensor_parallel(modules, group: dict, tokens: int, dtype: int, sp: bool, accum: int) -> list[dict]:
    from torch.distributed.tensor import Shard  # DTensor placements: only under tensor parallelism

    out, tp = [], len(group["ranks"])
    for module in modules:
        for name, sub in module.named_modules():
            weight = getattr(sub, "weight", None)
            placements = getattr(weight, "placements", None)
            if weight is None or placements is None or not isinstance(sub, (nn.Linear, nn.Embedding)):
                continue
            names = getattr(weight.device_mesh, "mesh_dim_names", None) or ()
            if "tensor" not in names:  # sharded by FSDP2 over the data axis only: a replicated layer under TP
                continue
            shard = placements[names.index("tensor")]
            shard = shard if isinstance(shard, Shard) else None
            if shard is None:
                continue
            if isinstance(sub, nn.Embedding):
                width, where = sub.embedding_dim, "forward output"
            elif shard.dim == 1:  # row-parallel: partial outputs summed
                width, where = sub.out_features, "forward output"
            else:  # column-parallel: input gradients summed in backward (or its input gathered under SP)
                width, where = sub.in_features, "backward input gradient"
            nbytes = tokens * width * dtype
            op = ("reduce_scatter" if where == "forward output" else "all_gather") if sp else "all_reduce"
            out.append(dict(op=op, **group, bytes=nbytes, count=accum * (2 if sp else 1),
                            what=f"{name} {where} (tp {tp})"))
    return out


def to_json(reports: list[RankReport]) -> str:
    """``{"ranks": [{"rank": R, "memory": {...}, "collectives": [...]}, ...]}``; bytes, ``dufu plan --json``'s
    memory categories."""
    return json.dumps({"ranks": [r.as_dict() for r in reports]}, indent=1)


def to_text(reports: list[RankReport], world_size: int) -> str:
    """A table per rank: held bytes beside the planner's, then the collectives."""
    lines = []
    for r in reports:
        c = r.coordinate
        lines.append(f"rank {r.rank} of {world_size} (pipeline {c['pipeline']}, data {c['data']}, tensor "
                     f"{c['tensor']})")
        lines.append(f"  {'memory':<20}{'rehearsal':>14}{'planned':>14}  source")
        for k, v in r.memory.items():
            lines.append(f"  {k:<20}{_bytes(v):>14}{_bytes(r.planned.get(k, 0)):>14}  {r.sources[k]}")
        lines.append("  collectives per step (derived from the parallelized modules and one micro-batch's shapes; "
                     "alike ones summed):")
        grouped: dict = {}
        for op in r.collectives:
            key = (op["op"], op["group"], op["bytes"])
            count, what, n = grouped.get(key, (0, op["what"], 0))
            grouped[key] = (count + op["count"], what, n + 1)
        for (op, group, nbytes), (count, what, n) in grouped.items():
            more = f" and {n - 1} more" if n > 1 else ""
            lines.append(f"    {op:<34} {group:<11} x{count:<5} {_bytes(nbytes):>12}  {what}{more}")
        lines.append(f"  collectives issued ({r.executed_note}):" if r.executed is not None else
                     f"  collectives issued: {r.executed_note}")
        for c in sorted(r.executed or [], key=lambda c: (c["group"], c["op"], -c["bytes"])):
            lines.append(f"    {c['op']:<34} {c['group']:<11} x{c['count']:<5} {_bytes(c['bytes']):>12}")
    return "\n".join(lines)


def dry_run(cfg, requested: bool, world_size, ranks, as_json: bool, gpu: str, resume) -> int:
    """``dufu train --dry-run``: check the options, let the planner fill ``auto`` values as ``dufu train`` does,
    rehearse and print."""
    if not requested:
        raise ConfigError("--world-size, --rank and --json belong to a rehearsal: add --dry-run (e.g. dufu train "
                          "CONFIG --dry-run --world-size 64).")
    if world_size is None or world_size < 1:
        raise ConfigError(f"--dry-run needs --world-size N, the processes of the run it rehearses (1 or more), "
                          f"not {world_size}; e.g. --dry-run --world-size 64.")
    notice = resolve_auto_layout(cfg, world_size) if auto_layout_keys(cfg) else None
    reports = rehearse(cfg, world_size, ranks, hardware=gpu, resume=resume)
    if as_json:
        print(to_json(reports))
    else:
        print(f"dufu train --dry-run: {world_size} processes (fake process group, meta device)"
              + (f"; {notice}" if notice else ""))
        print(to_text(reports, world_size))
    return 0
