"""The runtime: what a run *is*, built once from the config — the world, the model parts, precision, context
parallelism, the teacher — and shared by training, evaluation, generation, ``dufu eval`` and distillation.

A :class:`Runtime` holds no optimizer, scheduler, sampler or step count: those are the training loop's
(:class:`dufu.engine.trainer.Trainer`). Building one:

1. ``plan_run`` checks the config and layout before any process group or allocation (:mod:`dufu.engine.preflight`);
2. the process group starts and the device mesh is built (``pipeline, data, tensor``; the data axis is dp x cp,
   cp inner), with the expert mesh (MoE) and context-parallel group carved from the same ranks;
3. rank 0 measures the device and every rank follows its precision choice; ``torch.compile`` is decided;
4. the model is cut into pipeline-stage parts and each part parallelized (TP -> activation checkpointing ->
   compile -> FSDP/replicate: :func:`dufu.parallel.build.build_model_parts`), pretrained weights loaded;
5. a teacher, if the config distills, is built and split like the model.

Each phase's wall time is kept in :attr:`Runtime.startup` (a start-up profile people and benchmarks read).
"""

from __future__ import annotations

import contextlib, time  # noqa: E401
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from dufu.config import instantiate
from dufu.data import collate
from dufu.delta.lora import init_dora_magnitudes
from dufu.engine.reporting import report
from dufu.engine.batch import to_model_inputs
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.distill import Teacher
from dufu.engine.evaluation import evaluate
from dufu.engine.global_loss import GlobalBatchLoss
from dufu.engine.loss_scaler import DynamicLossScaler
from dufu.engine.moe_monitor import MoEMonitor
from dufu.engine.precision import agree, choose_precision
from dufu.engine.preflight import model_to_split, plan_run
from dufu.errors import ConfigError
from dufu.parallel import env
from dufu.parallel.build import build_model_parts
from dufu.parallel.compile import CompileWatch, decide_compile
from dufu.parallel.context_parallel import build_context_parallel
from dufu.parallel.data_parallel import mixed_precision_policy
from dufu.parallel.launch import init_distributed
from dufu.parallel.materialize import supports_meta_init
from dufu.parallel.parallel_dims import World
from dufu.parallel.pipeline import split_pipeline_batch


class Runtime:
    """``resume``: False (a new run), True (continue from the latest complete checkpoint) or "auto" (resume if
    there is one); it decides only which weights the parts start from (the loop loads the rest of the state)."""

    def __init__(self, cfg, resume: bool | str = False, log=print, notices=()):
        self.cfg = cfg
        self.startup: dict[str, float] = {}  # phase -> seconds, in order
        self.rank, self.local_rank, self.world_size = env.world_info()
        self.is_main = self.rank == 0
        self.log = log if self.is_main else (lambda *a, **k: None)
        t = cfg.train
        with self._phase("plan"):
            plan = plan_run(cfg, self.world_size, resume)  # every check, before any process group or allocation
        self.dims, self.resume_from, self.notices = plan.dims, plan.resume_from, list(notices) + plan.notices
        self.micro_batch_size, self.global_batch_size, self.num_accumulation_steps = plan.batch_sizes
        self.tokenizer, self.train_ds, self.valid_ds = plan.tokenizer, plan.train_ds, plan.valid_ds
        self.seq_length, self.tokens_per_step = plan.seq_length, self.global_batch_size * plan.seq_length
        self.device = env.pick_device(self.local_rank) if t.device == "auto" else torch.device(t.device)
        self.output_dir = Path(t.output_dir)
        self.pretrained, self.scheduler_node = plan.pretrained, plan.scheduler
        self.delta = plan.model.delta_info  # a delta run (dufu.delta): only the delta trains
        self.meta_init = t.meta_init and supports_meta_init(plan.model)
        with self._phase("model build"):
            model = model_to_split(cfg, plan, self.meta_init)
        # load-balance records and the auxiliary losses' scale (MoE models): a hook of the loop, described here
        self.moe = MoEMonitor(self.output_dir, model)
        self.model_name, self.main_input_name = type(model).__name__, model.main_input_name
        self.num_parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        self.flops_per_token = report.model_flops_per_token(model, self.seq_length)

        with self._phase("process group"):
            self._start_world(t)
        with self._phase("precision"):
            # The dtype: rank 0 measures the device (train.amp.enabled="auto" picks the faster), every rank follows.
            self.precision = agree(choose_precision(t.amp.enabled, t.amp.dtype, self.device, t.peak_tflops)
                                   if self.is_main else None, self.health_group)
        self.amp_dtype, self.peak_flops, self.peak_source = (self.precision.dtype, self.precision.peak_flops,
                                                             self.precision.peak_source)
        self.notices += [self.precision.notice] if self.precision.notice else []
        # train.compile.enabled: True, False or "auto" (dufu.parallel.compile.decide_compile); every rank decides
        # alike from the same inputs
        self.compile = decide_compile(t.compile.enabled, self.device, train_iter=t.train_iter,
                                      amp_dtype=self.amp_dtype)
        self.notices += [self.compile.notice] if self.compile.notice else []
        # a hook of the loop: compilations after the first step are said and counted in the records
        self.compile_watch = CompileWatch(on_recompile="warn") if self.compile.enabled else None
        # fp16 needs loss scaling (bf16 has fp32's range); the pipeline's loss function applies it, so it lives here
        self.scaler = DynamicLossScaler(**t.amp.loss_scaler) if self.amp_dtype == torch.float16 else None
        self.loss = GlobalBatchLoss(self, type(model).pipeline_loss)
        with self._phase("model build"):
            self.parts = self._build_parts(model, plan.stage_ids)
        self.model_parts, self.schedule, self.model = self.parts.modules, self.parts.schedule, self.parts.modules[0]
        del model, plan
        with self._phase("teacher"):  # knowledge distillation: a teacher split like this model (dufu.engine.distill)
            self.teacher = Teacher(instantiate(self.cfg.distill), self) if cfg.get("distill") is not None else None
        self.loss.teacher = self.teacher
        self.notices += [self.teacher.describe()] if self.teacher else []
        # Dropout after initialisation: masks differ across data-parallel ranks and replica groups (they see
        # different samples) and agree across tensor-parallel peers (they hold the same replicated activations).
        torch.manual_seed(t.seed + 1_000_003 * self.data_rank)

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.startup[name] = self.startup.get(name, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------- the world
    def _start_world(self, t) -> None:
        """The process group, the run's device mesh and its context and expert views (one root mesh:
        :meth:`~dufu.parallel.parallel_dims.ParallelDims.build_world`), a gloo group to find unresponsive ranks when
        a collective fails (it works beside NCCL too), the context-parallel group."""
        init_distributed(self.device, timeout_minutes=t.dist.timeout_minutes,
                         startup_timeout_minutes=t.dist.startup_timeout_minutes,
                         flight_recorder_dir=self.output_dir / "flight_recorder")
        multi = self.world_size > 1
        self.world = self.dims.build_world(self.device.type) if multi else World(None)
        self.mesh, self.expert_mesh = self.world.mesh, self.world.expert_mesh
        self.health_group = dist.new_group(backend="gloo") if multi else None
        self.pp_rank, data_rank, self.tp_rank = self.mesh.get_coordinate() if multi else (0, 0, 0)
        # the mesh's data axis is dp x cp (cp inner): this rank's samples are those of data rank data_rank // cp
        self.dp_rank = data_rank // self.dims.context_parallel_size
        self.cp = build_context_parallel(self.dims, self.world)
        # Under train.fault_tolerance this job is one of several replica groups training one model: each reads its
        # own part of the groups' global batch, so a sample's data rank counts every group's ranks.
        ft = t.fault_tolerance
        group, self.replica_groups = (ft.replica_group_id, ft.replica_parallel_size) if ft.enabled else (0, 1)
        self.data_rank = group * self.dims.data_parallel_size + self.dp_rank
        self.data_size = self.replica_groups * self.dims.data_parallel_size

    def data_group(self):
        """The group gradients are averaged over and the global batch's targets counted over (dp x cp ranks)."""
        return self.mesh.get_group("data") if self.dims.data_axis_size > 1 else None

    def pipeline_group(self):
        return self.mesh.get_group("pipeline") if self.schedule is not None else None

    # ------------------------------------------------------------- the model
    def _build_parts(self, model, stage_ids):
        t, zero = self.cfg.train, self.cfg.train.zero_optimization
        try:  # checked in every layout (the dtype words by the schema), used under data parallelism
            mp_policy = mixed_precision_policy(self.amp_dtype, t.amp.param_dtype, t.amp.reduce_dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        parts = build_model_parts(
            model, self.mesh, self.device, stage_ids=stage_ids, meta_init=self.meta_init, seed=t.seed,
            pretrained=self.pretrained.source,
            # A checkpoint loaded next (--resume, or a dufu run as model.pretrained) sets every parameter; in a
            # delta run it sets only the delta (resumed) or only the base (pretrained), so the rest is filled.
            init_parameters=self.delta is not None or (self.resume_from is None and self.pretrained.checkpoint is None),
            virtual_pipeline_size=t.dist.virtual_pipeline_size or 1,
            pipeline_schedule=t.dist.pipeline_schedule,
            num_microbatches=self.num_accumulation_steps, loss_fn=self.loss.pipeline_loss,
            tensor_parallel=self.dims.tp_enabled, sequence_parallel=bool(t.dist.sequence_parallel),
            data_parallel=self.dims.dp_enabled, zero_stage=zero.stage if zero.enabled else None,
            activation_checkpoint=t.activation_checkpoint.mode if t.activation_checkpoint.enabled else None,
            compile=self.compile.enabled, expert_mesh=self.expert_mesh, context_parallel=self.cp,
            mp_policy=mp_policy, data_mesh=self.world.fsdp_mesh,
        )
        if self.pretrained.checkpoint is not None:  # each rank reads the chunks of its own shards (DCP)
            ckpt = self.pretrained.checkpoint
            Checkpointer(ckpt.parent, rank=self.rank).load_model(
                ckpt, parts.modules, skip=frozenset(self.delta.added) if self.delta is not None else frozenset())
        if self.delta is not None:  # DoRA's magnitudes start from the base weights now in place
            init_dora_magnitudes(parts.modules)
        return parts

    def replace_model(self, model) -> None:
        """Run ``model`` (already on this device, whole) in place of the built parts: ``dufu eval`` of a quantized
        model, which no config can build. Only without pipeline, tensor or data parallelism."""
        self.model, self.model_parts = model, [model]

    # ------------------------------------------------------------- a batch
    def autocast(self, amp: bool = True, loss: bool = True):
        """Mixed precision (``amp``) and, under tensor parallelism, the vocabulary-parallel ``loss``, which must
        also hold for the loss's backward (while autocast should not). Not to be nested in itself."""
        ctx = contextlib.ExitStack()
        if self.amp_dtype is not None and amp:
            # Under data parallelism FSDP gathers every weight in the compute dtype (train.amp.param_dtype,
            # dufu.parallel.data_parallel.mixed_precision_policy): autocast's casts of them are no-ops and cache
            # nothing. With train.amp.param_dtype=fp32 under ZeRO-3, every block's weights are gathered for its
            # forward and freed after it; autocast's cache would keep a low-precision copy of each gathered weight
            # until the forward ends, 2 bytes per parameter of the whole model on every rank
            # (dufu.plan.memory.autocast_caches_weights). Without it, a block's copies live as long as its
            # backward needs them (none under full recomputation).
            zero3 = self.cfg.train.zero_optimization.enabled and self.cfg.train.zero_optimization.stage >= 3
            ctx.enter_context(torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=not zero3))
        if self.dims.tp_enabled and loss:
            # Cross entropy on vocabulary-sharded logits: no rank gathers the full (B, T, V) tensor.
            ctx.enter_context(loss_parallel())
        return ctx

    def batch(self, dataset, indices) -> dict:
        """The samples ``indices`` as model inputs on this device; under context parallelism this rank's chunks."""
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in to_model_inputs(collate(dataset, indices)).items()}
        return self.cp.shard_batch(inputs) if self.cp is not None else inputs

    def pipeline_io(self, inputs: dict) -> tuple[tuple, dict, torch.Tensor]:
        """This rank's positional inputs (the main input on the first stage, none elsewhere), the keyword
        inputs every stage gets (masks, token types ...) and the last stage's target."""
        first, kwargs, target = split_pipeline_batch(self.model, inputs, self.main_input_name)
        return (first if self.parts.first else ()), kwargs, target

    # ------------------------------------------------------------- what people read
    def evaluate(self) -> dict:
        return evaluate(self)

    def sample_text(self) -> list[tuple[str, str]]:
        return report.sample_text(self)
