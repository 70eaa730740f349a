"""Pipeline parallelism on ``torch.distributed.pipelining``.

A stage is the single-device model with the blocks that other stages own
*deleted* (not re-indexed), so parameter names such as ``blocks.7.mlp.fc1.weight``
are the same in every layout and checkpoints reshard freely. The first stage
keeps the embeddings, the last keeps the final norm and the output head.

Layer placement follows LiBai: by default the ``pipeline_num_layers`` blocks
are split into equal consecutive runs; ``custom_pipeline_stage_id`` gives a
stage per layer. With ``virtual_pipeline_size`` v > 1 (interleaved 1F1B,
Narayanan et al. 2021) there are pp x v stages and rank r holds stages
r, r + pp, r + 2 pp, ... (torch's looped placement).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from dufu.errors import LayoutError

SCHEDULES = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, True),
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, True),
}


def layer_stage_ids(num_layers: int, num_stages: int, custom: list[int] | None = None) -> list[int]:
    """The pipeline stage of every layer: ``custom`` if given, else equal consecutive runs."""
    if custom is not None:
        custom = list(custom)
        if len(custom) != num_layers:
            raise LayoutError(
                f"train.dist.custom_pipeline_stage_id has {len(custom)} entries but the model has {num_layers} "
                "layers; give one stage id per layer."
            )
        if custom != sorted(custom) or set(custom) != set(range(num_stages)):
            raise LayoutError(
                f"train.dist.custom_pipeline_stage_id {custom} must be non-decreasing and use every stage "
                f"0..{num_stages - 1} at least once."
            )
        return custom
    if num_stages > num_layers:
        raise LayoutError(
            f"{num_stages} pipeline stages cannot share {num_layers} layers: each stage needs at least one. "
            f"Lower train.dist.pipeline_parallel_size (x virtual_pipeline_size) to at most {num_layers}."
        )
    base, extra = divmod(num_layers, num_stages)
    ids = []
    for s in range(num_stages):
        ids.extend([s] * (base + (1 if s < extra else 0)))
    return ids


def build_stage_module(model: nn.Module, stage: int, num_stages: int, stage_ids: list[int]) -> nn.Module:
    """A copy of ``model`` that keeps only what pipeline stage ``stage`` owns.

    The model declares how it splits in ``pipeline_layout``: the attribute holding its block
    ``ModuleDict``, the modules only the first stage keeps (embeddings) and those only the last keeps
    (final norm, head). Its forward must accept hidden states when the first-stage modules are None
    and return a plain tensor when ``return_dict`` is False."""
    layout = getattr(model, "pipeline_layout", None)
    if layout is None:
        raise LayoutError(
            f"{type(model).__name__} cannot be split into pipeline stages: it declares no `pipeline_layout`. "
            "Pipeline parallelism needs a model built from dufu layers; use data/tensor parallelism or ZeRO."
        )
    module = copy.deepcopy(model) if num_stages > 1 else model
    keep = {str(i) for i, s in enumerate(stage_ids) if s == stage}
    blocks = getattr(module, layout["blocks"])
    for name in list(blocks.keys()):
        if name not in keep:
            del blocks[name]
    first, last = stage == 0, stage == num_stages - 1
    tied = getattr(model, "tie_word_embeddings", False)
    if not first:
        for attr in layout["first"]:
            setattr(module, attr, None)
    if not last:
        for attr in layout["last"]:
            setattr(module, attr, None)
    if tied and last and not first:
        # The head's weight is tied to the first stage's embedding. Keep a copy here and mark it, so its
        # gradient is summed with the embedding's (Megatron's embedding group) and counted once in norms.
        module.lm_head.weight = nn.Parameter(module.lm_head.weight.detach().clone())
        module.tied_parameter_role = {"lm_head.weight": "copy"}
    if tied and first and not last:
        module.tied_parameter_role = {"wte.weight": "source"}
    module.return_dict = False
    return module


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn):
    cls, multi = SCHEDULES[name]
    if multi:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def make_stages(stage_modules: dict[int, nn.Module], num_stages: int, device: torch.device, group) -> list[PipelineStage]:
    return [
        PipelineStage(module, stage_index=idx, num_stages=num_stages, device=device, group=group)
        for idx, module in sorted(stage_modules.items())
    ]
