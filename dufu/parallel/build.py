"""A rank's model parts from one model: pipeline split, parallelize, materialize, schedule and tied groups.

The order is the meta-device recipe (torchtitan, picotron): cut the model into this rank's pipeline stages,
parallelize each part (TP -> activation checkpointing -> compile -> FSDP/replicate, see :func:`parallelize`),
and only then allocate and fill its shards, so a rank never holds more than its share of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from dufu.models.base import contract_of
from dufu.parallel.grads import tied_parameters
from dufu.parallel.materialize import materialize_
from dufu.parallel.parallelize import parallelize
from dufu.parallel.pipeline import (V_SCHEDULES, build_schedule, build_stage_module, check_pipeline_schedule,
                                    follow_tied_sources, make_stages, rank_stages)


@dataclass
class ModelParts:
    """What a rank trains: its parts in stage order (one part without pipeline parallelism) and what joins them."""

    modules: list[nn.Module]
    schedule: object  # the pipeline schedule over the parts, or None without pipeline parallelism
    first: bool  # this rank holds the first pipeline stage (it takes the main input)
    last: bool  # ... the last one (it computes the loss)
    tied_copies: list  # parameters that copy another stage's (a tied head), counted once in norms
    tied_params: list  # the tied parameters whose gradients are summed over tied_group
    tied_group: object  # first and last stage at equal (data, tensor) coordinates, or None


def build_model_parts(
    model: nn.Module,
    mesh,
    device: torch.device,
    *,
    stage_ids: Optional[list[int]],
    meta_init: bool,
    seed: int,
    pretrained: Optional[Callable] = None,
    init_parameters: bool = True,
    virtual_pipeline_size: int = 1,
    pipeline_schedule: str = "1f1b",
    num_microbatches: int = 1,
    loss_fn: Optional[Callable] = None,
    expert_mesh=None,
    **parallel_kwargs,
) -> ModelParts:
    """Split ``model`` into this rank's pipeline stages (``stage_ids``: the stage of every layer, None to keep it
    whole), parallelize each part with ``parallel_kwargs`` (see :func:`parallelize`) and, for a model built on
    the meta device (``meta_init``), allocate and fill it (``pretrained``, ``init_parameters``: see
    :func:`materialize_`). Under pipeline parallelism the parts run in a schedule whose last stage computes
    ``loss_fn(output, target)`` over ``num_microbatches`` micro-batches: ``pipeline_schedule`` (a name of
    :data:`dufu.parallel.pipeline.SCHEDULES`) decides which stages this rank holds (:func:`rank_stages`)."""
    pp, pp_rank = (mesh.mesh.shape[0], mesh.get_coordinate()[0]) if mesh is not None else (1, 0)  # axes (pp, dp, tp)
    # Frozen parameters (a delta run's base) stay frozen in every part, under every name: a pipeline stage's
    # own copy of a tied head is a new parameter and must not train where its twin does not.
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if stage_ids is None:
        num_stages, parts = 1, {0: model}
    else:
        # the launcher checked this already (dufu.parallel.checks); a caller that did not gets the same message
        check_pipeline_schedule(pipeline_schedule, pp, virtual_pipeline_size, len(stage_ids), num_microbatches,
                                zero_stage=parallel_kwargs.get("zero_stage"))
        num_stages = pp * virtual_pipeline_size
        mine = rank_stages(pipeline_schedule, pp, pp_rank, virtual_pipeline_size)
        # A full model built on this rank (not on meta) is cut in place when the rank holds one stage:
        # a copy per stage would hold the whole model twice until start-up ends.
        in_place = not meta_init and len(mine) == 1
        parts = {s: build_stage_module(model, s, num_stages, stage_ids, in_place=in_place) for s in mine}
    stage_mesh = mesh["data", "tensor"] if mesh is not None else None
    # expert_mesh: the 4-D ("pipeline", "expert_data", "expert", "tensor") mesh under expert parallelism
    stage_expert_mesh = expert_mesh["expert_data", "expert"] if expert_mesh is not None else None
    for part in parts.values():
        if not meta_init:
            part.to(device)
        parallelize(part, stage_mesh, expert_mesh=stage_expert_mesh, **parallel_kwargs)
        if meta_init:
            materialize_(part, model, device, seed=seed, pretrained=pretrained, init_parameters=init_parameters)
    for part in parts.values():
        for n, p in part.named_parameters(remove_duplicate=False):
            if n in frozen:
                p.requires_grad_(False)
    schedule = None
    if stage_ids is not None:
        stages = make_stages(parts, num_stages, device, mesh.get_group("pipeline"))
        schedule = build_schedule(pipeline_schedule, stages, num_microbatches, loss_fn)
    ordered = [parts[s] for s in sorted(parts)]
    tied_copies, tied = tied_parameters(ordered)
    tied_group = None
    if stage_ids is not None and contract_of(model).tie_word_embeddings:
        if pipeline_schedule in V_SCHEDULES:
            # The first and the last stage are both on pipeline rank 0: its copy follows the embedding locally
            # (no group: dufu.parallel.grads.sync_tied_gradients sums into the embedding, the copy takes its values).
            follow_tied_sources(ordered)
        else:
            tied_group = tied_stage_group(mesh)
    return ModelParts(ordered, schedule, 0 in parts, (num_stages - 1) in parts, tied_copies, tied, tied_group)


def tied_stage_group(mesh):
    """The process group joining the first and the last pipeline stage at this rank's (data, tensor)
    coordinates (Megatron's embedding group). Every rank creates every group, as ``new_group`` requires."""
    ranks = mesh.mesh  # (pp, dp, tp) tensor of global ranks
    me, mine = dist.get_rank(), None
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            members = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(members)
            if me in members:
                mine = group
    return mine
