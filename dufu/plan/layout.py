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
    # hybrid sharding (HSDP, under ZeRO): the data axis as this many replicas of data_axis_size / R shards each
    data_parallel_replicate_size: int = 1
    context_parallel_mode: str = "all_gather"  # "all_gather" | "all_to_all" (Ulysses) | "hierarchical"
    context_parallel_a2a_size: int = 1  # hierarchical: the all-to-all spans this many cp ranks

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size * self.tensor_parallel_size * \
            self.pipeline_parallel_size

    @property
    def data_axis_size(self) -> int:
        """The ranks gradients are averaged (and ZeRO shards) over: dp x cp, as ParallelDims.data_axis_size."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def data_shard_size(self) -> int:
        """The ranks ZeRO shards a parameter over: the data axis, or under HSDP one replica's dp / R x cp ranks
        (ParallelDims.data_shard_size)."""
        return self.data_axis_size // self.data_parallel_replicate_size

    @property
    def context_a2a_size(self) -> int:
        """How many cp ranks each all-to-all of heads spans: 1 (K/V all-gathered), cp (Ulysses) or the
        hierarchical mode's a2a size (ParallelDims.context_a2a_size)."""
        if self.context_parallel_size == 1:
            return 1
        return {"all_to_all": self.context_parallel_size,
                "hierarchical": self.context_parallel_a2a_size}.get(self.context_parallel_mode, 1)

    def as_dict(self) -> dict:
        return asdict(self)

    def short(self) -> str:
        parts = [f"dp{self.data_parallel_size}", f"tp{self.tensor_parallel_size}", f"pp{self.pipeline_parallel_size}"]
        if self.context_parallel_size > 1:
            parts.insert(1, f"cp{self.context_parallel_size}")
        text = " x ".join(parts)
        extras = []
        if self.data_parallel_replicate_size > 1:
            extras.append(f"hsdp{self.data_parallel_replicate_size}")
        if self.context_a2a_size > 1:
            extras.append("ulysses" if self.context_a2a_size == self.context_parallel_size
                          else f"a2a{self.context_a2a_size}")
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
        if self.data_parallel_replicate_size > 1:
            out.append(f"train.dist.data_parallel_replicate_size={self.data_parallel_replicate_size}")
        if self.context_parallel_mode != "all_gather":
            out.append(f"train.dist.context_parallel_mode={self.context_parallel_mode}")
        if self.context_parallel_a2a_size > 1:
            out.append(f"train.dist.context_parallel_a2a_size={self.context_parallel_a2a_size}")
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
    optimizer: str = "adamw"  # "adamw" | "muon" (dufu.optim.Muon: AdamW for what is not Muon's) | "sgd"
    sgd_momentum: bool = True  # "sgd": one momentum buffer per parameter (False: none)
    muon_ns_dtype: str = "auto"  # Muon's Newton-Schulz dtype: "fp32", "bf16" or "auto" (bf16 where it is fast)

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
                 t.compile.enabled, *optimizer_of(cfg))


# The optimizer classes the planner knows by their ``optim._target_`` (anything else is planned as AdamW, whose two
# moments per parameter are the most a torch optimizer keeps).
MUON_TARGETS = ("dufu.optim.Muon", "dufu.optim.muon.Muon")
SGD_TARGETS = ("torch.optim.SGD", "torch.optim.sgd.SGD")


def optimizer_of(cfg) -> tuple[str, bool, str]:
    """(kind, SGD with momentum, Muon's Newton-Schulz dtype) of the config's ``optim``: kind "muon" (one momentum
    buffer per Muon matrix, AdamW's two moments for the rest), "sgd" (one momentum buffer, or none) or "adamw"
    (every other optimizer)."""
    optim = cfg.get("optim") if hasattr(cfg, "get") else None
    target = optim.get("_target_", "") if hasattr(optim, "get") else ""
    name = target if isinstance(target, str) else (
        f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}")
    if name in MUON_TARGETS:
        ns = optim.get("ns_dtype", "auto")
        return "muon", True, {"float32": "fp32", "bfloat16": "bf16"}.get(ns, "auto")
    if name in SGD_TARGETS:
        return "sgd", bool(optim.get("momentum", 0) or 0), "auto"
    return "adamw", True, "auto"


def layout_text(layout: dict) -> str:
    """A layout in one line, with dufu's words."""
    cp = layout.get("context_parallel_size", 1)
    text = (f"dp {layout['data_parallel_size']}{f' x cp {cp}' if cp > 1 else ''} x tp "
            f"{layout['tensor_parallel_size']} x pp {layout['pipeline_parallel_size']}")
    extras = []
    if layout.get("data_parallel_replicate_size", 1) > 1:
        R = layout["data_parallel_replicate_size"]
        extras.append(f"hybrid sharding ({R} replicas)")
    mode = layout.get("context_parallel_mode", "all_gather")
    a2a = 1 if cp == 1 else cp if mode == "all_to_all" else (
        layout.get("context_parallel_a2a_size", 1) if mode == "hierarchical" else 1)
    if a2a > 1:
        extras.append("Ulysses all-to-all" if a2a == cp else f"all-to-all within {a2a}")
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
