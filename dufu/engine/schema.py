"""The schema of the ``train`` namespace: every run-level setting, its type and its one default.

`Train` is a dataclass of dataclasses; the names and defaults are LiBai's. ``dufu/configs/common/train.py`` builds
its ``train`` from it (``train = schema_node(Train)``), so a recipe edits a complete, typed node and no default
is written anywhere else. The node carries ``_schema_: dufu.engine.schema.Train``, also in every ``config.yaml``,
so the config layer checks a ``.py`` file, a YAML file and an override against this schema without knowing the
engine (`dufu.config.schema`): an unknown key names the closest keys, a value of the wrong type is refused.

The types say what a key holds; a word set owned by another module is checked there, at start-up
(`dufu.engine.validate.validate_config`): the precision settings (`dufu.engine.precision`), the activation
checkpointing modes, the pipeline schedules, the torchft modes. ``Auto`` marks the layout keys `dufu plan`
searches (`AUTO_KEYS`) and the switches that decide by measuring.

`validate_train` is the one call a run needs after loading and overriding: it types a ``train`` that came
without its schema (an old ``config.yaml``, a config built in code), fills in every default and checks the
whole config, so the engine reads ``cfg.train.x`` and never ``cfg.train.get("x", default)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from dufu.config import LazyCall as L
from dufu.config.node import SCHEMA_KEY
from dufu.config.overrides import is_auto
from dufu.config.schema import check_config, resolve_schema
from dufu.config.typecheck import Lazy
from dufu.engine.lr_scheduler import WarmupCosineLR
from dufu.errors import ConfigError

__all__ = ["AUTO_KEYS", "Auto", "Train", "auto_layout_keys", "is_auto", "validate_train"]

# The word "auto": the planner chooses a layout key, or a switch decides by measuring.
Auto = Literal["auto"]


@dataclass
class LossScaler:
    """fp16's dynamic loss scaler (Micikevicius et al. 2018; the values torch.amp.GradScaler starts from): the
    scale halves on an overflowing step (which is skipped) and doubles after growth_interval clean ones."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0


@dataclass
class Amp:
    """Mixed precision (dufu.engine.precision)."""

    # "auto" (autocast where this device's measured bf16, or fp16, matmul throughput beats fp32's, else fp32),
    # True (autocast to dtype), False (fp32), "bf16" or "fp16"; precision.check_setting names the words.
    enabled: bool | str = "auto"
    dtype: str = "bf16"  # for enabled=True: "bf16" | "fp16" (fp16 uses dynamic loss scaling)
    loss_scaler: LossScaler = field(default_factory=LossScaler)
    # Cast each weight to the autocast dtype once per step, not once per micro-batch (not under ZeRO-3).
    cache_weight_casts: bool = True
    # Data parallelism and ZeRO (FSDP2's MixedPrecisionPolicy, dufu.parallel.data_parallel.mixed_precision_policy):
    # the dtype the blocks' parameters are gathered in, "auto" (the compute dtype: each weight cast once per
    # gather, not by autocast in every forward; fp32 when the run computes in fp32), "fp32", or the compute dtype
    # ("bf16" | "fp16"); the sharded parameters stay fp32 (the optimizer's master weights).
    param_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # ... and the dtype gradients are reduced (reduce-scattered or all-reduced) in: "fp32", or the compute dtype.
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


@dataclass
class ActivationCheckpoint:
    """Recompute activations in the backward pass, per transformer block (dufu.parallel.activation_checkpoint):
    "selective" keeps matmul and attention outputs and recomputes norms, activations, dropout and casts; "full"
    keeps only each block's input and recomputes the whole block."""

    enabled: bool | Auto = False
    mode: str = "selective"


@dataclass
class Compile:
    """torch.compile each transformer block: true, false or "auto" (on where it measured faster, warm-up included:
    dufu.parallel.compile.decide_compile). Compiled code is cached in the dufu cache directory."""

    enabled: bool | Auto = "auto"


@dataclass
class Checkpointer:
    """period: save every N steps (0: no periodic saves); the last step (and an early stop) is always saved, so a
    finished run can be resumed, converted and sampled. async_save: write in the background while training goes
    on (torch DCP async_save)."""

    period: int = 1000
    max_to_keep: int = 3
    async_save: bool = False


@dataclass
class Evaluation:
    """Every eval_period steps (and at the last), the mean over eval_iter global batches of the validation set."""

    enabled: bool = True
    eval_period: int = 500
    eval_iter: int = 20


@dataclass
class Generation:
    """Samples written at the end of a run, from these prompts."""

    enabled: bool = False
    prompts: list[str] = field(default_factory=lambda: ["The "])
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: Optional[int] = 40
    top_p: Optional[float] = None


@dataclass
class Dist:
    """The parallel layout. A size of -1 is inferred from the world size; "auto" lets `dufu plan` choose."""

    # -1: every process the job has that tensor, context and pipeline parallelism leave (torchtitan's default), so
    # `dufu train CONFIG --nproc N` alone trains data parallel.
    data_parallel_size: int | Auto = -1
    tensor_parallel_size: int | Auto = 1
    pipeline_parallel_size: int | Auto = 1
    # Mixture-of-experts models: their experts split over this many data-parallel ranks (it divides
    # data_parallel_size; tokens reach their experts by all-to-all). dufu.parallel.expert_parallel
    expert_parallel_size: int | Auto = 1
    # Long sequences: every sample's tokens split over this many ranks through the whole model (attention gathers
    # the other ranks' keys/values); a factor of the world, dp x cp x tp x pp. dufu.parallel.context_parallel
    context_parallel_size: int | Auto = 1
    # How attention sees the other context ranks' tokens (dufu.parallel.context_parallel): "all_gather" (every
    # rank gathers the keys/values of the whole sequence), "all_to_all" (DeepSpeed-Ulysses: an all-to-all trades
    # the sequence split for a head split, attention runs on whole sequences of heads / cp heads), or
    # "hierarchical" (all-to-all inside groups of context_parallel_a2a_size ranks, all-gather across the groups;
    # Megatron's a2a+p2p).
    context_parallel_mode: Literal["all_gather", "all_to_all", "hierarchical"] = "all_gather"
    context_parallel_a2a_size: int = 1
    # Hybrid sharding (HSDP) under ZeRO-3: the data-parallel ranks form data_parallel_replicate_size replicas of
    # data_parallel_size / data_parallel_replicate_size shards each; parameters are sharded inside a replica and
    # gradients all-reduced across replicas (torchtitan's dp_replicate x dp_shard). 1: shard over all of them.
    data_parallel_replicate_size: int = 1
    sequence_parallel: bool | Auto = False
    pipeline_num_layers: Optional[int] = None
    custom_pipeline_stage_id: Optional[list[int]] = None
    # one of dufu.parallel.pipeline.SCHEDULES ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble",
    # "zbv", "dualpipev"; the last two place two stages per rank in a V: virtual_pipeline_size 2)
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int | Auto = 1
    # A collective that waits longer than this (a dead or hung rank) stops the job with an error; from the end of
    # the first step on (dufu.parallel.launch.enter_steady_state).
    timeout_minutes: float = 10.0
    # The same until the first step has ended: the rendezvous, the process groups' creation, the first step's
    # compilation and gathers (a slow node's first compile must not look like a hang). The larger of the two applies.
    startup_timeout_minutes: float = 30.0
    # True: the planner chooses every layout key of AUTO_KEYS (as if each were "auto").
    auto: bool = False


@dataclass
class ZeroOptimization:
    enabled: bool = False
    stage: int | Auto = 1  # 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)


@dataclass
class Preemption:
    """SIGTERM / SIGUSR1 (a scheduler's preemption): every rank finishes its step, saves a checkpoint and exits
    with code 75; the launcher gives the workers grace_seconds before it kills them. dufu.engine.resilience.preemption"""

    enabled: bool = True
    grace_seconds: int = 120


@dataclass
class OuterOptimizer:
    """DiLoCo's outer Nesterov SGD (the paper's lr 0.7, momentum 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class FaultTolerance:
    """Training through failures without a restart (torchft): this job is replica group replica_group_id of
    replica_parallel_size groups that train one model, coordinated by `dufu lighthouse` at `lighthouse`
    (http://HOST:PORT). mode: "replicate" (gradients averaged over the live groups every step), "diloco" (an outer
    Nesterov SGD step on the averaged pseudo-gradients every sync_every steps) or "local_sgd" (weights averaged
    every sync_every steps). dufu.engine.resilience.fault_tolerance, docs/faults.md"""

    enabled: bool = False
    lighthouse: Optional[str] = None
    replica_group_id: int = 0
    replica_parallel_size: int = 1
    min_replica_size: int = 1
    mode: str = "replicate"
    sync_every: int = 100
    outer_optimizer: OuterOptimizer = field(default_factory=OuterOptimizer)
    timeout_seconds: float = 60.0
    quorum_timeout_seconds: float = 300.0
    connect_timeout_seconds: float = 10.0


def _scheduler() -> Any:
    # max_iter and optimizer are filled in by the trainer.
    return L(WarmupCosineLR)(warmup_iter=100, warmup_factor=0.0, min_lr_ratio=0.1)


@dataclass
class Train:
    """The ``train`` namespace: every run-level setting."""

    output_dir: str = "output/run"
    train_iter: int = 1000
    # Batch arithmetic (Megatron/LiBai): global = micro x data_parallel_size x num_accumulation_steps.
    # Set any two; the third is derived (None).
    train_micro_batch_size: int | Auto = 8
    global_batch_size: Optional[int] = None
    num_accumulation_steps: Optional[int] = None
    seed: int = 1234
    # End the run early, after writing a checkpoint, as if it had been interrupted; the LR schedule and everything
    # else still follow train_iter (Megatron's exit interval / exit duration). None: off.
    stop_at_iter: Optional[int] = None
    stop_after_minutes: Optional[float] = None
    # A non-finite loss or gradient: "stop" (name the step and the first offending tensor) or "skip" (drop the
    # update, count it, log it).
    nan_policy: str = "stop"
    # Losses, gradient norms and non-finite verdicts stay on the device and are read once per log_period (and
    # before an evaluation or a save): dufu.engine.step_stats.
    log_period: int = 10
    # Python's cyclic garbage collector runs between steps every gc_period steps, not whenever allocations
    # trigger it (which on many ranks makes a different rank pause in each step); 0: Python decides, as usual.
    gc_period: int = 50
    clip_grad_norm: Optional[float] = 1.0  # None or 0: no clipping
    scheduler: Lazy = field(default_factory=_scheduler)
    amp: Amp = field(default_factory=Amp)
    # True: build the model on the meta device and allocate only each rank's shards after splitting and sharding
    # (dufu.parallel.materialize). False: every rank builds the full fp32 model first (what a model without a
    # per-module init, such as HFAutoModel, always gets). The initial weights are the same.
    meta_init: bool = True
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpointer: Checkpointer = field(default_factory=Checkpointer)
    evaluation: Evaluation = field(default_factory=Evaluation)
    generation: Generation = field(default_factory=Generation)
    dist: Dist = field(default_factory=Dist)
    zero_optimization: ZeroOptimization = field(default_factory=ZeroOptimization)
    preemption: Preemption = field(default_factory=Preemption)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    # Peak FLOP/s of one device for MFU, in TFLOP/s; None = data sheet (known GPUs) or a measured matmul (CPU).
    peak_tflops: Optional[float] = None
    # The planner's peak memory per rank for this run (dufu.plan, a trace on fake tensors: ~0.5 s on rank 0 at
    # start-up) in the start-up summary and beside the measured peaks in the end summary; false: not computed.
    plan_memory: bool = True
    tensorboard: bool = True
    device: str = "auto"
    # Training-loop hooks: LazyCall nodes the trainer instantiates and registers at the loop's named points.
    hooks: list[Lazy] = field(default_factory=list)


# Layout settings that may be "auto": `dufu plan` searches them and `dufu train` runs the planner's best choice
# (dufu.plan; this order is the one its messages use). Any of them may also be set back from "auto" to a value.
AUTO_KEYS = (
    "train.dist.data_parallel_size", "train.dist.tensor_parallel_size", "train.dist.pipeline_parallel_size",
    "train.dist.expert_parallel_size", "train.dist.context_parallel_size", "train.dist.sequence_parallel",
    "train.dist.virtual_pipeline_size", "train.train_micro_batch_size", "train.zero_optimization.stage",
    "train.activation_checkpoint.enabled",
)


def auto_layout_keys(cfg) -> list[str]:
    """The layout settings ``cfg`` leaves to the planner: the AUTO_KEYS set to "auto", or ``train.dist.auto``
    when it is True. Cheap (no planner import), and safe on a config not yet validated."""
    def value(dotted):
        node = cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    left = [k for k in AUTO_KEYS if is_auto(value(k))]
    return left + (["train.dist.auto"] if value("train.dist.auto") is True else [])


def validate_train(cfg, source: Optional[str] = None):
    """Check `cfg` in place against the train schema (and every LazyCall node against its target); fill in every
    default of ``cfg.train``; return `cfg`. Call it once at start-up, after loading and the overrides.

    A ``train`` without ``_schema_`` (a ``config.yaml`` written before dufu had schemas, a config built in code)
    becomes a typed node here. `source` (e.g. "config file run/config.yaml") is named in error messages.
    """
    if not isinstance(cfg, Mapping) or not isinstance(cfg.get("train"), Mapping):
        got = "no train namespace" if not isinstance(cfg, Mapping) or "train" not in cfg else \
            f"a train of type {type(cfg['train']).__name__}"
        raise ConfigError(
            f"The config has {got}; a dufu config defines `train` (the run's settings). Start from a packaged "
            "recipe (`from .common.train import train`) or get_config('common/train.py').train."
        )
    train = cfg["train"]
    marker = train.get(SCHEMA_KEY)
    if marker is None:
        train[SCHEMA_KEY] = f"{Train.__module__}.{Train.__qualname__}"
    elif not issubclass(resolve_schema(marker, "train"), Train):
        raise ConfigError(
            f"train.{SCHEMA_KEY} is {marker!r}, but the train namespace follows {Train.__module__}.Train (or a "
            "subclass of it). Remove the key or name that schema."
        )
    return check_config(cfg, source)
