"""A candidate layout and the run settings that do not change between candidates, read from a config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from dufu.errors import ConfigError

MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")


@dataclass(frozen=True)
class Layout:
    """Degrees and per-rank settings of one candidate: what ``train.dist`` & co. would say."""

    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    sequence_parallel: bool
    virtual_pipeline_size: int
    pipeline_schedule: str
    micro_batch_size: int
    num_accumulation_steps: int
    global_batch_size: int
    zero_stage: int  # 0: ZeRO off
    activation_checkpoint: object  # False, "selective" or "full"
    expert_parallel_size: int = 1  # MoE experts split over this many of the data-parallel ranks (divides dp)
    context_parallel_size: int = 1  # every sample's tokens split over this many ranks (dufu.parallel.context_parallel)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size * self.tensor_parallel_size * \
            self.pipeline_parallel_size

    @property
    def data_axis_size(self) -> int:
        """The ranks gradients are averaged (and ZeRO shards) over: dp x cp, as ParallelDims.data_axis_size."""
        return self.data_parallel_size * self.context_parallel_size

    def as_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        parts = [f"dp{self.data_parallel_size}", f"tp{self.tensor_parallel_size}", f"pp{self.pipeline_parallel_size}"]
        if self.context_parallel_size > 1:
            parts.insert(1, f"cp{self.context_parallel_size}")
        text = " x ".join(parts)
        extras = []
        if self.expert_parallel_size > 1:
            extras.append(f"ep{self.expert_parallel_size}")
        if self.sequence_parallel:
            extras.append("sp")
        if self.pipeline_parallel_size > 1:
            extras.append(self.pipeline_schedule + (f" v{self.virtual_pipeline_size}"
                                                    if self.virtual_pipeline_size > 1 else ""))
        extras.append(f"mb{self.micro_batch_size}")
        if self.zero_stage:
            extras.append(f"zero{self.zero_stage}")
        if self.activation_checkpoint:
            extras.append(f"ckpt {self.activation_checkpoint}")
        return text + ", " + ", ".join(extras)

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides that make a config run this layout."""
        out = [
            f"train.dist.data_parallel_size={self.data_parallel_size}",
            f"train.dist.tensor_parallel_size={self.tensor_parallel_size}",
            f"train.dist.pipeline_parallel_size={self.pipeline_parallel_size}",
            f"train.dist.sequence_parallel={self.sequence_parallel}",
            f"train.dist.virtual_pipeline_size={self.virtual_pipeline_size}",
            f"train.dist.pipeline_schedule={self.pipeline_schedule}",
            f"train.train_micro_batch_size={self.micro_batch_size}",
            f"train.zero_optimization.enabled={bool(self.zero_stage)}",
            f"train.activation_checkpoint.enabled={bool(self.activation_checkpoint)}",
        ]
        if self.zero_stage:
            out.append(f"train.zero_optimization.stage={self.zero_stage}")
        if self.expert_parallel_size > 1:
            out.append(f"train.dist.expert_parallel_size={self.expert_parallel_size}")
        if self.context_parallel_size > 1:
            out.append(f"train.dist.context_parallel_size={self.context_parallel_size}")
        return out


@dataclass(frozen=True)
class Setup:
    """What a config fixes for every candidate."""

    dtype: str  # "fp32" | "bf16" | "fp16" (autocast)
    dtype_reason: str
    global_batch_size: Optional[int]
    num_accumulation_steps: Optional[int]
    checkpoint_mode: str  # the mode train.activation_checkpoint.mode names
    cache_weight_casts: bool
    custom_stage_ids: Optional[list]
    schedule: str
    clip_grad: bool
    compile: object = "auto"

    def compiled_on(self, hardware) -> bool:
        """Whether the blocks run compiled (:func:`dufu.parallel.compile.decide_compile`: "auto" compiles on
        accelerators; on a CPU it has not measured faster, so it stays eager)."""
        if self.compile is True or self.compile is False:
            return self.compile
        return not hardware.synchronous


def choose_dtype(amp_enabled, amp_dtype: str, hardware) -> tuple[str, str]:
    """The dtype a run trains in, as :func:`dufu.engine.precision.choose_precision` decides it, from the device's
    figures instead of a measurement at start-up."""
    from dufu.engine.precision import MIN_SPEEDUP

    if amp_enabled is False:
        return "fp32", "train.amp.enabled=False"
    if amp_enabled is True:
        return amp_dtype, f"train.amp.enabled=True, dtype {amp_dtype}"
    if amp_enabled in ("bf16", "fp16"):
        return amp_enabled, f"train.amp.enabled={amp_enabled}"
    threads = hardware.cores if hardware.cores else 0
    low, fp32 = hardware.peak("bf16", threads), hardware.peak("fp32", threads)
    if low >= MIN_SPEEDUP * fp32:
        return "bf16", f"auto: bf16 matmul {low / fp32:.2f}x fp32 on {hardware.name}"
    return "fp32", f"auto: bf16 matmul only {low / fp32:.2f}x fp32 on {hardware.name}"


def setup_from_config(cfg, hardware) -> Setup:
    t = cfg.train
    dtype, reason = choose_dtype(t.amp.enabled, t.amp.get("dtype", "bf16"), hardware)
    mode = t.activation_checkpoint.get("mode", "selective")
    if mode not in ("selective", "full"):
        raise ConfigError(f"train.activation_checkpoint.mode={mode!r}: use 'selective' or 'full'.")
    return Setup(dtype, reason, t.get("global_batch_size"), t.get("num_accumulation_steps"), mode,
                 bool(t.amp.get("cache_weight_casts", True)), t.dist.get("custom_pipeline_stage_id"),
                 t.dist.get("pipeline_schedule", "1f1b"), bool(t.get("clip_grad_norm")),
                 t.get("compile", {}).get("enabled", "auto"))
