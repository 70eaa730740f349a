"""The Trainer: one readable training loop over a :class:`~dufu.engine.runtime.Runtime`, with declared hook points.

The runtime is what the run *is* (the world, the model parts, precision, the teacher); the Trainer adds what
training changes: the optimizers and schedules, the sampler's position, the fp16 loss scale, the step count and
the checkpoints. The same loop runs every layout:

* a step runs either the micro-batch loop (no PP) or a pipeline schedule over the same micro-batches,
* the loss of every micro-batch is weighted so the step's gradient and its logged loss are those of the mean over
  the global batch's targets in every layout (:mod:`dufu.engine.global_loss`),
* features that act on a step are hooks called at named points (:mod:`dufu.engine.hooks`): the MoE monitor,
  torchft replica groups, ``DUFU_FAULT``'s test faults, ``train.hooks`` and ``Trainer(hooks=...)``.

What people read is in :mod:`dufu.engine.reporting.report`; failure messages in :mod:`dufu.engine.diagnose`.
"""

from __future__ import annotations

import contextlib, copy, functools, gc, time  # noqa: E401
from typing import Optional

import torch
import torch.distributed as dist

from dufu.config import LazyConfig, instantiate
from dufu.data import ResumableBatchSampler
from dufu.delta.base import base_fingerprint
from dufu.engine import diagnose
from dufu.engine.reporting import memory, report
from dufu.engine.resilience import fault_tolerance, faults
from dufu.engine.batch import local_scalar
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.resume_checks import as_request, set_aside_later_checkpoints
from dufu.engine.hooks import Hooks, RetryStep
from dufu.engine.moe_balance import load_balance
from dufu.engine.resilience.preemption import Preemption, clear_marker, write_marker
from dufu.engine.precision import NAMES
from dufu.engine.preflight import with_kwargs
from dufu.engine.runtime import Runtime
from dufu.engine.step_stats import StepRecord, StepStats, first_non_finite, first_non_finite_loss
from dufu.errors import CheckpointError, DistributedFailure, DufuError
from dufu.parallel.grads import clip_grad_norm_, sync_tied_gradients
from dufu.parallel.launch import enter_steady_state

MAX_STEP_RETRIES = 1000  # a step a hook asks to take again (RetryStep) this many times stops the run


def training_sampler(runtime) -> ResumableBatchSampler:
    """The order this rank trains on, from the first step: its part of every global batch (a replica group's part
    of the groups' global batch under train.fault_tolerance: the runtime's data_rank / data_size count every
    group's ranks)."""
    rt = runtime
    return ResumableBatchSampler(
        len(rt.train_ds), rt.global_batch_size * rt.replica_groups, rt.micro_batch_size,
        data_parallel_rank=rt.data_rank, data_parallel_size=rt.data_size, seed=rt.cfg.train.seed,
        shuffle=not getattr(rt.train_ds, "orders_samples", False))  # a blend orders its own (data.blend)


class Trainer:
    """``resume``: False (a new run; output_dir must not hold one), True (continue from the latest
    complete checkpoint), "auto" (resume if there is a checkpoint, else start over: elastic restarts), or a
    :class:`~dufu.engine.weights.resume_checks.ResumeRequest` (a named checkpoint, settings allowed to change).
    ``hooks``: :class:`dufu.engine.hooks.Hook` objects, called after dufu's own and ``train.hooks``."""

    def __init__(self, cfg, resume=False, log=print, notices=(), hooks=(), memory_plan=None):
        start_rss = memory.process_rss_bytes()  # what the process held before the run was built
        self.runtime = rt = Runtime(cfg, resume, log=log, notices=notices)
        memory.start_memory_history(rt.device)  # CUDA: the allocator's history, for a snapshot on out of memory
        # memory_plan(dtype=...) -> PlannedMemory: the planner's peak for this run (the command line passes it:
        # dufu.plan sits above the engine); shown beside the measured peaks
        self.start_rss, self.memory_plan, self.planned_memory = start_rss, memory_plan, None
        self.resume_request = as_request(resume)
        self.cfg, self.log = cfg, rt.log
        t = cfg.train
        with rt._phase("optimizer"):
            self.optimizers = [self._build_optimizer(part) for part in rt.model_parts]
            self.schedulers = [instantiate(with_kwargs(rt.scheduler_node, optimizer=opt)) for opt in self.optimizers]
        self.sampler = training_sampler(rt)
        self.checkpointer = Checkpointer(rt.output_dir / "checkpoints", t.checkpointer.max_to_keep, rt.rank,
                                         async_save=t.checkpointer.async_save)
        if rt.delta is not None:
            self.checkpointer.set_delta_only()  # a delta run (dufu.delta): only the delta trains and is saved
        self.step, self.last_lr = 0, 0.0
        # loss, gradient norm and verdicts of the steps not yet read back from the device (dufu.engine.step_stats)
        self.stats = StepStats(rt.device)
        self._loss_parts, self.step_loss_parts = {}, {}  # named parts of the loss: this step's so far, the last's
        self.activity = "before the first step"  # where the loop is, for DistributedFailure messages
        self.eval_enabled = bool(t.evaluation.enabled) and rt.valid_ds is not None
        self.preemption, self.preempted = Preemption(t.preemption.enabled, self.checkpointer), None  # SIGTERM/USR1/INT
        # dufu's own hooks first (the replica groups outermost: their step start comes first, their
        # after-points last), then the config's, then the caller's.
        own = [fault_tolerance.replica_groups(self), faults.training_faults(), rt.moe if rt.moe else None,
               load_balance(self), rt.compile_watch]
        self.hooks = Hooks([h for h in own if h is not None] + [instantiate(h) for h in t.hooks] + list(hooks))

    # the parts of the runtime most code reads through a trainer
    model = property(lambda self: self.runtime.model)
    model_parts = property(lambda self: self.runtime.model_parts)
    device = property(lambda self: self.runtime.device)
    rank = property(lambda self: self.runtime.rank)
    world_size = property(lambda self: self.runtime.world_size)
    is_main = property(lambda self: self.runtime.is_main)
    output_dir = property(lambda self: self.runtime.output_dir)
    dims = property(lambda self: self.runtime.dims)
    scaler = property(lambda self: self.runtime.scaler)

    def _build_optimizer(self, part):
        optim_cfg = copy.deepcopy(self.cfg.optim)
        if isinstance(optim_cfg.get("params"), dict) and "_target_" in optim_cfg.params:
            optim_cfg.params.model = part
        else:
            optim_cfg.params = [p for p in part.parameters() if p.requires_grad] or [{"params": []}]
        return instantiate(optim_cfg)

    # ------------------------------------------------------------ one step
    def forward_backward(self, micro_batches: list[list[int]]) -> torch.Tensor:
        """This rank's share of the global-batch mean loss, with gradients accumulated (reduced inside the job)."""
        rt = self.runtime
        if rt.schedule is not None:
            inputs = rt.batch(rt.train_ds, [i for mb in micro_batches for i in mb])
            rt.loss.begin([inputs])
            args, kwargs, target = rt.pipeline_io(inputs)
            losses = []
            with rt.autocast():
                if rt.teacher:  # its logits of these micro-batches first, carried by the target (engine.distill)
                    target = rt.teacher.run_pipeline(args, kwargs, target)
                rt.schedule.step(*args, target=target, losses=losses, **kwargs)
            return rt.loss.unscaled_mean(losses) if rt.parts.last else torch.zeros((), device=rt.device)
        batches = [rt.batch(rt.train_ds, indices) for indices in micro_batches]
        rt.loss.begin(batches)
        total = torch.zeros((), device=rt.device)
        with self._cast_cache(len(batches)):
            for i, inputs in enumerate(batches):
                total += self._micro_step(inputs, last=i == len(batches) - 1)
        return total

    def _cast_cache(self, num_micro_batches: int):
        """Keep autocast's low-precision copies of the weights from the first micro-batch's forward to the end
        of the step, so the later micro-batches reuse them instead of casting every weight again (autocast
        drops its cache when the outermost autocast region ends: this outer region, with autocast itself off,
        spans the step). Not under data parallelism: FSDP2 (ZeRO, and DDP through ``replicate``) swaps each
        module's parameters between sharded and gathered tensors around every forward and backward, and the
        cached copies then broke parity with one process (bf16 and fp16 dp2 left its tolerance); under ZeRO-3
        the cache would also hold a copy of every gathered weight. train.amp.cache_weight_casts=False: cast in
        every forward."""
        rt = self.runtime
        if (rt.amp_dtype is None or num_micro_batches < 2 or not self.cfg.train.amp.cache_weight_casts
                or rt.dims.dp_enabled):  # (ZeRO needs data parallelism: validate_layout)
            return contextlib.nullcontext()
        return torch.autocast(rt.device.type, enabled=False)

    def _micro_step(self, inputs: dict, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients reduced after the ``last``); returns its loss."""
        rt = self.runtime
        for part in rt.model_parts:  # reduce gradients once, after the last micro-batch
            if hasattr(part, "set_requires_gradient_sync"):  # FSDP2 / replicate modules only
                part.set_requires_gradient_sync(last)
        with rt.autocast(amp=False):  # the vocabulary-parallel loss, for forward and backward
            with rt.autocast(loss=False):  # mixed precision for the forward only
                if rt.teacher:
                    loss = rt.teacher.loss(rt.model, inputs)
                else:
                    out = rt.model(**inputs)
                    loss = out.loss
                    for name, part in getattr(out, "loss_parts", {}).items():  # logged beside the loss, as it is
                        weighted = local_scalar(rt.loss.weighted(part.detach(), inputs))
                        self._loss_parts[name] = self._loss_parts.get(name, 0.0) + weighted
                    del out  # not its logits through the backward (the memory a step peaks at)
                loss = rt.loss.weighted(loss, inputs)
            rt.loss.scaled(loss).backward()  # outside autocast (torch's advice)
        return local_scalar(loss)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One global batch: hooks' step start, draw the micro-batches, forward/backward, clip, update. A hook
        that raises RetryStep after the backward has the step taken again from the same sample position.
        Returns (loss, grad_norm): 0-dim tensors on the device, not read on the host (``float()`` them to print
        one; the loop reads them once per log period, :mod:`dufu.engine.step_stats`). The step's gradients stay
        until the next step starts or the loop drops them."""
        for retries in range(MAX_STEP_RETRIES):
            self.hooks.call("on_step_start", self)
            consumed = self.sampler.consumed_samples
            try:
                return self._update(self.sampler.next_step())
            except RetryStep as retry:
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                self.sampler.consumed_samples = consumed
                self.hooks.call("on_step_retry", self, retry)
        raise DistributedFailure(f"step {self.step + 1} was retried {MAX_STEP_RETRIES} times without being taken")

    def _update(self, micro_batches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rt = self.runtime
        self.zero_grad()  # (the loop drops them after each step; a caller of train_step may not)
        for part in rt.model_parts:
            part.train()
        self.hooks.call("before_forward_backward", self, micro_batches)
        local_loss = self.hooks.after_backward(self, self.forward_backward(micro_batches))
        sync_tied_gradients(rt.parts.tied_params, rt.parts.tied_group)
        self.last_lr = self.optimizers[0].param_groups[0]["lr"]  # the rate this step is taken with
        params = [p for part in rt.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, self.cfg.train.clip_grad_norm or None, pp_group=rt.pipeline_group(),
                                    skip=rt.parts.tied_copies, grad_scale=rt.scaler.scale if rt.scaler else 1.0)
        self.hooks.call("before_optimizer", self, grad_norm)
        self._optimizer_step(grad_norm)
        for sched in self.schedulers:
            sched.step()
        loss = rt.loss.reduce(local_loss)
        # the loss's named parts (a model output's ``loss_parts``: DeepSeek-V3's lm_loss, mtp_loss), reduced as the
        # loss is; not under pipeline parallelism, whose schedule returns the last stage's total loss only
        self.step_loss_parts = {name: rt.loss.reduce(v) for name, v in self._loss_parts.items()}
        self._loss_parts = {}
        self.hooks.call("after_optimizer", self, loss, grad_norm)
        return loss, grad_norm

    def _optimizer_step(self, grad_norm: torch.Tensor) -> None:
        """Take the update unless the gradients are not finite; the verdict is the same on every rank (the norm
        is global). Decided on the device where the optimizers can (fused Adam/AdamW/SGD take ``found_inf`` and
        skip the update in their kernel, step count included, as under torch's GradScaler): no host read. fp16's
        loss scaler (a host number) and an optimizer without ``found_inf`` need the verdict on the host: one
        read per step there. ``train.nan_policy="stop"`` acts when the loop next reads the step's numbers."""
        rt = self.runtime
        finite = torch.isfinite(grad_norm)
        if rt.scaler is not None:  # fp16 overflow is routine: skip the step, the scale backs off
            overflow = not bool(finite)
            rt.scaler.update(overflow)
            if not overflow:
                for opt in self.optimizers:
                    opt.step()
            return
        if all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self.optimizers):
            found_inf = (~finite).to(torch.float32)
            for opt in self.optimizers:
                opt.found_inf = found_inf
                try:
                    opt.step()
                finally:
                    del opt.found_inf
        elif bool(finite):
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def read_steps(self) -> list[StepRecord]:
        """Read the steps' numbers back from the device (one host read) and act on a non-finite one as
        ``train.nan_policy`` says: "stop" raises, naming the first such step (and, while its gradients are
        still here, the parameters whose gradients are not finite); "skip" counts it (its update was not taken).
        Under fp16 a non-finite value is an overflow the loss scaler has already skipped and backed off from."""
        records = self.stats.read()
        rt = self.runtime
        if rt.scaler is not None or self.cfg.train.nan_policy != "stop":
            return records
        bad = first_non_finite(records)
        if bad is not None:
            what = f"the gradient norm is {bad.grad_norm}"
            if bad.step != self.step:
                what += f" (read at step {self.step}, where the gradients may be finite again)"
            raise diagnose.non_finite_gradients(rt.model_parts, bad.step, what, rt.world_size)
        bad = first_non_finite_loss(records)
        if bad is not None:
            raise diagnose.non_finite_loss(bad.loss, bad.step)
        return records

    def evaluate(self) -> dict:
        return self.runtime.evaluate()

    # ------------------------------------------------------------ the loop
    def train(self) -> dict:
        """Run the loop; in a multi-process job a failed or timed-out collective becomes an error that names
        this rank and step (another rank died or hangs) instead of a hang or a wall of traceback."""
        rt = self.runtime
        try:
            # an allocation failure names what held the memory and leaves a snapshot (dufu.engine.reporting.memory)
            with memory.on_out_of_memory(rt.output_dir, rt.device, rt.rank, rt.model_parts, self.optimizers,
                                         lambda: self.activity):
                if rt.world_size == 1:
                    return self._train()
                with diagnose.collective_failures(rt.rank, lambda: self.activity,
                                                  self.cfg.train.dist.timeout_minutes, rt.health_group):
                    return self._train()
        finally:
            self.preemption.restore()  # Ctrl-C after the run (a notebook, a test process) is the caller's again

    def _train(self) -> dict:
        t = self.cfg.train
        if t.gc_period:  # Python's collector on a schedule, between steps (torchtitan's gc_freq)
            gc.disable()
            # the young generations only: a full collection costs ~0.2 s per 300k objects, which a process that
            # holds many (a notebook, a test session training run after run) would pay at every start
            gc.collect(1)
            try:
                return self._loop()
            finally:
                gc.enable()
        return self._loop()

    def _loop(self) -> dict:
        t = self.cfg.train
        self._begin()
        log = report.RunLog(self)
        if self.eval_enabled and self.step == 0:
            log.evaluation(self.evaluate())
        log.start()
        stop_reason = None
        steady = self.runtime.world_size == 1
        while self.step < t.train_iter and not stop_reason:
            self.activity = f"at step {self.step + 1}"
            loss, grad_norm = self.train_step()
            self.step += 1
            if not steady:  # the first step has compiled and gathered: train.dist.timeout_minutes from here on
                steady = True
                notice = enter_steady_state(t.dist.timeout_minutes)
                if notice and self.runtime.is_main:
                    self.log(f"notice: {notice}")
            self.stats.add(self.step, loss, grad_norm, self.step_loss_parts)
            logged = self.step % t.log_period == 0 or self.step == t.train_iter
            evaluated = self.eval_enabled and (self.step % t.evaluation.eval_period == 0 or self.step == t.train_iter)
            period = t.checkpointer.period
            if logged or evaluated or (period and self.step % period == 0):
                try:
                    self.read_steps()  # the one host read of these steps' numbers
                except DufuError:
                    log.close()
                    raise
            self.zero_grad()  # before an evaluation or a save, which do not need them
            if t.gc_period and self.step % t.gc_period == 0:
                gc.collect(1)  # the young generations (torchtitan's gc_freq does the same)
            log.step(self.stats.last if logged else None)
            if evaluated:
                self.activity = f"while evaluating after step {self.step}"
                log.evaluation(self.evaluate())
            stop_reason = self._stop_reason(log.t_start)
            if (period and self.step % period == 0) or self.step == t.train_iter or stop_reason:
                self.activity = f"while saving the checkpoint of step {self.step}"
                self.read_steps()  # a stop at a step that was not read (preemption): no checkpoint of a bad step
                log.checkpoint(self.save_checkpoint())
        self.checkpointer.wait()
        if self.preempted and self.is_main:  # the launcher's exit code reads it (dufu.engine.resilience.preemption)
            write_marker(self.output_dir, self.step, self.preempted)
        # no samples in a grace period
        summary = log.finish(stop_reason, list if self.preempted else self.runtime.sample_text)
        self.hooks.call("on_end", self, summary)
        return summary

    def _begin(self) -> None:
        """Resume, and (rank 0) write what reproduces the run and show the start-up summary."""
        rt = self.runtime
        if rt.world_size > 1:
            dist.barrier()  # every rank has checked output_dir before rank 0 writes to it
        if rt.resume_from is not None:
            self.load_checkpoint(rt.resume_from)
            self.log(f"resumed from {rt.resume_from} (step {self.step})")
        if rt.is_main:
            if rt.resume_from is not None:  # --resume-step / --resume-from an earlier step than the newest
                moved = set_aside_later_checkpoints(self.checkpointer.root, self.step)
                if moved:
                    self.log(moved)
            rt.output_dir.mkdir(parents=True, exist_ok=True)
            clear_marker(rt.output_dir)  # an earlier attempt's preemption is over
            LazyConfig.save(self.cfg, rt.output_dir / "config.yaml")
            rt.tokenizer.save(str(rt.output_dir / "tokenizer.json"))
            if self.memory_plan is not None:
                self.planned_memory = self.memory_plan(dtype=NAMES[rt.precision.dtype or torch.float32])
            self.log(self.describe())
        self.hooks.call("on_start", self)

    def _stop_reason(self, t_start: float) -> Optional[str]:
        """Preemption (SIGTERM/SIGUSR1, agreed by all ranks), train.stop_at_iter / stop_after_minutes (the time
        verdict is rank 0's, shared with all ranks)."""
        t, rt = self.cfg.train, self.runtime
        if self.step >= t.train_iter:
            return None
        self.preempted = self.preemption.requested(rt.health_group, rt.world_size)
        if self.preempted:
            return f"preempted by {self.preempted}"
        if t.stop_at_iter and self.step == t.stop_at_iter:  # reached in this run (a resume goes past it)
            return f"train.stop_at_iter={t.stop_at_iter}"
        minutes = t.stop_after_minutes
        if minutes:
            # On this rank's device: the default group is NCCL on GPUs, which cannot broadcast a CPU tensor.
            over = torch.tensor(float((time.perf_counter() - t_start) / 60.0 >= minutes), device=rt.device)
            if rt.world_size > 1:
                dist.broadcast(over, src=0)
            if over.item():
                return f"train.stop_after_minutes={minutes}"
        return None

    def describe(self) -> str:
        return report.describe(self.runtime, planned=self.planned_memory)

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

    def save_checkpoint(self):
        rt = self.runtime
        path = self.checkpointer.save(
            self.step, rt.model_parts, self.optimizers, self.trainer_state(),
            extra_meta={"layout": rt.dims.describe(), "global_batch_size": rt.global_batch_size,
                        **({"delta": self.delta_base} if rt.delta is not None else {})},
            config_text=LazyConfig.to_yaml(self.cfg) if rt.is_main else None,
        )
        self.hooks.call("on_save", self, path)
        return path

    @functools.cached_property
    def delta_base(self) -> dict:
        """The base of a delta run, recorded with each checkpoint (which holds only the delta)."""
        return base_fingerprint(self.runtime.pretrained.path, self.cfg.train.seed, self.cfg.model)

    def load_checkpoint(self, path) -> None:
        if self.runtime.delta is not None:
            saved = self.checkpointer.read_meta(path).get("delta")
            if saved is None:
                raise CheckpointError(f"{path} is not a checkpoint of a delta run (it holds a whole model); resume "
                                      "it without the delta section, or start the delta run in a new output_dir")
            if saved.get("fingerprint") != self.delta_base["fingerprint"]:
                raise CheckpointError(
                    f"{path} holds a delta trained on another base ({saved.get('base') or 'a seeded initialisation'}"
                    f"), not on this run's ({self.delta_base['base'] or 'seeded initialisation, seed ' + str(self.cfg.train.seed)}). "
                    "Set model.pretrained (and train.seed) to the base the delta was trained on.")
        state = self.checkpointer.load(path, self.runtime.model_parts, self.optimizers)
        self.step = int(state["step"])
        self.set_schedule_step(int(state["scheduler"]["last_epoch"]))
        sampler = state["sampler"]
        if self.resume_request is not None and self.resume_request.overrides_data():
            # --override-saved of a data setting: the new data's order, from the saved position in it
            sampler = {"consumed_samples": sampler["consumed_samples"]}
        self.sampler.load_state_dict(sampler)
        torch.set_rng_state(state["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state:
            torch.cuda.set_rng_state(state["rng_cuda"], self.device)
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        self.hooks.call("on_resume", self, state)

    def set_schedule_step(self, last_epoch: int) -> None:
        """Put every learning-rate schedule at ``last_epoch`` steps taken (a resume, a healed replica group)."""
        for sched in self.schedulers:
            sched.last_epoch = last_epoch
            for group, base_lr, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base_lr * factor(sched.last_epoch)
            sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
