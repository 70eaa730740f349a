"""The Trainer: a constructor that only wires parts together, and one readable training loop.

The same loop runs every layout. What changes with ``train.dist``/``zero_optimization``:

* the model is split into pipeline-stage parts (``self.model_parts``; one part without PP),
* each part is parallelized (TP -> activation checkpointing -> compile -> FSDP/replicate),
* a step runs either the micro-batch loop (no PP) or a pipeline schedule over the same micro-batches,
* the logged loss is reduced to the mean over the global batch in every layout.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.config import LazyConfig, instantiate
from dufu.data import ResumableBatchSampler, collate
from dufu.parallel.parallel_dims import ParallelDims
from dufu.parallel.launch import init_distributed
from dufu.parallel import env
from dufu.engine.checkpoint import Checkpointer
from dufu.engine.flops import count_matmul_params, device_peak_flops, flops_per_token
from dufu.engine.generate import generate
from dufu.engine import faults
from dufu.engine.loss_scaler import DynamicLossScaler
from dufu.engine.logger import MetricsWriter, ProgressBar, plot_loss_curve, read_metrics
from dufu.engine.validate import resolve_batch_sizes, validate_config
from dufu.errors import ConfigError, DistributedFailure, DufuError
from dufu.models.gpt import causal_lm_loss
from dufu.models.hub import check_pretrained, pretrained_source
from dufu.parallel import parallelize
from dufu.parallel.checks import validate_layout
from dufu.parallel.grads import clip_grad_norm_, sync_tied_gradients, tied_parameters
from dufu.parallel.materialize import materialize_, supports_meta_init
from dufu.parallel.pipeline import build_schedule, build_stage_module, make_stages, split_pipeline_batch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_model_inputs(batch) -> dict:
    """A (B, T+1) token tensor becomes next-token inputs and already-shifted labels (``shift_labels``, as
    transformers names them); dict batches (e.g. masked-LM, classification, images) pass through."""
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch[:, :-1], "shift_labels": batch[:, 1:]}
    return dict(batch)


def count_loss_targets(inputs: dict) -> torch.Tensor:
    """How many targets a batch's loss averages over: labels that are not -100 (``shift_labels`` of causal
    LM data, ``labels`` of masked-LM / seq2seq / classification data), else one per sample."""
    target = inputs.get("shift_labels", inputs.get("labels"))
    if target is None:
        return torch.tensor(next(iter(inputs.values())).shape[0])
    return (target != -100).sum()


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A detached fp32 plain tensor (losses are replicated DTensors under loss_parallel)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.float()


def with_kwargs(node, **kwargs):
    """A copy of a LazyCall node with some keyword arguments filled in by the trainer (never saved)."""
    node = copy.deepcopy(node)
    for k, v in kwargs.items():
        node[k] = v
    return node


def preflight(cfg, world_size: int, resume: bool | str = False) -> None:
    """Every start-up check that needs no process group, for ``world_size`` processes: run by
    ``dufu train --nproc`` before it starts any worker, so a bad config fails once, readably."""
    validate_config(cfg)
    t = cfg.train
    dims = ParallelDims.from_config(t.dist, world_size)
    _, _, accum = resolve_batch_sizes(t.train_micro_batch_size, t.global_batch_size, t.num_accumulation_steps,
                                      dims.data_parallel_size)
    if not resume:
        _check_fresh_output_dir(Path(t.output_dir))
    elif resume is True:
        # Verify the checkpoint here, once, before any worker starts: a damaged file is then one clear error.
        ckpts = Checkpointer(Path(t.output_dir) / "checkpoints")
        ckpts.verify(_latest_for_resume(ckpts))
    tokenizer = instantiate(cfg.tokenization.tokenizer)
    train_ds, valid_ds = instantiate(with_kwargs(cfg.dataloader.train, tokenizer=tokenizer))  # fills the data cache
    check_validation_set(cfg, valid_ds, dims.data_parallel_size * t.train_micro_batch_size * accum)
    seq_length = getattr(train_ds, "seq_length", None) or train_ds[0].shape[0] - 1
    with torch.device("meta"):
        model = build_model(cfg, tokenizer, seq_length)
    if getattr(model, "pretrained_path", None) is not None and not resume:
        check_pretrained(model, model.pretrained_path)  # the path and the sizes; nothing is read
    validate_layout(dims, model, t.dist, t.zero_optimization, seq_length, accum)


def _looks_distributed(e: BaseException) -> bool:
    """A failure of communication with other ranks (as opposed to a bug on this rank)."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket"))


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


def build_model(cfg, tokenizer, seq_length: int) -> torch.nn.Module:
    """Instantiate ``cfg.model`` and check it fits the tokenizer and the data's sequence length."""
    try:
        model = instantiate(cfg.model)
    except (ValueError, TypeError) as e:
        if isinstance(e, DufuError):
            raise
        raise ConfigError(f"the model cannot be built from model.*: {e}. Fix those keys in the config.") from None
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab}. "
            f"Set model.vocab_size={tokenizer.vocab_size} or more (a multiple of 128 is fastest)."
        )
    max_pos = getattr(model, "max_position_embeddings", None)
    if max_pos is not None and seq_length > max_pos:
        raise ConfigError(
            f"the data's sequence length {seq_length} exceeds model.max_position_embeddings {max_pos}; "
            "lower dataloader.train.seq_length or raise model.max_position_embeddings."
        )
    return model


def _latest_for_resume(checkpointer: Checkpointer) -> Path:
    """The newest complete checkpoint, or the error that --resume has nothing to resume."""
    latest = checkpointer.latest()
    if latest is None:
        raise DufuError(
            f"--resume was given but {checkpointer.root} holds no complete checkpoint. "
            "Check train.output_dir, or start the run without --resume."
        )
    return latest


def _check_fresh_output_dir(output_dir: Path) -> None:
    latest = Checkpointer(output_dir / "checkpoints").latest()
    if latest is not None or (output_dir / "metrics.jsonl").exists():
        raise DufuError(
            f"train.output_dir '{output_dir}' already holds a run"
            f"{f' (latest checkpoint {latest.name})' if latest else ''}. Nothing was changed. To continue it, add "
            "--resume; to start a new run, choose another directory (train.output_dir=...) or delete this one."
        )


class Trainer:
    """``resume``: False (a new run; output_dir must not hold one), True (continue from the latest
    complete checkpoint), or "auto" (resume if there is a checkpoint, else start over: elastic restarts)."""

    def __init__(self, cfg, resume: bool | str = False, log=print):
        validate_config(cfg)
        self.cfg = cfg
        t = cfg.train
        self.rank, self.local_rank, self.world_size = env.world_info()
        self.is_main = self.rank == 0
        self.log = log if self.is_main else (lambda *a, **k: None)
        self.dims = ParallelDims.from_config(t.dist, self.world_size)
        self.micro_batch_size, self.global_batch_size, self.num_accumulation_steps = resolve_batch_sizes(
            t.train_micro_batch_size, t.global_batch_size, t.num_accumulation_steps, self.dims.data_parallel_size
        )
        self.device = env.pick_device(self.local_rank) if t.get("device", "auto") == "auto" else torch.device(t.device)
        self.output_dir = Path(t.output_dir)
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", t.checkpointer.max_to_keep, self.rank,
                                         async_save=t.checkpointer.get("async_save", False))
        self.resume_from = self._find_resume_checkpoint(resume)
        self.amp_dtype = AMP_DTYPES[t.amp.dtype] if t.amp.enabled else None

        torch.manual_seed(t.seed)
        self.tokenizer = instantiate(cfg.tokenization.tokenizer)
        self.train_ds, self.valid_ds = instantiate(with_kwargs(cfg.dataloader.train, tokenizer=self.tokenizer))
        self.seq_length = getattr(self.train_ds, "seq_length", None) or self.train_ds[0].shape[0] - 1
        check_validation_set(cfg, self.valid_ds, self.global_batch_size)
        self._pretrained_checkpoint = None  # model.pretrained = a dufu run: loaded after the parts are built
        # Shapes only: each rank allocates just what it holds after splitting and sharding (_build_parts).
        with torch.device("meta"):
            model = build_model(self.cfg, self.tokenizer, self.seq_length)
        self.meta_init = t.get("meta_init", True) and supports_meta_init(model)
        if not supports_meta_init(model):  # e.g. a transformers model as-is: built in full, the same on every rank
            model = build_model(self.cfg, self.tokenizer, self.seq_length)
        elif not self.meta_init:  # the full model on every rank, with the values the meta path gives
            materialize_(model, model, torch.device("cpu"), seed=t.seed, pretrained=self._pretrained_source(model))
        stage_ids = validate_layout(self.dims, model, t.dist, t.zero_optimization, self.seq_length,
                                    self.num_accumulation_steps)

        init_distributed(self.device, timeout_minutes=t.dist.get("timeout_minutes", 10.0))
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        # A gloo group used only to find unresponsive ranks when a collective fails (works beside NCCL too).
        self.health_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        if self.world_size > 1 and self.checkpointer.async_save:
            self.checkpointer.async_group = dist.new_group(backend="gloo")
        coord = self.mesh.get_coordinate() if self.mesh is not None else [0, 0, 0]
        self.pp_rank, self.dp_rank, self.tp_rank = coord
        attention_layers = getattr(model, "attention_layers", getattr(model, "num_layers", 0))  # T5: enc + dec
        self.flops_per_token = flops_per_token(
            count_matmul_params(model), attention_layers, getattr(model, "hidden_size", 0), self.seq_length,
        )
        self.model_name = type(model).__name__
        self.pretrained_path = getattr(model, "pretrained_path", None)
        self.main_input_name = getattr(model, "main_input_name", "input_ids")
        self._stage_loss_fn = getattr(type(model), "pipeline_loss", causal_lm_loss)
        self.num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        self.model_parts, self.schedule, self.stage_flags = self._build_parts(model, stage_ids)
        if self._pretrained_checkpoint is not None:  # each rank reads the chunks of its own shards (DCP)
            ckpt = self._pretrained_checkpoint
            Checkpointer(ckpt.parent, rank=self.rank).load_model(ckpt, self.model_parts)
        self.model = self.model_parts[0]
        self.tied_copies, tied = tied_parameters(self.model_parts)
        self.tied_group = self._tied_group() if stage_ids is not None and getattr(model, "tie_word_embeddings", False) else None
        self.tied_params = tied
        del model
        # Dropout after initialisation: masks differ across data-parallel ranks (they see different samples)
        # and agree across tensor-parallel peers (they hold the same replicated activations).
        torch.manual_seed(t.seed + 1_000_003 * self.dp_rank)

        self.optimizers = [self._build_optimizer(part) for part in self.model_parts]
        self.schedulers = [
            instantiate(with_kwargs(t.scheduler, optimizer=opt, max_iter=t.train_iter)) for opt in self.optimizers
        ]
        self.sampler = ResumableBatchSampler(
            len(self.train_ds), self.global_batch_size, self.micro_batch_size,
            data_parallel_rank=self.dp_rank, data_parallel_size=self.dims.data_parallel_size, seed=t.seed,
        )
        self.scaler = self._build_grad_scaler()
        self.step = 0
        self.skipped_steps = 0  # updates dropped for a non-finite gradient under nan_policy="skip"
        self._activity = "before the first step"  # where the loop is, for DistributedFailure messages
        self.tokens_per_step = self.global_batch_size * self.seq_length
        self.peak_flops, self.peak_source = device_peak_flops(
            self.device, self.amp_dtype or torch.float32, t.get("peak_tflops")
        )

    # ------------------------------------------------------------- building
    def _find_resume_checkpoint(self, resume: bool | str) -> Optional[Path]:
        latest = self.checkpointer.latest()
        if resume == "auto":
            return latest
        if resume:
            return _latest_for_resume(self.checkpointer)
        _check_fresh_output_dir(self.output_dir)
        return None

    def _build_parts(self, model, stage_ids):
        """Split into this rank's pipeline stages (or keep whole) and parallelize each part."""
        t = self.cfg.train
        pp = self.dims.pipeline_parallel_size
        if stage_ids is None:
            parts = {0: model}
            num_stages = 1
        else:
            v = t.dist.get("virtual_pipeline_size", 1) or 1
            num_stages = pp * v
            mine = range(self.pp_rank, num_stages, pp)
            # A full model built on this rank (not on meta) is cut in place when the rank holds one stage:
            # a copy per stage would hold the whole model twice until start-up ends.
            in_place = not self.meta_init and len(mine) == 1
            parts = {s: build_stage_module(model, s, num_stages, stage_ids, in_place=in_place) for s in mine}
        stage_mesh = self.mesh["data", "tensor"] if self.mesh is not None else None
        zero = t.zero_optimization
        for part in parts.values():
            if not self.meta_init:
                part.to(self.device)
            parallelize(
                part, stage_mesh,
                tensor_parallel=self.dims.tp_enabled,
                sequence_parallel=bool(t.dist.get("sequence_parallel")),
                data_parallel=self.dims.dp_enabled,
                zero_stage=zero.stage if zero.enabled else None,
                activation_checkpoint=t.activation_checkpoint.enabled,
                compile=t.get("compile", {}).get("enabled", False),
            )
            if self.meta_init:
                source = self._pretrained_source(model)
                # A checkpoint loaded next (--resume, or a dufu run as model.pretrained) sets every parameter:
                # no random values are drawn for them.
                fresh = self.resume_from is None and self._pretrained_checkpoint is None
                materialize_(part, model, self.device, seed=t.seed, pretrained=source, init_parameters=fresh)
        flags = {"first": 0 in parts, "last": (num_stages - 1) in parts}
        schedule = None
        if stage_ids is not None:
            stages = make_stages(parts, num_stages, self.device, self.mesh.get_group("pipeline"))
            schedule = build_schedule(t.dist.get("pipeline_schedule", "1f1b"), stages,
                                      self.num_accumulation_steps, self._pipeline_loss)
        return [parts[s] for s in sorted(parts)], schedule, flags

    def _pretrained_source(self, model):
        """The reader of ``model.pretrained`` weights for a part when they are a Hugging Face directory, or None:
        no such source, resuming (the checkpoint replaces every weight), or a dufu run, whose checkpoint all
        ranks read together once the parts exist (``_pretrained_checkpoint``, Checkpointer.load_model)."""
        path = getattr(model, "pretrained_path", None)
        if path is None or self.resume_from is not None:
            return None
        *_, checkpoint = check_pretrained(model, path)
        if checkpoint is not None:
            self._pretrained_checkpoint = checkpoint
            return None
        return lambda part: pretrained_source(part, path)

    def _tied_group(self):
        """Process groups joining first and last pipeline stage at equal (data, tensor) coordinates."""
        ranks = self.mesh.mesh  # (pp, dp, tp) tensor of global ranks
        mine = None
        for d in range(ranks.shape[1]):
            for tt in range(ranks.shape[2]):
                members = [int(ranks[0, d, tt]), int(ranks[-1, d, tt])]
                group = dist.new_group(members)
                if self.rank in members:
                    mine = group
        return mine

    def _build_optimizer(self, part):
        optim_cfg = copy.deepcopy(self.cfg.optim)
        if isinstance(optim_cfg.get("params"), dict) and "_target_" in optim_cfg.params:
            optim_cfg.params.model = part
        else:
            optim_cfg.params = list(part.parameters())
        return instantiate(optim_cfg)

    def _build_grad_scaler(self):
        """Dynamic loss scaling for fp16 only; bf16 has fp32's exponent range and needs none."""
        return DynamicLossScaler() if self.amp_dtype == torch.float16 else None

    def _pipeline_loss(self, output, target):
        # The schedule divides each micro-batch's loss by their number; this weight makes the sum the mean
        # over the global batch's targets (see _target_weight).
        weight = self._target_weight({"labels": target}) * self.num_accumulation_steps
        loss = self._stage_loss_fn(output, target) * weight
        # The schedule runs backward itself, so fp16 loss scaling happens here (undone for logging).
        return loss * self.scaler.scale if self.scaler is not None else loss

    def _count_global_targets(self, batches: list[dict]) -> None:
        """The number of targets in the global batch whose local part is ``batches``, for _target_weight:
        summed over data-parallel ranks (tensor and pipeline peers hold the same samples)."""
        n = sum(count_loss_targets(b).to(self.device, torch.float64) for b in batches)
        if self.dims.data_parallel_size > 1:
            dist.all_reduce(n, group=self.mesh.get_group("data"))
        self._global_targets = max(float(n.item()), 1.0)

    def _target_weight(self, inputs: dict) -> float:
        """The weight of a micro-batch's mean loss so that the losses summed over the step's micro-batches and
        averaged over data-parallel ranks (as gradients are) give the mean over all the global batch's targets,
        not the mean of micro-batch means: gradient accumulation and data parallelism then equal one big batch
        when micro-batches hold different numbers of targets (masked LM, SFT with prompt masking)."""
        return float(count_loss_targets(inputs)) * self.dims.data_parallel_size / self._global_targets

    # ------------------------------------------------------------ one step
    def autocast(self, amp: bool = True, loss: bool = True):
        """Mixed precision (``amp``) and, under tensor parallelism, the vocabulary-parallel ``loss``, which must
        also hold for the loss's backward (while autocast should not). Not to be nested in itself."""
        ctx = contextlib.ExitStack()
        if self.amp_dtype is not None and amp:
            ctx.enter_context(torch.autocast(self.device.type, dtype=self.amp_dtype))
        if self.dims.tp_enabled and loss:
            # Cross entropy on vocabulary-sharded logits: no rank gathers the full (B, T, V) tensor.
            from torch.distributed.tensor.parallel import loss_parallel

            ctx.enter_context(loss_parallel())
        return ctx

    def _pipeline_io(self, inputs: dict) -> tuple[tuple, dict, torch.Tensor]:
        """This rank's positional inputs (the main input on the first stage, none elsewhere), the keyword
        inputs every stage gets (masks, token types ...) and the last stage's target."""
        first, kwargs, target = split_pipeline_batch(self.model_parts[0], inputs, self.main_input_name)
        return (first if self.stage_flags["first"] else ()), kwargs, target

    def _set_gradient_sync(self, enabled: bool) -> None:
        for part in self.model_parts:
            if hasattr(part, "set_requires_gradient_sync"):
                part.set_requires_gradient_sync(enabled)

    def _batch(self, dataset, indices):
        return {k: v.to(self.device, non_blocking=True) for k, v in to_model_inputs(collate(dataset, indices)).items()}

    def forward_backward(self, micro_batches: list[list[int]]) -> torch.Tensor:
        """This rank's share of the global-batch mean loss, with gradients accumulated (not yet synced)."""
        n = len(micro_batches)
        if self.schedule is not None:
            inputs = self._batch(self.train_ds, [i for mb in micro_batches for i in mb])
            self._count_global_targets([inputs])
            args, kwargs, target = self._pipeline_io(inputs)
            losses = []
            with self.autocast():
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            if not self.stage_flags["last"]:
                return torch.zeros((), device=self.device)
            scale = self.scaler.scale if self.scaler is not None else 1.0
            return torch.stack([local_scalar(l) for l in losses]).mean() / scale
        batches = [self._batch(self.train_ds, indices) for indices in micro_batches]
        self._count_global_targets(batches)
        total = torch.zeros((), device=self.device)
        for i, inputs in enumerate(batches):
            self._set_gradient_sync(i == n - 1)  # reduce gradients once, after the last micro-batch
            weight = self._target_weight(inputs)
            with self.autocast(amp=False):  # the vocabulary-parallel loss, for forward and backward
                with self.autocast(loss=False):  # mixed precision for the forward only
                    loss = self.model(**inputs).loss * weight
                (loss * self.scaler.scale if self.scaler else loss).backward()  # outside autocast (torch's advice)
            total += local_scalar(loss)
        return total

    def _non_finite_message(self, what: str) -> str:
        """Name the step and the first parameters whose gradients are not finite, gathered from all ranks."""
        bad = []
        for part in self.model_parts:
            for name, p in part.named_parameters():
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    if not bool(torch.isfinite(g).all()):
                        bad.append(name)
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, bad)
            bad = sorted({n for names in gathered for n in names})
        named = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return (
            f"non-finite values at step {self.step + 1}: {what}"
            f"{'; gradients of ' + named + ' contain inf/NaN' if bad else ''}. Lower optim.lr, check the data, "
            "use train.amp.dtype=bf16 instead of fp16, or set train.nan_policy=skip to drop such updates."
        )

    def reduce_loss(self, local: torch.Tensor) -> float:
        """Mean over the global batch: average over data-parallel ranks of the last pipeline stage."""
        if self.world_size == 1:
            return local.item()
        share = local.float() * (1.0 if self.stage_flags["last"] else 0.0)
        share = share / (self.dims.data_parallel_size * self.dims.tensor_parallel_size)
        dist.all_reduce(share)
        return share.item()

    def train_step(self, micro_batches: list[list[int]]) -> tuple[float, float]:
        """Forward/backward over one global batch, clip, update. Returns (loss, grad_norm)."""
        for part in self.model_parts:
            part.train()
        local_loss = self.forward_backward(micro_batches)
        if faults.should_fire("nan", self.step + 1):
            for part in self.model_parts:
                for p in part.parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
                        break
            local_loss = local_loss * float("nan")
        sync_tied_gradients(self.tied_params, self.tied_group)
        self.last_lr = self.optimizers[0].param_groups[0]["lr"]  # the rate this step is taken with
        max_norm = self.cfg.train.get("clip_grad_norm") or None
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.mesh.get_group("pipeline") if self.schedule is not None else None
        grad_norm = clip_grad_norm_(params, max_norm, pp_group=pp_group, skip=self.tied_copies,
                                    grad_scale=self.scaler.scale if self.scaler else 1.0)
        overflow = not torch.isfinite(grad_norm)  # the same verdict on every rank: the norm is global
        if self.scaler:
            self.scaler.update(overflow)  # fp16 overflow is routine: skip the step, the scale backs off
        elif overflow:
            if self.cfg.train.get("nan_policy", "stop") == "stop":
                raise DufuError(self._non_finite_message(f"the gradient norm is {grad_norm.item()}"))
            self.skipped_steps += 1
        for opt in self.optimizers:
            if not overflow:
                opt.step()
            opt.zero_grad(set_to_none=True)
        for sched in self.schedulers:
            sched.step()
        return self.reduce_loss(local_loss), grad_norm.item()

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean validation loss and perplexity over the first ``eval_iter`` global batches of the validation set.

        The validation samples are split over ranks exactly like training batches, so the number is the same
        in every layout."""
        ev = self.cfg.train.evaluation
        G = self.global_batch_size
        n_batches = min(ev.get("eval_iter", 20), len(self.valid_ds) // G)
        for part in self.model_parts:
            part.eval()
        per_rank = G // self.dims.data_parallel_size
        total = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device)  # classification: one label per sample
        classification = False
        for b in range(n_batches):
            start = b * G + self.dp_rank * per_rank
            indices = list(range(start, start + per_rank))
            inputs = self._batch(self.valid_ds, indices)
            self._count_global_targets([inputs])  # each batch's loss: the mean over its targets, as in training
            labels = inputs.get("labels")
            # one class label per sample: accuracy too (decided from the batch, so alike on every rank)
            classification = labels is not None and labels.dim() == 1 and not labels.is_floating_point()
            with self.autocast():
                if self.schedule is not None:
                    losses = []
                    args, kwargs, target = self._pipeline_io(inputs)
                    logits = self.schedule.eval(*args, target=target, losses=losses, **kwargs)
                    if self.stage_flags["last"]:
                        scale = self.scaler.scale if self.scaler is not None else 1.0
                        total += torch.stack([local_scalar(l) for l in losses]).mean() / scale
                        if classification:
                            correct += self._correct(logits, target) / G
                else:
                    for k in range(0, per_rank, self.micro_batch_size):
                        mb = {key: v[k:k + self.micro_batch_size] for key, v in inputs.items()}
                        out = self.model(**mb)
                        total += local_scalar(out.loss) * self._target_weight(mb)
                        if classification:
                            correct += self._correct(out.logits, mb["labels"]) / G
        for part in self.model_parts:
            part.train()
        mean = self.reduce_loss(total) / n_batches
        result = {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_samples": n_batches * G}
        if classification:
            result["eval_accuracy"] = self.reduce_loss(correct * self.dims.data_parallel_size) / n_batches
        return result

    @staticmethod
    def _correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """How many samples' arg-max class is their label."""
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        return (logits.argmax(-1) == labels).sum().float()

    # ------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        state = {
            "step": self.step,
            # Only the step count: the schedule is a function of it, and per-group state would tie the
            # checkpoint to this layout's parameter groups.
            "scheduler": {"last_epoch": self.schedulers[0].last_epoch},
            "sampler": self.sampler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(
            self.step, self.model_parts, self.optimizers, self.trainer_state(),
            extra_meta={"layout": self.dims.describe(), "global_batch_size": self.global_batch_size},
            config_text=LazyConfig.to_yaml(self.cfg) if self.is_main else None,
        )

    def load_checkpoint(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model_parts, self.optimizers)
        self.step = int(state["step"])
        for sched in self.schedulers:
            sched.last_epoch = int(state["scheduler"]["last_epoch"])
            for group, base_lr, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base_lr * factor(sched.last_epoch)
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])

    # ------------------------------------------------------------ samples
    def sample_text(self) -> list[tuple[str, str]]:
        """A few generated continuations (all ranks take part under TP/FSDP; not under pipeline parallelism)."""
        g = self.cfg.train.get("generation", {})
        if not g.get("enabled", False) or self.schedule is not None:
            return []
        out = []
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        for prompt in g.get("prompts", []):
            ids = torch.tensor([self.tokenizer.encode(prompt)], device=self.device)
            ctx = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else contextlib.nullcontext()
            with ctx:
                full = generate(
                    self.model, ids, g.get("max_new_tokens", 64), temperature=g.get("temperature", 0.8),
                    top_k=g.get("top_k"), top_p=g.get("top_p"),
                    max_context=getattr(self.model, "max_position_embeddings", None), generator=gen,
                )
            out.append((prompt, self.tokenizer.decode(full[0, ids.shape[1]:].tolist())))
        return out

    # ------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Run the loop; in a multi-process job a failed or timed-out collective becomes an error that names
        this rank and step (another rank died or hangs) instead of a hang or a wall of traceback."""
        if self.world_size == 1:
            return self._train()
        try:
            return self._train()
        except DufuError:
            raise
        except (RuntimeError, dist.DistError) as e:
            if not _looks_distributed(e):
                raise
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            timeout = self.cfg.train.dist.get("timeout_minutes", 10.0)
            raise DistributedFailure(
                f"rank {self.rank} stopped {self._activity}: a collective operation with the other ranks "
                f"failed or waited longer than train.dist.timeout_minutes={timeout}. {self._unresponsive_ranks()}"
                f"Cause: {first[:300]}"
            ) from e

    def _unresponsive_ranks(self) -> str:
        """Which ranks no longer respond: every surviving rank meets at a monitored barrier on a separate gloo
        group, and rank 0 learns who did not arrive."""
        import datetime

        if self.health_group is None:
            return ""
        try:
            seconds = max(5.0, min(30.0, 60.0 * self.cfg.train.dist.get("timeout_minutes", 10.0)))
            dist.monitored_barrier(group=self.health_group, timeout=datetime.timedelta(seconds=seconds),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            msg = " ".join(str(e).split())
            import re

            found = re.search(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier", msg)
            if found:
                return f"Rank(s) {found.group(1).strip()} did not respond: they died or hang. "
            return "Another rank died or hangs (see its own message above). "
        return "All ranks still respond; see the other ranks' messages above. "

    def _train(self) -> dict:
        t = self.cfg.train
        if self.world_size > 1:
            dist.barrier()  # every rank has checked output_dir before rank 0 writes to it
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
            self.log(f"resumed from {self.resume_from} (step {self.step})")
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            LazyConfig.save(self.cfg, self.output_dir / "config.yaml")
            self.tokenizer.save(str(self.output_dir / "tokenizer.json"))
            self.log(self.describe())
        writer = MetricsWriter(self.output_dir, tensorboard=t.get("tensorboard", True),
                               resume_step=self.step if self.resume_from else None) if self.is_main else None
        eval_enabled = t.evaluation.enabled and self.valid_ds is not None
        if eval_enabled and self.step == 0:
            first = self.evaluate()
            writer and writer.write({"step": 0, **first})
            self.log(f"step 0: validation loss {first['eval_loss']:.4f}, perplexity {first['eval_ppl']:.1f}")
        bar = ProgressBar(t.train_iter, initial=self.step, enabled=self.is_main)
        start_step, t_start, t_last = self.step, time.perf_counter(), time.perf_counter()
        window_steps, mfus = 0, []
        stop_reason = None
        while self.step < t.train_iter:
            self._activity = f"at step {self.step + 1}"
            faults.at_step_start(self.step + 1)
            loss, grad_norm = self.train_step(self.sampler.next_step())
            self.step += 1
            window_steps += 1
            if not math.isfinite(loss) and t.get("nan_policy", "stop") == "stop":
                bar.close()
                raise DufuError(
                    f"the loss became {loss} at step {self.step}. Lower optim.lr, enable train.clip_grad_norm, "
                    "use train.amp.dtype=bf16 instead of fp16, or set train.nan_policy=skip."
                )
            if self.step % t.log_period == 0 or self.step == t.train_iter:
                now = time.perf_counter()
                tokens_per_s = self.tokens_per_step * window_steps / (now - t_last)
                mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
                mfus.append(mfu)
                record = {
                    "step": self.step, "loss": loss, "lr": self.last_lr,
                    "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
                    "step_time_s": (now - t_last) / window_steps,
                    "consumed_samples": self.sampler.state_dict()["consumed_samples"],
                }
                if self.skipped_steps:
                    record["skipped_steps"] = self.skipped_steps
                if self.scaler is not None:
                    record["loss_scale"] = self.scaler.scale
                    record["skipped_steps"] = self.scaler.skipped_steps
                writer and writer.write(record)
                t_last, window_steps = now, 0
                bar.update(0, loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", **{"tok/s": f"{tokens_per_s:,.0f}"},
                           mfu=f"{100 * mfu:.1f}%")
            bar.update(1)
            if eval_enabled and (self.step % t.evaluation.eval_period == 0 or self.step == t.train_iter):
                self._activity = f"while evaluating after step {self.step}"
                ev = self.evaluate()
                writer and writer.write({"step": self.step, **ev})
                acc = f", accuracy {100 * ev['eval_accuracy']:.1f}%" if "eval_accuracy" in ev else ""
                bar.write(f"step {self.step}: validation loss {ev['eval_loss']:.4f}, perplexity {ev['eval_ppl']:.1f}{acc}")
            stop_reason = self._stop_reason(t_start)
            period = t.checkpointer.period
            if (period and self.step % period == 0) or self.step == t.train_iter or stop_reason:
                self._activity = f"while saving the checkpoint of step {self.step}"
                path = self.save_checkpoint()
                bar.write(f"step {self.step}: {'saving' if self.checkpointer.async_save else 'saved'} checkpoint {path}")
            if stop_reason:
                break
        self.checkpointer.wait()
        bar.close()
        if stop_reason:
            self.log(f"stopped at step {self.step} of {t.train_iter}: {stop_reason}. The checkpoint is complete; "
                     f"continue with: dufu train {self.output_dir / 'config.yaml'} --resume")
        elapsed = time.perf_counter() - t_start
        summary = {"steps": self.step - start_step, "seconds": elapsed, "final_step": self.step}
        samples = self.sample_text()  # every rank takes part (tensor-parallel forward)
        if self.is_main:
            writer.close()
            records = read_metrics(self.output_dir / "metrics.jsonl")
            train_recs = [r for r in records if "loss" in r]
            evals = [r for r in records if "eval_loss" in r]
            summary.update(
                final_loss=train_recs[-1]["loss"] if train_recs else None,
                eval_ppl_start=evals[0]["eval_ppl"] if evals else None,
                eval_ppl_end=evals[-1]["eval_ppl"] if evals else None,
                mean_tokens_per_s=(self.tokens_per_step * summary["steps"] / elapsed) if elapsed > 0 else None,
                mean_mfu=(sum(mfus) / len(mfus)) if mfus else None,
                samples=samples,
            )
            plot_loss_curve(self.output_dir / "metrics.jsonl", self.output_dir / "loss.png",
                            title=f"{self.model_name} - {self.dims.describe()}")
            self.log(self.summary_text(summary))
        return summary

    def _stop_reason(self, t_start: float) -> Optional[str]:
        """train.stop_at_iter / stop_after_minutes; the time verdict is rank 0's, shared with all ranks."""
        t = self.cfg.train
        if self.step >= t.train_iter:
            return None
        if t.get("stop_at_iter") and self.step == t.stop_at_iter:  # reached in this run (a resume goes past it)
            return f"train.stop_at_iter={t.stop_at_iter}"
        minutes = t.get("stop_after_minutes")
        if minutes:
            over = torch.tensor(float((time.perf_counter() - t_start) / 60.0 >= minutes))
            if self.world_size > 1:
                dist.broadcast(over, src=0)
            if over.item():
                return f"train.stop_after_minutes={minutes}"
        return None

    # ------------------------------------------------------------ people
    def describe(self) -> str:
        t = self.cfg.train
        amp = f"{t.amp.dtype} autocast" if t.amp.enabled else "fp32"
        zero = f", ZeRO stage {t.zero_optimization.stage}" if t.zero_optimization.enabled else ""
        extras = []
        if t.dist.get("sequence_parallel"):
            extras.append("sequence parallel")
        if self.schedule is not None:
            extras.append(f"{t.dist.get('pipeline_schedule')} schedule")
        if t.activation_checkpoint.enabled:
            extras.append("activation checkpointing")
        return "\n".join([
            f"dufu: {self.model_name} with {self.num_parameters / 1e6:.2f}M parameters on "
            f"{self.device.type} ({amp})",
            f"  layout       {self.dims.describe()}{zero}{'; ' + ', '.join(extras) if extras else ''}",
            f"  batch        global {self.global_batch_size} = micro {self.micro_batch_size} x dp "
            f"{self.dims.data_parallel_size} x accumulation {self.num_accumulation_steps}; "
            f"{self.tokens_per_step:,} tokens/step",
            f"  data         {len(self.train_ds):,} training samples, "
            f"{len(self.valid_ds) if self.valid_ds is not None else 0:,} validation samples; tokenizer vocab "
            f"{self.tokenizer.vocab_size:,}",
            f"  MFU          {self.flops_per_token / 1e6:,.1f} MFLOP/token (6N + 12*L*H*T); peak {self.peak_source}",
            self._weights_line(),
            f"  output       {self.output_dir}",
        ])

    def _weights_line(self) -> str:
        """Where the weights come from and how much of the model this rank holds (people read it on rank 0)."""
        if self.resume_from is not None:
            source = f"from checkpoint {self.resume_from.name}"
        elif self.pretrained_path is not None:
            source = f"pretrained, {self.pretrained_path}"
        else:
            source = f"random init (seed {self.cfg.train.seed})"
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                   for p in {id(p): p for part in self.model_parts for p in part.parameters()}.values())
        build = "built on the meta device" if self.meta_init else "built in full on every rank"
        return f"  weights      {source}; {build}, rank {self.rank} holds {held / 1e6:.2f}M parameters"

    def summary_text(self, s: dict) -> str:
        lines = ["", "=" * 72, f"finished: {s['steps']} steps in {s['seconds']:.1f} s (now at step {s['final_step']})"]
        if s.get("final_loss") is not None:
            lines.append(f"  final train loss     {s['final_loss']:.4f}")
        if s.get("eval_ppl_start") is not None:
            ratio = s["eval_ppl_start"] / s["eval_ppl_end"]
            lines.append(
                f"  validation ppl       {s['eval_ppl_start']:.1f} -> {s['eval_ppl_end']:.2f}  ({ratio:.1f}x lower)"
            )
        if s.get("mean_tokens_per_s"):
            lines.append(f"  throughput           {s['mean_tokens_per_s']:,.0f} tokens/s, MFU {100 * (s['mean_mfu'] or 0):.1f}%")
        lines.append(f"  written to           {self.output_dir}/ (config.yaml, metrics.jsonl, loss.png, tensorboard/, checkpoints/)")
        for prompt, text in s.get("samples", []):
            lines.append("-" * 72)
            lines.append(f"{prompt}\u2502{text}")
        lines.append("=" * 72)
        return "\n".join(lines)
