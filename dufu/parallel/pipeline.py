"""Pipeline parallelism on ``torch.distributed.pipelining``.

A stage is the single-device model with the blocks that other stages own
*deleted* (not re-indexed), so parameter names such as ``blocks.7.mlp.fc1.weight``
are the same in every layout and checkpoints reshard freely. The first stage
keeps the embeddings, the last keeps the final norm and the output head.

Layer placement follows LiBai: by default the ``pipeline_num_layers`` blocks
are split into equal consecutive runs; ``custom_pipeline_stage_id`` gives a
stage per layer. With ``virtual_pipeline_size`` v > 1 (interleaved 1F1B,
Narayanan et al. 2021) there are pp x v stages and rank r holds stages
r, r + pp, r + 2 pp, ... (torch's looped placement). The V schedules (ZB-V,
Qi et al. 2024; DualPipeV, DeepSeek-V3's DualPipe cut in half) run exactly two
stages per rank placed in a V: rank r holds stages r and 2 pp - 1 - r, so rank 0
holds the first and the last stage (:func:`rank_stages`). An encoder-decoder
puts its encoder blocks, then its decoder blocks, in one stage order (as LiBai
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
    "zbv": ("ScheduleZBVZeroBubble", True),
    "dualpipev": ("ScheduleDualPipeV", True),
}
# The schedules that place their two stages per rank in a V (rank r: stages r and 2 pp - 1 - r), not looped.
V_SCHEDULES = ("zbv", "dualpipev")
# The schedules that split (some) backwards into the input gradient and, later, the weight gradient.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")


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


def rank_stages(schedule: str, pp: int, pp_rank: int, virtual_pipeline_size: int = 1) -> list[int]:
    """The pipeline stages rank ``pp_rank`` of ``pp`` holds under ``schedule``, in stage order: looped (rank r:
    r, r + pp, ... for ``virtual_pipeline_size`` stages per rank) or, for the V schedules, r and 2 pp - 1 - r.

    torch computes the same maps inside its schedules (``generate_stage_to_rank_mapping``, private); this one is
    needed before any schedule exists, to cut the model."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, pp * virtual_pipeline_size, pp))


def check_pipeline_schedule(schedule: str, pp: int, virtual_pipeline_size: int, num_layers: int,
                            num_microbatches: int, zero_stage: int | None = None) -> None:
    """Raise LayoutError, with the arithmetic and a fix, for a schedule that cannot run ``num_layers`` layers on
    ``pp`` pipeline ranks with ``virtual_pipeline_size`` stages each over ``num_microbatches`` micro-batches, with
    ZeRO stage ``zero_stage`` (None: off).

    Needs no process group and no torch.distributed.pipelining import: the launcher runs it before any worker."""
    if schedule not in SCHEDULES:
        raise LayoutError(
            f"train.dist.pipeline_schedule={schedule!r} is not known; use one of {', '.join(SCHEDULES)}."
        )
    if pp == 1:
        return
    v = virtual_pipeline_size
    multi, shaped_v = SCHEDULES[schedule][1], schedule in V_SCHEDULES
    if shaped_v and v != 2:
        raise LayoutError(
            f"the {schedule} schedule places exactly two stages on every pipeline rank, in a V (rank r holds "
            f"stages r and 2 x pp - 1 - r), but train.dist.virtual_pipeline_size is {v}. Set "
            "train.dist.virtual_pipeline_size=2."
        )
    if multi and v < 2:
        raise LayoutError(
            f"the {schedule} schedule runs several stages per rank: set train.dist.virtual_pipeline_size to 2 or "
            "more (stages per rank)."
        )
    if not multi and v != 1:
        raise LayoutError(
            f"train.dist.virtual_pipeline_size={v} needs an interleaved schedule; set "
            "train.dist.pipeline_schedule=interleaved_1f1b, or virtual_pipeline_size=1."
        )
    stages = pp * v
    if stages > num_layers:
        fix = (f"With {schedule}, use pipeline_parallel_size at most {num_layers // 2} (2 stages per rank), or "
               "a looped schedule (1f1b)" if shaped_v else f"Use at most {num_layers} stages")
        raise LayoutError(
            f"pipeline_parallel_size {pp} x virtual_pipeline_size {v} = {stages} stages, but the model has only "
            f"{num_layers} layers and each stage needs at least one. {fix}."
        )
    if num_microbatches < pp:
        raise LayoutError(
            f"under pipeline parallelism the accumulation steps are the micro-batches, and {schedule} needs at "
            f"least as many micro-batches as pipeline ranks: num_accumulation_steps is {num_microbatches}, "
            f"pipeline_parallel_size is {pp}. Raise train.global_batch_size or train.num_accumulation_steps "
            f"(global = micro x dp x accumulation)."
        )
    if schedule == "dualpipev" and num_microbatches < stages:
        # torch's ScheduleDualPipeV: rank 0's steady phase (one micro-batch's forward beside another's backward,
        # on each of its two stages) runs num_microbatches - 2 pp + 1 times, at least once.
        raise LayoutError(
            f"dualpipev needs at least as many micro-batches as stages, 2 x pipeline_parallel_size {pp} = "
            f"{stages}, but num_accumulation_steps is {num_microbatches}. Raise train.global_batch_size or "
            f"train.num_accumulation_steps to {stages} or more (global = micro x dp x accumulation), or use zbv."
        )
    if multi and not shaped_v and num_microbatches % pp != 0:
        raise LayoutError(
            f"{schedule} needs the number of micro-batches ({num_microbatches}) to be a multiple of "
            f"pipeline_parallel_size {pp}; adjust train.global_batch_size or train.num_accumulation_steps."
        )
    if schedule in SPLIT_BACKWARD_SCHEDULES and zero_stage is not None and zero_stage >= 3:
        # Measured (gpt_debug, dp 2 x pp 2): under ZeRO-3 the first step's gradient norm was 2.6-3.7 where one
        # process has 3.84, for zbv, dualpipev and interleaved_zero_bubble alike, tied head or not; ZeRO-2 and
        # no ZeRO gave 3.84. FSDP frees the gathered weights between the input-gradient and the weight-gradient
        # halves of a backward, which torch's split backward needs.
        raise LayoutError(
            f"the {schedule} schedule computes weight gradients apart from input gradients, which ZeRO stage "
            f"{zero_stage} (weights freed after each use) does not give correctly. Use "
            "train.zero_optimization.stage=2 (or ZeRO off) with it, or pipeline_schedule=1f1b / interleaved_1f1b "
            "with ZeRO-3."
        )


def schedule_class(name: str):
    """torch's class for schedule ``name``; a LayoutError naming the torch version when this torch has none
    (ScheduleZBVZeroBubble and ScheduleDualPipeV are newer than the other schedules)."""
    import torch.distributed.pipelining as pipelining  # here, not at the top: ~1.5 s (see SCHEDULES)

    class_name = SCHEDULES[name][0]
    cls = getattr(pipelining, class_name, None)
    if cls is None:
        raise LayoutError(
            f"train.dist.pipeline_schedule={name} runs torch.distributed.pipelining.{class_name}, which torch "
            f"{torch.__version__} does not have. Use a newer torch, or another schedule (1f1b, interleaved_1f1b)."
        )
    return cls


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn):
    cls = schedule_class(name)
    if name in V_SCHEDULES:
        cls = _forward_only_eval(cls)
    if SCHEDULES[name][1]:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


_EVAL_CLASSES: dict = {}


def _forward_only_eval(cls):
    """``cls`` (a torch V schedule) whose ``eval()`` runs only the forward half of its actions.

    torch's ``eval()`` runs the training action list with backward turned off in the stages, and a V schedule's
    list hands each backward's input gradient from one stage to the other on the same rank (the bottom of the V)
    without a send: with no backward run there is none to hand, and torch 2.13 stops with "can't steal_bwd_input
    if this stage doesn't have backward". Dropping the backward actions (and their sends and receives, and the
    backward halves of DualPipeV's overlapped pairs) keeps every forward, send and receive in torch's order, and
    waits on fewer things than the full list, so it cannot deadlock where the full list does not. Uses torch's
    private action list (``pipeline_order_with_comms``): no public API runs a multi-stage schedule forward-only."""
    if cls not in _EVAL_CLASSES:
        def eval(self, *args, **kwargs):
            full = self.pipeline_order_with_comms
            self.pipeline_order_with_comms = {rank: _forward_actions(actions) for rank, actions in full.items()}
            try:
                return cls.eval(self, *args, **kwargs)
            finally:
                self.pipeline_order_with_comms = full

        _EVAL_CLASSES[cls] = type(cls.__name__, (cls,), {"eval": eval, "__module__": __name__})
    return _EVAL_CLASSES[cls]


def _forward_actions(actions: list) -> list:
    from torch.distributed.pipelining.schedules import _ComputationType  # torch-private, see _forward_only_eval

    kinds = _ComputationType
    keep = {kinds.FORWARD, kinds.SEND_F, kinds.RECV_F, kinds.UNSHARD, kinds.RESHARD}
    out = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type in keep:
            out.append(action)
        else:  # an overlapped forward/backward pair keeps its forward; a backward, its send or receive goes
            out.extend(a for a in getattr(action, "sub_actions", None) or () if a.computation_type == kinds.FORWARD)
    return out


class _FollowSources:
    """Keeps tied copies equal to their sources on the same rank (see :func:`follow_tied_sources`)."""

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]):
        self.pairs = pairs  # (copy, source)

    @torch.no_grad()
    def sync(self, *_unused) -> None:
        # Through .data: the write is not counted in the copy's version, so an earlier micro-batch whose backward
        # saved the copy does not fail; the values written are the ones it holds already, since the source
        # changes only in the optimizer step, between steps. (Optimizers' fused kernels do not bump the version
        # counter either, so it cannot tell when the source changed.)
        for twin, source in self.pairs:
            twin.data.copy_(source.data)

    def before_forward(self, module, args) -> None:
        # A step begins with the copy's gradient dropped (dufu.parallel.grads.sync_tied_gradients sums it into
        # the source and drops it; the trainer zeroes gradients to None): from then until the copy's first
        # gradient of the step every forward refreshes it, the first one after the optimizer step included.
        if any(twin.grad is None for twin, _ in self.pairs):
            self.sync()


def follow_tied_sources(parts: list[nn.Module]) -> None:
    """Under a V placement the first and the last stage share a rank, so a tied head's copy
    (:func:`build_stage_module`) and the embedding it copies are on one rank: the trainer adds the copy's gradient
    to the embedding's and drops it (:func:`dufu.parallel.grads.sync_tied_gradients` without a group), the
    optimizer updates the embedding only, and the copy takes the embedding's values before its stage's next
    forward and before every ``state_dict`` (so checkpoints hold equal twins, as one process's tied weight).

    Call after the parts are parallelized and materialized (the parameter objects are final then)."""
    sources = {}
    for part in parts:
        for name, role in contract_of(part).tied_parameter_role.items():
            if role == "source":
                sources[name] = part.get_parameter(name)
    for part in parts:
        declared = contract_of(part)
        pairs = [(part.get_parameter(name), sources[declared.tied_parameter_names[name]])
                 for name, role in declared.tied_parameter_role.items()
                 if role == "copy" and declared.tied_parameter_names[name] in sources]
        if pairs:
            follow = _FollowSources(pairs)
            # first, before FSDP's own pre-forward hook gathers the copy's unit (prepended when it was applied)
            part.register_forward_pre_hook(follow.before_forward, prepend=True)
            part.register_state_dict_pre_hook(follow.sync)


def make_stages(stage_modules: dict[int, nn.Module], num_stages: int, device: torch.device, group) -> list:
    from torch.distributed.pipelining import PipelineStage  # here, not at the top: ~1.5 s (see SCHEDULES)

    return [
        PipelineStage(module, stage_index=idx, num_stages=num_stages, device=device, group=group)
        for idx, module in sorted(stage_modules.items())
    ]
