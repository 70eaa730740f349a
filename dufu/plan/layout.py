"""A candidate layout and the run settings that do not change between candidates, read from a config; a layout
in one line of dufu's words (:func:`layout_text`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from dufu.engine.precision import MIN_SPEEDUP
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
    dtype, reason = choose_dtype(t.amp.enabled, t.amp.dtype, hardware)
    mode = t.activation_checkpoint.mode
    if mode not in ("selective", "full"):
        raise ConfigError(f"train.activation_checkpoint.mode={mode!r}: use 'selective' or 'full'.")
    return Setup(dtype, reason, t.global_batch_size, t.num_accumulation_steps, mode,
                 bool(t.amp.cache_weight_casts), t.dist.custom_pipeline_stage_id,
                 t.dist.pipeline_schedule, bool(t.clip_grad_norm),
                 t.compile.enabled)


def layout_text(layout: dict) -> str:
    """A layout in one line, with dufu's words."""
    cp = layout.get("context_parallel_size", 1)
    text = (f"dp {layout['data_parallel_size']}{f' x cp {cp}' if cp > 1 else ''} x tp "
            f"{layout['tensor_parallel_size']} x pp {layout['pipeline_parallel_size']}")
    extras = []
    if layout.get("expert_parallel_size", 1) > 1:
        extras.append(f"experts over ep {layout['expert_parallel_size']}")
    if layout.get("sequence_parallel"):
        extras.append("sequence parallel")
    if layout["pipeline_parallel_size"] > 1:
        v = layout.get("virtual_pipeline_size", 1)
        extras.append(f"{layout.get('pipeline_schedule', '1f1b')}" + (f" (v {v})" if v > 1 else ""))
    extras.append(f"micro-batch {layout['micro_batch_size']} x {layout['num_accumulation_steps']}")
    extras.append(f"ZeRO {layout['zero_stage']}" if layout["zero_stage"] else "ZeRO off")
    ckpt = layout.get("activation_checkpoint")
    extras.append(f"{ckpt} checkpointing" if ckpt else "no checkpointing")
    return text + "; " + ", ".join(extras)
