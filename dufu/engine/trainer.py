"""The Trainer: a constructor that only wires parts together, and one readable training loop.

The same loop runs every layout. What changes with ``train.dist``/``zero_optimization``:

* the model is split into pipeline-stage parts (``self.model_parts``; one part without PP),
* each part is parallelized (TP -> activation checkpointing -> compile -> FSDP/replicate),
* a step runs either the micro-batch loop (no PP) or a pipeline schedule over the same micro-batches,
* the logged loss is reduced to the mean over the global batch in every layout.

Where the parts live: the start-up checks and the meta model in :mod:`dufu.engine.preflight` (shared with
``dufu train --nproc``), building the model parts in :mod:`dufu.parallel.build`, evaluation in
:mod:`dufu.engine.evaluation`, what people read in :mod:`dufu.engine.report`, failure messages in
:mod:`dufu.engine.diagnose`.
"""

from __future__ import annotations

import contextlib, copy, functools, math, time  # noqa: E401
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from dufu.config import LazyConfig, instantiate
from dufu.data import ResumableBatchSampler, collate
from dufu.engine import diagnose, fault_tolerance, faults, report
from dufu.engine.batch import count_loss_targets, local_scalar, to_model_inputs
from dufu.engine.checkpoint import Checkpointer
from dufu.errors import CheckpointError
from dufu.engine.evaluation import evaluate
from dufu.engine.loss_scaler import DynamicLossScaler
from dufu.engine.precision import agree, choose_precision
from dufu.engine.moe_monitor import MoEMonitor
from dufu.engine.preemption import Preemption, clear_marker, write_marker
from dufu.engine.preflight import model_to_split, plan_run, with_kwargs
from dufu.engine.distill import Teacher
from dufu.parallel import env
from dufu.parallel.build import build_model_parts
from dufu.parallel.context_parallel import build_context_parallel
from dufu.parallel.compile import decide_compile
from dufu.parallel.grads import clip_grad_norm_, sync_tied_gradients
from dufu.parallel.launch import init_distributed
from dufu.parallel.materialize import supports_meta_init
from dufu.parallel.pipeline import split_pipeline_batch


class Trainer:
    """``resume``: False (a new run; output_dir must not hold one), True (continue from the latest
    complete checkpoint), or "auto" (resume if there is a checkpoint, else start over: elastic restarts)."""

    def __init__(self, cfg, resume: bool | str = False, log=print, notices=()):
        self.cfg = cfg
        self.rank, self.local_rank, self.world_size = env.world_info()
        self.is_main = self.rank == 0
        self.log = log if self.is_main else (lambda *a, **k: None)
        plan = plan_run(cfg, self.world_size, resume)  # every check, before any process group or allocation
        t = cfg.train
        self.dims, self.resume_from, self.notices = plan.dims, plan.resume_from, list(notices) + plan.notices
        self.micro_batch_size, self.global_batch_size, self.num_accumulation_steps = plan.batch_sizes
        self.tokenizer, self.train_ds, self.valid_ds = plan.tokenizer, plan.train_ds, plan.valid_ds
        self.seq_length, self.tokens_per_step = plan.seq_length, self.global_batch_size * plan.seq_length
        self.device = env.pick_device(self.local_rank) if t.get("device", "auto") == "auto" else torch.device(t.device)
        self.output_dir = Path(t.output_dir)
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", t.checkpointer.max_to_keep, self.rank,
                                         async_save=t.checkpointer.get("async_save", False))
        self.pretrained, self.scheduler_node = plan.pretrained, plan.scheduler
        self.delta = getattr(plan.model, "delta_info", None)  # a delta run (dufu.delta): only the delta trains
        if self.delta is not None:
            self.checkpointer.set_delta_only()
        self.meta_init = t.get("meta_init", True) and supports_meta_init(plan.model)
        model = model_to_split(cfg, plan, self.meta_init)
        self.moe = MoEMonitor(self, model)  # load-balance records and the auxiliary losses' scale (MoE models)
        self.model_name, self.main_input_name = type(model).__name__, getattr(model, "main_input_name", "input_ids")
        self.num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        self.flops_per_token = report.model_flops_per_token(model, self.seq_length)
        self.stage_loss_fn = getattr(type(model), "pipeline_loss", None)  # plan_run checked it under PP

        init_distributed(self.device, timeout_minutes=t.dist.get("timeout_minutes", 10.0))
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        self.expert_mesh = self.dims.build_expert_mesh(self.device.type) if self.dims.ep_enabled else None
        # A gloo group used only to find unresponsive ranks when a collective fails (works beside NCCL too).
        self.health_group = dist.new_group(backend="gloo") if self.world_size > 1 else None
        self.pp_rank, data_rank, self.tp_rank = self.mesh.get_coordinate() if self.mesh is not None else (0, 0, 0)
        # the mesh's data axis is dp x cp (cp inner): this rank's samples are those of data rank data_rank // cp
        self.dp_rank, self.cp = divmod(data_rank, self.dims.context_parallel_size)[0], build_context_parallel(self)
        # The dtype: rank 0 measures the device (train.amp.enabled="auto" picks the faster), every rank follows.
        self.precision = agree(choose_precision(t.amp.enabled, t.amp.dtype, self.device, t.get("peak_tflops"))
                               if self.is_main else None, self.health_group)
        self.amp_dtype, self.peak_flops, self.peak_source = (self.precision.dtype, self.precision.peak_flops,
                                                             self.precision.peak_source)
        self.notices += [self.precision.notice] if self.precision.notice else []
        # train.compile.enabled: True, False or "auto" (dufu.parallel.compile.decide_compile); every rank decides
        # alike from the same inputs
        self.compile = decide_compile(t.compile.enabled, self.device, train_iter=t.train_iter,
                                      amp_dtype=self.amp_dtype)
        self.notices += [self.compile.notice] if self.compile.notice else []
        self.parts = self._build_parts(model, plan.stage_ids)
        self.model_parts, self.schedule, self.model = self.parts.modules, self.parts.schedule, self.parts.modules[0]
        del model, plan
        # knowledge distillation: a teacher split like this model (dufu.engine.distill)
        self.teacher = Teacher(instantiate(cfg.distill), self) if cfg.get("distill") is not None else None
        self.notices += [self.teacher.describe()] if self.teacher else []
        # Dropout after initialisation: masks differ across data-parallel ranks (they see different samples)
        # and agree across tensor-parallel peers (they hold the same replicated activations).
        torch.manual_seed(t.seed + 1_000_003 * self.dp_rank)

        self.optimizers = [self._build_optimizer(part) for part in self.model_parts]
        self.schedulers = [instantiate(with_kwargs(self.scheduler_node, optimizer=opt)) for opt in self.optimizers]
        self.sampler = ResumableBatchSampler(
            len(self.train_ds), self.global_batch_size, self.micro_batch_size,
            data_parallel_rank=self.dp_rank, data_parallel_size=self.dims.data_parallel_size, seed=t.seed,
            shuffle=not getattr(self.train_ds, "orders_samples", False))  # a blend orders its own (data.blend)
        self.scaler = (DynamicLossScaler(**t.amp.get("loss_scaler", {}))  # bf16 has fp32's range: no scaling
                       if self.amp_dtype == torch.float16 else None)
        self.step, self.last_lr = 0, 0.0
        self.skipped_steps = 0  # updates dropped for a non-finite gradient under nan_policy="skip"
        self.activity = "before the first step"  # where the loop is, for DistributedFailure messages
        self.eval_enabled = bool(t.evaluation.enabled) and self.valid_ds is not None
        self.preemption, self.preempted = Preemption(t.preemption.get("enabled", True)), None  # SIGTERM, SIGUSR1
        faults.install(self)  # DUFU_FAULT's test faults (a no-op without it)
        fault_tolerance.install(self)  # train.fault_tolerance: a replica group on torchft (a no-op without it)

    # ------------------------------------------------------------- building
    def _build_parts(self, model, stage_ids):
        t, zero = self.cfg.train, self.cfg.train.zero_optimization
        parts = build_model_parts(
            model, self.mesh, self.device, stage_ids=stage_ids, meta_init=self.meta_init, seed=t.seed,
            pretrained=self.pretrained.source,
            # A checkpoint loaded next (--resume, or a dufu run as model.pretrained) sets every parameter; in a
            # delta run it sets only the delta (resumed) or only the base (pretrained), so the rest is filled.
            init_parameters=self.delta is not None or (self.resume_from is None and self.pretrained.checkpoint is None),
            virtual_pipeline_size=t.dist.get("virtual_pipeline_size", 1) or 1,
            pipeline_schedule=t.dist.get("pipeline_schedule", "1f1b"),
            num_microbatches=self.num_accumulation_steps, loss_fn=self._pipeline_loss,
            tensor_parallel=self.dims.tp_enabled, sequence_parallel=bool(t.dist.get("sequence_parallel")),
            data_parallel=self.dims.dp_enabled, zero_stage=zero.stage if zero.enabled else None,
            activation_checkpoint=(t.activation_checkpoint.get("mode", "full")
                                   if t.activation_checkpoint.enabled else None),
            compile=self.compile.enabled, expert_mesh=self.expert_mesh, context_parallel=self.cp,
        )
        if self.pretrained.checkpoint is not None:  # each rank reads the chunks of its own shards (DCP)
            ckpt = self.pretrained.checkpoint
            Checkpointer(ckpt.parent, rank=self.rank).load_model(
                ckpt, parts.modules, skip=frozenset(self.delta.added) if self.delta is not None else frozenset())
        if self.delta is not None:  # DoRA's magnitudes start from the base weights now in place
            from dufu.delta.lora import init_dora_magnitudes

            init_dora_magnitudes(parts.modules)
        return parts

    def _build_optimizer(self, part):
        optim_cfg = copy.deepcopy(self.cfg.optim)
        if isinstance(optim_cfg.get("params"), dict) and "_target_" in optim_cfg.params:
            optim_cfg.params.model = part
        else:
            optim_cfg.params = [p for p in part.parameters() if p.requires_grad] or [{"params": []}]
        return instantiate(optim_cfg)

    # ------------------------------------------------------------ the loss over the global batch
    def _pipeline_loss(self, output, target):
        # The schedule divides each micro-batch's loss by their number; this weight makes the sum the mean
        # over the global batch's targets (see target_weight). Distillation: the target carries the teacher's logits.
        loss, target = self.teacher.stage_loss(output, target) if self.teacher else (self.stage_loss_fn(output, target),
                                                                                      target)
        loss = self.weighted(loss, {"labels": target}) * self.num_accumulation_steps
        # The schedule runs backward itself, so fp16 loss scaling happens here (undone for logging).
        return loss * self.scaler.scale if self.scaler is not None else loss

    def count_global_targets(self, batches: list[dict]) -> None:
        """The number of targets in the global batch whose local part is ``batches``, for target_weight:
        summed over data-parallel ranks (tensor and pipeline peers hold the same samples)."""
        n = sum(count_loss_targets(b).to(self.device, torch.float64) for b in batches)
        if self.dims.data_axis_size > 1:  # (with context parallelism, each rank counts its chunks' targets)
            dist.all_reduce(n, group=self.mesh.get_group("data"))
        self._global_targets = max(float(n.item()), 1.0)

    def target_weight(self, inputs: dict) -> float:
        """The weight of a micro-batch's mean loss so that the losses summed over the step's micro-batches and
        averaged over data-parallel ranks (as gradients are) give the mean over all the global batch's targets,
        not the mean of micro-batch means: gradient accumulation and data parallelism then equal one big batch
        when micro-batches hold different numbers of targets (masked LM, SFT with prompt masking)."""
        return float(count_loss_targets(inputs)) * self.dims.data_axis_size / self._global_targets

    def weighted(self, loss: torch.Tensor, inputs: dict) -> torch.Tensor:
        """``loss`` x :meth:`target_weight`. A micro-batch without targets (a context-parallel chunk of prompt or
        padding, whose mean loss is 0 / 0 = nan) adds 0 and a zero gradient, not nan x 0."""
        weight = self.target_weight(inputs)
        return loss * weight if weight else loss.nan_to_num(0.0) * 0.0

    def unscaled_mean(self, losses: list) -> torch.Tensor:
        """The mean of a schedule's micro-batch losses, without the fp16 loss scale _pipeline_loss applied."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return torch.stack([local_scalar(l) for l in losses]).mean() / scale

    def reduce_loss(self, local: torch.Tensor) -> float:
        """Mean over the global batch: average over data-parallel ranks of the last pipeline stage."""
        if self.world_size == 1:
            return local.item()
        share = local.float() * (1.0 if self.parts.last else 0.0)
        share = share / (self.dims.data_axis_size * self.dims.tensor_parallel_size)
        dist.all_reduce(share)
        return share.item()

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

    def pipeline_io(self, inputs: dict) -> tuple[tuple, dict, torch.Tensor]:
        """This rank's positional inputs (the main input on the first stage, none elsewhere), the keyword
        inputs every stage gets (masks, token types ...) and the last stage's target."""
        first, kwargs, target = split_pipeline_batch(self.model, inputs, self.main_input_name)
        return (first if self.parts.first else ()), kwargs, target

    def batch(self, dataset, indices) -> dict:
        """The samples ``indices`` as model inputs on this device; under context parallelism this rank's chunks."""
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in to_model_inputs(collate(dataset, indices)).items()}
        return self.cp.shard_batch(inputs) if self.cp is not None else inputs

    def forward_backward(self, micro_batches: list[list[int]]) -> torch.Tensor:
        """This rank's share of the global-batch mean loss, with gradients accumulated (not yet synced)."""
        if self.schedule is not None:
            inputs = self.batch(self.train_ds, [i for mb in micro_batches for i in mb])
            self.count_global_targets([inputs])
            args, kwargs, target = self.pipeline_io(inputs)
            losses = []
            with self.autocast():
                if self.teacher:  # its logits of these micro-batches first, carried by the target (engine.distill)
                    target = self.teacher.run_pipeline(args, kwargs, target)
                self.schedule.step(*args, target=target, losses=losses, **kwargs)
            return self.unscaled_mean(losses) if self.parts.last else torch.zeros((), device=self.device)
        batches = [self.batch(self.train_ds, indices) for indices in micro_batches]
        self.count_global_targets(batches)
        total = torch.zeros((), device=self.device)
        with self.cast_cache(len(batches)):
            for i, inputs in enumerate(batches):
                self.micro_step(inputs, last=i == len(batches) - 1, total=total)
        return total

    def cast_cache(self, num_micro_batches: int):
        """Keep autocast's low-precision copies of the weights from the first micro-batch's forward to the end
        of the step, so the later micro-batches reuse them instead of casting every weight again (autocast
        drops its cache when the outermost autocast region ends: this outer region, with autocast itself off,
        spans the step). Not under data parallelism: FSDP2 (ZeRO, and DDP through ``replicate``) swaps each
        module's parameters between sharded and gathered tensors around every forward and backward, and the
        cached copies then broke parity with one process (bf16 and fp16 dp2 left its tolerance); under ZeRO-3
        the cache would also hold a copy of every gathered weight. train.amp.cache_weight_casts=False: cast in
        every forward."""
        t = self.cfg.train
        if (self.amp_dtype is None or num_micro_batches < 2 or not t.amp.get("cache_weight_casts", True)
                or self.dims.dp_enabled):  # (ZeRO needs data parallelism: validate_layout)
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, enabled=False)

    def micro_step(self, inputs: dict, last: bool, total: torch.Tensor) -> None:
        """Forward and backward of one micro-batch (gradients reduced after the ``last``); adds its loss to
        ``total``."""
        for part in self.model_parts:  # reduce gradients once, after the last micro-batch
            if hasattr(part, "set_requires_gradient_sync"):
                part.set_requires_gradient_sync(last)
        with self.autocast(amp=False):  # the vocabulary-parallel loss, for forward and backward
            with self.autocast(loss=False):  # mixed precision for the forward only
                loss = self.teacher.loss(self.model, inputs) if self.teacher else self.model(**inputs).loss
                loss = self.weighted(loss, inputs)
            (loss * self.scaler.scale if self.scaler else loss).backward()  # outside autocast (torch's advice)
        total += local_scalar(loss)

    def train_step(self, micro_batches: list[list[int]]) -> tuple[float, float]:
        """Forward/backward over one global batch, clip, update. Returns (loss, grad_norm)."""
        for part in self.model_parts:
            part.train()
        self.moe and self.moe.before_step()
        local_loss = self.forward_backward(micro_batches)
        self.moe and self.moe.after_step()
        sync_tied_gradients(self.parts.tied_params, self.parts.tied_group)
        self.last_lr = self.optimizers[0].param_groups[0]["lr"]  # the rate this step is taken with
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_group = self.mesh.get_group("pipeline") if self.schedule is not None else None
        grad_norm = clip_grad_norm_(params, self.cfg.train.get("clip_grad_norm") or None, pp_group=pp_group,
                                    skip=self.parts.tied_copies, grad_scale=self.scaler.scale if self.scaler else 1.0)
        overflow = not torch.isfinite(grad_norm)  # the same verdict on every rank: the norm is global
        if self.scaler:
            self.scaler.update(overflow)  # fp16 overflow is routine: skip the step, the scale backs off
        elif overflow:
            if self.cfg.train.get("nan_policy", "stop") == "stop":
                raise diagnose.non_finite_gradients(self.model_parts, self.step + 1,
                                                    f"the gradient norm is {grad_norm.item()}", self.world_size)
            self.skipped_steps += 1
        for opt in self.optimizers:
            if not overflow:
                opt.step()
            opt.zero_grad(set_to_none=True)
        for sched in self.schedulers:
            sched.step()
        return self.reduce_loss(local_loss), grad_norm.item()

    def evaluate(self) -> dict:
        return evaluate(self)

    # ------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Run the loop; in a multi-process job a failed or timed-out collective becomes an error that names
        this rank and step (another rank died or hangs) instead of a hang or a wall of traceback."""
        if self.world_size == 1:
            return self._train()
        with diagnose.collective_failures(self.rank, lambda: self.activity,
                                          self.cfg.train.dist.get("timeout_minutes", 10.0), self.health_group):
            return self._train()

    def _train(self) -> dict:
        t = self.cfg.train
        self._begin()
        log = report.RunLog(self)
        if self.eval_enabled and self.step == 0:
            log.evaluation(self.evaluate())
        log.start()
        stop_reason = None
        while self.step < t.train_iter and not stop_reason:
            self.activity = f"at step {self.step + 1}"
            loss, grad_norm = self.train_step(self.sampler.next_step())
            self.step += 1
            # Under fp16 a non-finite loss is an overflow the loss scaler has already skipped and backed off from.
            if not math.isfinite(loss) and self.scaler is None and t.get("nan_policy", "stop") == "stop":
                log.close()
                raise diagnose.non_finite_loss(loss, self.step)
            log.step(loss, grad_norm)
            if self.eval_enabled and (self.step % t.evaluation.eval_period == 0 or self.step == t.train_iter):
                self.activity = f"while evaluating after step {self.step}"
                log.evaluation(self.evaluate())
            stop_reason = self._stop_reason(log.t_start)
            period = t.checkpointer.period
            if (period and self.step % period == 0) or self.step == t.train_iter or stop_reason:
                self.activity = f"while saving the checkpoint of step {self.step}"
                log.checkpoint(self.save_checkpoint())
        self.checkpointer.wait()
        if self.preempted and self.is_main:  # the launcher's exit code reads it (dufu.engine.preemption)
            write_marker(self.output_dir, self.step, self.preempted)
        return log.finish(stop_reason, list if self.preempted else self.sample_text)  # no samples in a grace period

    def _begin(self) -> None:
        """Resume, and (rank 0) write what reproduces the run and show the start-up summary."""
        if self.world_size > 1:
            dist.barrier()  # every rank has checked output_dir before rank 0 writes to it
        if self.resume_from is not None:
            self.load_checkpoint(self.resume_from)
            self.log(f"resumed from {self.resume_from} (step {self.step})")
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            clear_marker(self.output_dir)  # an earlier attempt's preemption is over
            LazyConfig.save(self.cfg, self.output_dir / "config.yaml")
            self.tokenizer.save(str(self.output_dir / "tokenizer.json"))
            self.log(self.describe())

    def _stop_reason(self, t_start: float) -> Optional[str]:
        """Preemption (SIGTERM/SIGUSR1, agreed by all ranks), train.stop_at_iter / stop_after_minutes (the time
        verdict is rank 0's, shared with all ranks)."""
        t = self.cfg.train
        if self.step >= t.train_iter:
            return None
        self.preempted = self.preemption.requested(self.health_group, self.world_size)
        if self.preempted:
            return f"preempted by {self.preempted}"
        if t.get("stop_at_iter") and self.step == t.stop_at_iter:  # reached in this run (a resume goes past it)
            return f"train.stop_at_iter={t.stop_at_iter}"
        minutes = t.get("stop_after_minutes")
        if minutes:
            # On this rank's device: the default group is NCCL on GPUs, which cannot broadcast a CPU tensor.
            over = torch.tensor(float((time.perf_counter() - t_start) / 60.0 >= minutes), device=self.device)
            if self.world_size > 1:
                dist.broadcast(over, src=0)
            if over.item():
                return f"train.stop_after_minutes={minutes}"
        return None

    def describe(self) -> str:
        return report.describe(self)

    # ------------------------------------------------------------ samples
    def sample_text(self) -> list[tuple[str, str]]:
        return report.sample_text(self)

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
            extra_meta={"layout": self.dims.describe(), "global_batch_size": self.global_batch_size,
                        **({"delta": self.delta_base} if self.delta is not None else {})},
            config_text=LazyConfig.to_yaml(self.cfg) if self.is_main else None,
        )

    @functools.cached_property
    def delta_base(self) -> dict:
        """The base of a delta run, recorded with each checkpoint (which holds only the delta)."""
        from dufu.delta.base import base_fingerprint

        return base_fingerprint(self.pretrained.path, self.cfg.train.seed, self.cfg.model)

    def load_checkpoint(self, path: Path) -> None:
        if self.delta is not None:
            saved = self.checkpointer.read_meta(path).get("delta")
            if saved is None:
                raise CheckpointError(f"{path} is not a checkpoint of a delta run (it holds a whole model); resume "
                                      "it without the delta section, or start the delta run in a new output_dir")
            if saved.get("fingerprint") != self.delta_base["fingerprint"]:
                raise CheckpointError(
                    f"{path} holds a delta trained on another base ({saved.get('base') or 'a seeded initialisation'}"
                    f"), not on this run's ({self.delta_base['base'] or 'seeded initialisation, seed ' + str(self.cfg.train.seed)}). "
                    "Set model.pretrained (and train.seed) to the base the delta was trained on.")
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
