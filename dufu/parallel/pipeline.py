"""Pipeline parallelism on ``torch.distributed.pipelining``.

A stage is the single-device model with the blocks that other stages own
*deleted* (not re-indexed), so parameter names such as ``blocks.7.mlp.fc1.weight``
are the same in every layout and checkpoints reshard freely. The first stage
keeps the embeddings, the last keeps the final norm and the output head.

Layer placement follows LiBai: by default the ``pipeline_num_layers`` blocks
are split into equal consecutive runs; ``custom_pipeline_stage_id`` gives a
stage per layer. With ``virtual_pipeline_size`` v > 1 (interleaved 1F1B,
Narayanan et al. 2021) there are pp x v stages and rank r holds stages
r, r + pp, r + 2 pp, ... (torch's looped placement). An encoder-decoder puts
its encoder blocks, then its decoder blocks, in one stage order (as LiBai
places T5).

What a stage is called with (:func:`split_pipeline_batch` prepares it):

* keyword arguments: the batch's model inputs except the main input and the
  labels (attention masks, token types, position ids ...). *Every* stage gets
  them, micro-batched by the schedule: each rank of a pipeline already holds
  the batch, so masks are never sent between stages (as Megatron-LM hands the
  masks to each stage);
* positional arguments: the main input (``input_ids``) on the first stage; on
  a later stage, the tensors the stage before returned.

A stage returns a tensor, or a tuple of tensors (all sent to the next stage),
or on the last stage the output its ``pipeline_loss`` takes. Only tensors that
require grad get a gradient back (torch's stages skip the others). A model whose
stages pass more than its hidden states defines ``pipeline_forward``; it
becomes the stage module's forward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dufu.errors import LayoutError
from dufu.models.base import contract_of

# name -> (torch.distributed.pipelining class, several stages per rank). Names, not classes: importing
# torch.distributed.pipelining pulls in torch._dynamo (~1.5 s), which the launcher's checks do not need.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", True),
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


def block_containers(layout: dict) -> tuple[str, ...]:
    """The dotted names of the block ``ModuleDict``s a ``pipeline_layout`` places, in stage order."""
    blocks = layout["blocks"]
    return (blocks,) if isinstance(blocks, str) else tuple(blocks)


def pipeline_blocks(model: nn.Module) -> list[tuple[str, str]]:
    """``(container, key)`` of every block in stage order: ``layout["blocks"]`` names one ``ModuleDict`` or
    several (an encoder's then a decoder's), whose blocks follow each other in that order."""
    layout = contract_of(model).pipeline_layout
    return [(c, k) for c in block_containers(layout) for k in model.get_submodule(c).keys()]


def pipeline_num_layers(model: nn.Module) -> int | None:
    """The number of blocks the pipeline places on stages (encoder plus decoder blocks for T5)."""
    declared = contract_of(model)
    if declared.pipeline_layout is None:
        return declared.num_layers
    return len(pipeline_blocks(model))


def _drop(module: nn.Module, name: str) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, None)


def build_stage_module(model: nn.Module, stage: int, num_stages: int, stage_ids: list[int],
                       in_place: bool = False) -> nn.Module:
    """A copy of ``model`` (``model`` itself if ``in_place``) that keeps only what pipeline stage ``stage`` owns.

    The model declares how it splits in ``pipeline_layout``:

    * ``blocks``: the attribute (dotted name) of its block ``ModuleDict``, or several in stage order;
    * ``first`` / ``last``: modules only the first / last stage keeps (embeddings; final norm, head);
    * optionally ``before`` / ``after``: ``{module: blocks}``, modules kept by the stage that owns the first /
      last block of those blocks (T5: each stack's relative bias before its blocks, the encoder's final norm
      after them).

    Its forward (or its ``pipeline_forward``, see the module docstring) must accept what the stage before
    returned when the first-stage modules are None, and return plain tensors when ``return_dict`` is False."""
    declared = contract_of(model)
    layout = declared.pipeline_layout
    if layout is None:
        reason = declared.pipeline_unsupported_reason.strip().rstrip(".")
        raise LayoutError(
            f"{type(model).__name__} cannot be split into pipeline stages: {reason}. "
            "Use data/tensor parallelism or ZeRO, i.e. pipeline_parallel_size=1."
        )
    order = pipeline_blocks(model)
    if len(stage_ids) != len(order):
        raise LayoutError(
            f"{len(stage_ids)} stage ids for the {len(order)} blocks of {type(model).__name__}; give one per block."
        )
    module = copy.deepcopy(model) if num_stages > 1 and not in_place else model
    owner = {block: s for block, s in zip(order, stage_ids)}
    for container, key in order:
        if owner[(container, key)] != stage:
            del module.get_submodule(container)[key]
    first, last = stage == 0, stage == num_stages - 1
    tied = bool(declared.tied_parameter_names)  # a head that is the embedding (T5Model ties, but has no head)
    if not first:
        for attr in layout["first"]:
            _drop(module, attr)
    if not last:
        for attr in layout["last"]:
            _drop(module, attr)
    for key, pick in (("before", 0), ("after", -1)):
        for attr, container in layout.get(key, {}).items():
            keys = [k for c, k in order if c == container]
            if not keys or owner[(container, keys[pick])] != stage:
                _drop(module, attr)
    if tied and last and not first:
        # The head's weight is tied to the first stage's embedding. Keep a copy here and mark it, so its
        # gradient is summed with the embedding's (Megatron's embedding group) and counted once in norms.
        module.lm_head.weight = nn.Parameter(module.lm_head.weight.detach().clone())
        module.tied_parameter_role = {"lm_head.weight": "copy"}
    if tied and first and not last:
        module.tied_parameter_role = {"wte.weight": "source"}
    module.return_dict = False
    stage_forward = contract_of(module).pipeline_forward
    if stage_forward is not None:
        module.forward = stage_forward  # torch's PipelineStage calls the module: module(*received, **inputs)
    if not last:
        module.register_forward_hook(_contiguous_outputs)
    return module


def _contiguous_outputs(module: nn.Module, args, output):
    """What a stage sends goes through point-to-point ops, which take contiguous tensors only (gloo and NCCL
    alike); a view such as T5's permuted relative bias would fail there."""
    if isinstance(output, tuple):
        return tuple(t.contiguous() for t in output)
    return output.contiguous()


def split_pipeline_batch(model: nn.Module, inputs: dict, main_input_name: str) -> tuple[tuple, dict, torch.Tensor]:
    """A batch as a pipeline schedule takes it: (the first stage's positional inputs, the keyword inputs of
    every stage, the last stage's target).

    The target is ``shift_labels`` if present, else ``labels``; labels never enter a stage. A sequence-to-
    sequence model that builds its decoder inputs from the labels (``prepare_decoder_input_ids_from_labels``,
    as transformers names it) gets them here, since its first stage does not see the labels."""
    inputs = dict(inputs)
    target = inputs.pop("shift_labels", None)
    labels = inputs.pop("labels", None)
    target = labels if target is None else target
    if target is None:
        raise LayoutError(
            f"pipeline parallelism computes the loss on the last stage from the batch's labels, but the batch has "
            f"only {sorted(inputs)}. Use data that yields `labels` (or `shift_labels`), or pipeline_parallel_size=1."
        )
    if main_input_name not in inputs:
        raise LayoutError(
            f"the first pipeline stage takes the model's main input {main_input_name!r}, but the batch has only "
            f"{sorted(inputs)}. Check that the dataset matches the model."
        )
    prepare = contract_of(model).prepare_decoder_input_ids_from_labels
    if prepare is not None and "decoder_input_ids" not in inputs and labels is not None:
        inputs["decoder_input_ids"] = prepare(labels=labels)
    first = (inputs.pop(main_input_name).contiguous(),)  # torch 2.11's stages compare input strides with the example's
    return first, inputs, target


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn):
    import torch.distributed.pipelining as pipelining  # here, not at the top: ~1.5 s (see SCHEDULES)

    class_name, multi = SCHEDULES[name]
    cls = getattr(pipelining, class_name)
    if multi:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


def make_stages(stage_modules: dict[int, nn.Module], num_stages: int, device: torch.device, group) -> list:
    from torch.distributed.pipelining import PipelineStage  # here, not at the top: ~1.5 s (see SCHEDULES)

    return [
        PipelineStage(module, stage_index=idx, num_stages=num_stages, device=device, group=group)
        for idx, module in sorted(stage_modules.items())
    ]
