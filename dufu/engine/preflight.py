"""The start-up path of a run, shared by ``dufu train --nproc`` (before any worker starts) and the Trainer.

:func:`plan_run` is the one place that checks the config, does the batch arithmetic, decides what to resume
from, builds the data and the model on the meta device and checks the layout against that model. The
launcher runs it once so that a bad config fails once, readably; every worker runs the same function, so
the two can never disagree about what a config means.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from dufu.config import instantiate
from dufu.delta import apply_delta
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.resume_checks import (
    ResumeRequest,
    SavedRun,
    as_request,
    check_model_shapes,
    check_saved_settings,
    choose_checkpoint,
    keep_saved_global_batch,
)
from dufu.engine.distill import check_teacher
from dufu.engine.resilience.fault_tolerance import check_config as check_fault_tolerance
from dufu.engine.lr_scheduler import fit_warmup_to_run
from dufu.engine.run_tokenizer import run_tokenizer
from dufu.engine.schema import auto_layout_keys
from dufu.engine.validate import resolve_batch_sizes, validate_config
from dufu.errors import ConfigError, DufuError, LayoutError
from dufu.layers.mla import MLA
from dufu.engine.weights.pretrained import Pretrained, load_pretrained, pretrained_weights
from dufu.parallel.checks import validate_layout
from dufu.parallel.expert_parallel import selective_checkpoint_notice
from dufu.parallel.materialize import materialize_, supports_meta_init
from dufu.parallel.parallel_dims import ParallelDims
from dufu.parallel.pipeline import V_SCHEDULES
from dufu.models.base import contract_of


@dataclass
class RunPlan:
    """Everything a run is built from that needs no process group; the model is on the meta device."""

    dims: ParallelDims
    batch_sizes: tuple[int, int, int]  # (micro, global, accumulation steps)
    resume_from: Optional[Path]
    tokenizer: object
    train_ds: object
    valid_ds: object
    seq_length: int
    model: nn.Module
    stage_ids: Optional[list[int]]  # the pipeline stage of every layer; None without pipeline parallelism
    pretrained: Pretrained
    scheduler: dict  # train.scheduler with max_iter and a warm-up that fits the run (the optimizer unset)
    notices: list[str] = field(default_factory=list)  # one line each, shown in the start-up summary


def plan_run(cfg, world_size: int, resume: bool | str | Path | ResumeRequest = False) -> RunPlan:
    """``resume``: False (a new run; output_dir must not hold one), True (the latest complete checkpoint, or step 0
    when there is none yet), "auto" (the same, for elastic restarts), a :class:`ResumeRequest` (``dufu train
    --resume-step / --resume-from / --override-saved``), or the Path of a checkpoint whose weights a Runtime
    starts from (``dufu eval``). A training resume is checked against the saved run before any work
    (:mod:`dufu.engine.weights.resume_checks`). Layout values left ``auto`` must have been resolved by the planner
    first (:func:`dufu.plan.auto.resolve_auto_layout`; ``dufu train`` does)."""
    refuse_auto(cfg)
    validate_config(cfg)  # the typed train schema (defaults filled in), then the ranges
    t = cfg.train
    dims = ParallelDims.from_config(t.dist, world_size)
    resume_from = resume_checkpoint(Path(t.output_dir), resume)
    resume_note = resume_notice(Path(t.output_dir), resume, resume_from)
    # what the checkpoint's run was: a training resume continues it (not `dufu eval`'s weights from a Path)
    saved = SavedRun.read(resume_from) if resume_from is not None and not isinstance(resume, Path) else None
    batch_note = keep_saved_global_batch(cfg, saved, dims.data_parallel_size) if saved else None
    batch_sizes = resolve_batch_sizes(t.train_micro_batch_size, t.global_batch_size, t.num_accumulation_steps,
                                      dims.data_parallel_size)
    torch.manual_seed(t.seed)
    tokenizer, tokenizer_note = run_tokenizer(cfg)  # the data's, when it was preprocessed with another
    train_ds, valid_ds = instantiate(with_kwargs(cfg.dataloader.train, tokenizer=tokenizer))  # fills the data cache
    # A change of schedule, global batch or data against the saved run: refused here, once the data is known to
    # exist (a missing file is named first), before the model is built or anything is loaded or written.
    saved_notes = check_saved_settings(cfg, saved, batch_sizes, dims.data_parallel_size, as_request(resume)) \
        if saved else []
    check_validation_set(cfg, valid_ds, batch_sizes[1])
    if hasattr(train_ds, "order_by_seed"):  # a blend: it is the training order, as long as the run (data.blend)
        train_ds.order_by_seed(t.seed, num_samples=t.train_iter * batch_sizes[1])
    seq_length = getattr(train_ds, "seq_length", None) or train_ds[0].shape[0] - 1
    # Shapes only: each rank allocates just what it holds after splitting and sharding.
    with torch.device("meta"):
        model = build_model(cfg, tokenizer, seq_length)
    if saved:  # parameter names and shapes, before anything is allocated or loaded
        check_model_shapes(model, saved, cfg, delta=model.delta_info is not None)
    stage_ids = validate_layout(dims, model, t.dist, t.zero_optimization, seq_length, batch_sizes[2])
    check_fault_tolerance(cfg, dims)  # train.fault_tolerance: supported combinations, a Lighthouse that answers
    if stage_ids is not None and type(model).pipeline_loss is None:
        raise LayoutError(
            f"{type(model).__name__} defines no `pipeline_loss`, the loss a pipeline's last stage computes from "
            "its output and the labels. Use a model with a task head (e.g. a *ForMaskedLM or *ForSequence"
            "Classification class), or pipeline_parallel_size=1."
        )
    if dims.cp_enabled:
        refuse_with_context_parallel(cfg, model)
    if cfg.get("distill") is not None:  # the teacher exists, the weights make sense, the vocabularies agree
        if stage_ids is not None and t.dist.pipeline_schedule in V_SCHEDULES:
            raise LayoutError(
                f"train.dist.pipeline_schedule={t.dist.pipeline_schedule} computes the loss on pipeline rank 0 (a V), "
                "but distillation's teacher hands its logits to the last rank; use 1f1b or interleaved_1f1b with "
                "distillation.")
        check_teacher(instantiate(cfg.distill), model)
    scheduler, notice = fit_warmup_to_run(with_kwargs(t.scheduler, max_iter=t.train_iter), t.train_iter)
    # A delta run's checkpoints hold only the delta: its base is read from its source on every start.
    base_from = None if model.delta_info is not None else resume_from
    notices = [n for n in (resume_note, tokenizer_note, batch_note, *saved_notes, notice,
                           selective_checkpoint_notice(t.dist, t.activation_checkpoint)) if n]
    return RunPlan(dims, batch_sizes, resume_from, tokenizer, train_ds, valid_ds, seq_length, model, stage_ids,
                   pretrained_weights(model, base_from), scheduler, notices)


def refuse_auto(cfg) -> None:
    """A layout value still ``auto`` here was not given to the planner: say how to get it resolved."""
    left = auto_layout_keys(cfg)
    if left:
        named = sorted(k for k in left if k != "train.dist.auto") or ["train.dist.auto=True"]
        raise ConfigError(f"{', '.join(named)}: 'auto' layout values are chosen by the "
                          "planner, which `dufu train` runs before the workers start; when building a Trainer "
                          "yourself, call dufu.plan.auto.resolve_auto_layout(cfg, world_size) first.")


def preflight(cfg, world_size: int, resume: bool | str | Path | ResumeRequest = False) -> None:
    """Every start-up check that needs no process group, for ``world_size`` processes: run by
    ``dufu train --nproc`` before it starts any worker, so a bad config fails once, readably."""
    plan = plan_run(cfg, world_size, resume)
    request = None if isinstance(resume, Path) else as_request(resume)  # a Path was verified when planned
    if plan.resume_from is not None and request is not None and not request.if_exists:
        # Verify the checkpoint here, once, before any worker starts: a damaged file is then one clear error.
        Checkpointer(plan.resume_from.parent).verify(plan.resume_from)


def with_kwargs(node, **kwargs):
    """A copy of a LazyCall node with some keyword arguments filled in by the trainer (never saved)."""
    node = copy.deepcopy(node)
    for k, v in kwargs.items():
        node[k] = v
    return node


def check_validation_set(cfg, valid_ds, global_batch_size: int) -> None:
    """Evaluation runs whole global batches; refuse, before anything is written, a set smaller than one."""
    if not cfg.train.evaluation.enabled or valid_ds is None:
        return
    if len(valid_ds) < global_batch_size:
        raise ConfigError(
            f"the validation set has {len(valid_ds)} samples, fewer than one global batch ({global_batch_size}), "
            "and evaluation runs whole global batches. Raise dataloader.train.valid_fraction, lower "
            "train.global_batch_size, or set train.evaluation.enabled=False."
        )


def refuse_with_context_parallel(cfg, model) -> None:
    """What context parallelism does not take yet, refused before any worker starts (each would silently change
    the numbers: a teacher not split like the student, tokens added inside). Packed samples and document masks
    it takes (dufu.parallel.context_parallel numbers the documents before the split)."""
    why = None
    data = cfg.dataloader.train
    if cfg.get("distill") is not None:
        why = "distillation's teacher is not split by sequence; train the student without the distill section"
    elif (data.get("packing") or data.get("document_mask")) and any(isinstance(m, MLA) for m in model.modules()):
        why = ("multi-head latent attention (DeepSeek-V3) gathers its own latents under context parallelism and "
               "masks by position only, not by the documents of packed samples (dataloader.train.packing / "
               "document_mask); turn those off")
    elif model.delta_info is not None and set(model.delta_info.kinds) & {"PrefixTuning",
                                                                                             "PromptTuning"}:
        why = (f"{' and '.join(sorted(set(model.delta_info.kinds) & {'PrefixTuning', 'PromptTuning'}))} add tokens to "
               "every sequence; LoRA, adapters, BitFit and freezing work with it")
    if why:
        raise LayoutError(f"train.dist.context_parallel_size {cfg.train.dist.context_parallel_size}: {why}, or set "
                          "train.dist.context_parallel_size=1.")


def build_model(cfg, tokenizer, seq_length: int) -> nn.Module:
    """Instantiate ``cfg.model`` and check it fits the tokenizer and the data's sequence length."""
    try:
        model = instantiate(cfg.model)
    except (ValueError, TypeError) as e:
        if isinstance(e, DufuError):
            raise
        raise ConfigError(f"the model cannot be built from model.*: {e}. Fix those keys in the config.") from None
    if cfg.get("delta") is not None:  # delta tuning: added to the single-device model, before any split
        apply_delta(model, instantiate(cfg.delta))
    vocab = contract_of(model).vocab_size
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab}. "
            f"Set model.vocab_size={tokenizer.vocab_size} or more (a multiple of 128 is fastest)."
        )
    max_pos = contract_of(model).max_position_embeddings
    if max_pos is not None and seq_length > max_pos:
        raise ConfigError(
            f"the data's sequence length {seq_length} exceeds model.max_position_embeddings {max_pos}; "
            "lower dataloader.train.seq_length or raise model.max_position_embeddings."
        )
    return model


def resume_checkpoint(output_dir: Path, resume) -> Optional[Path]:
    """The checkpoint a run continues from (see :func:`plan_run`), or None for a new run. A path: that checkpoint
    (``dufu eval``), which must be complete. A resume: the checkpoint it names (``--resume-step``,
    ``--resume-from``), else the newest complete one; with none yet (the first attempt of a restartable job script
    was killed before its first save) the run starts at step 0, as Megatron's ``--load``, torchtitan and LiBai
    do, and :func:`resume_notice` says so. A checkpoint that exists but is corrupt or partial fails when it is
    verified, naming the others."""
    if isinstance(resume, Path):
        Checkpointer(resume.parent).verify(resume)
        return resume
    request = as_request(resume)
    if request is not None:
        return choose_checkpoint(output_dir, request)
    latest = Checkpointer(output_dir / "checkpoints").latest()
    if latest is not None or (output_dir / "metrics.jsonl").exists():
        raise DufuError(
            f"train.output_dir '{output_dir}' already holds a run"
            f"{f' (latest checkpoint {latest.name})' if latest else ''}. Nothing was changed. To continue it, add "
            "--resume; to start a new run, choose another directory (train.output_dir=...) or delete this one."
        )
    return None


def resume_notice(output_dir: Path, resume, resume_from: Optional[Path]) -> str:
    """The start-up line for ``--resume`` that found no complete checkpoint (not for ``--resume-if-exists``: a
    restart through ``--max-restarts`` that has none yet is the first attempt again, nothing to say)."""
    request = as_request(resume) if not isinstance(resume, Path) else None
    if request is not None and not request.if_exists and resume_from is None:
        return (f"--resume: {output_dir / 'checkpoints'} holds no complete checkpoint yet, so this run starts at "
                "step 0")
    return ""


def model_to_split(cfg, plan, meta_init: bool):
    """The model the parts are cut from: the meta model, or a full one on every rank when the model has no
    per-module initialisation (a transformers model as-is) or train.meta_init=False asks for it."""
    model = plan.model
    if not supports_meta_init(model):  # built in full, with the same values on every rank
        model = build_model(cfg, plan.tokenizer, plan.seq_length)
        if plan.pretrained.source is not None:  # its weights: a separate step after the build
            load_pretrained(model, plan.pretrained.path)
        return model
    if not meta_init:  # the full model on every rank, with the values the meta path gives
        materialize_(model, model, torch.device("cpu"), seed=cfg.train.seed, pretrained=plan.pretrained.source)
    return model
