"""``estimate`` one layout, ``search`` the layouts a config leaves ``auto``.

A search enumerates every combination of the ``auto`` fields (:data:`dufu.engine.schema.AUTO_KEYS`), drops those
dufu would refuse at start-up (:func:`dufu.parallel.checks.validate_layout`, the same check ``dufu train`` runs,
with the same message: heads, hidden size, vocabulary, layers per stage, micro-batches per pipeline), estimates the
rest and ranks those that fit by predicted throughput (tokens, or samples, per second: layouts that differ in
global batch size are compared fairly). Micro-batch sizes are tried from small to large; once one does not fit,
the larger ones of that layout are not estimated.

For a model with mixture-of-experts layers, ``train.dist.auto=True`` also searches the expert-parallel size
(``train.dist.expert_parallel_size``, :data:`dufu.plan.candidates.EP_KEY`): every size that divides the
data-parallel size and every layer's number of experts. A dense model's layouts have none. The candidates are
enumerated by :mod:`dufu.plan.candidates`.

The context-parallel size (``train.dist.context_parallel_size``, :data:`dufu.plan.candidates.CP_KEY`): set to auto,
every divisor of the world size is a candidate (those ``dufu train`` refuses are counted with its message). Under
``train.dist.auto=True`` it is searched only where it can matter (:func:`_context_pass`): for a model that declares
``supports_context_parallel``, with sizes whose 2 x cp chunks divide the sequence, and only when the layouts
without it leave a need that splitting a sample serves and splitting the batch cannot: none of them fits (a
single sample's activations are too large for a device), or the global batch has fewer samples than there are
processes (data parallelism cannot give every rank one).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from dufu.config import ConfigDict, LazyConfig
from dufu.engine.validate import resolve_batch_sizes
from dufu.errors import ConfigError, DufuError, LayoutError
from dufu.layers.mla import MLA
from dufu.models.base import contract_of
from dufu.parallel.checks import validate_layout
from dufu.parallel.parallel_dims import ParallelDims
from dufu.plan.hardware import Hardware, get_hardware
from dufu.engine.schema import AUTO_KEYS, is_auto
from dufu.plan.cpu import assumed_figures
from dufu.plan.candidates import (CP_KEY, EP_KEY, context_parallel_sizes, fixed_int, pipeline_counts_differ,
                                  structures, with_micro_batches)
from dufu.plan.layout import Layout, Setup, layout_text, setup_from_config
from dufu.plan.memory import KEYS, estimate_memory
from dufu.plan.shapes import ModelInfo, build_model_info
from dufu.plan.trace import get_trace
from dufu.plan.timing import estimate_time

GiB = 1024**3


@dataclass
class Estimate:
    """The prediction for one layout on one device type."""

    layout: dict
    memory: dict  # per-rank peak by part (bytes), the worst rank's
    memory_per_gpu_bytes: int
    time: dict  # seconds per optimizer step by part
    step_time_s: float
    fits: bool
    world_size: int
    hardware: str
    dtype: str
    tokens_per_step: int
    tokens_per_s: float
    samples_per_s: float
    model_flops_per_step: float  # 6N + 12 L H T per token (dufu's MFU convention), over the global batch
    model_tflops_per_gpu: float
    mfu: float
    hardware_flops_per_gpu_step: float  # what the traced ops compute on the busiest rank, recomputation included
    memory_limit_bytes: int  # what tensors may use on one device (its memory less what the runtime keeps)
    peak_where: str
    memory_by_rank: list = field(default_factory=list)  # per pipeline rank: peak bytes
    # the worst rank's model states at rest (its optimizer step): {"parameters", "gradients", "optimizer"} bytes
    model_states: dict = field(default_factory=dict)
    reason: str = ""  # why it is not the best ("slower: ...", "does not fit: ...")
    notes: list = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens_per_s

    def layout_summary(self) -> str:
        return layout_text(self.layout)

    def as_dict(self) -> dict:
        return {
            **self.layout, "step_time_s": self.step_time_s, "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
            "fits": self.fits, "memory": self.memory, "time": self.time, "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu,
            "memory_limit_bytes": self.memory_limit_bytes, "peak_where": self.peak_where,
            "memory_by_rank": self.memory_by_rank, "model_states": self.model_states, "dtype": self.dtype,
            "world_size": self.world_size, "hardware": self.hardware, "reason": self.reason,
        }


class Plan(list):
    """``search``'s result: the estimates, best first, plus the candidates dufu would refuse (``rejected``: (layout
    dict, reason)) and what the search noticed (``notes``)."""

    def __init__(self, items=(), rejected=None, notes=None, auto=None):
        super().__init__(items)
        self.rejected = rejected or []
        self.notes = notes or []
        self.auto = auto or []

    @property
    def best(self) -> Optional[Estimate]:
        return self[0] if self and self[0].fits else None


# ------------------------------------------------------------------------------------------------- helpers

_INFO_CACHE: "OrderedDict[str, ModelInfo]" = OrderedDict()


def model_info(cfg) -> ModelInfo:
    """The model of ``cfg`` (built once per distinct model, delta and sequence settings, kept for a few configs)."""
    train = cfg.get("dataloader", {}).get("train", {})
    key = repr(cfg.model) + "|" + repr(cfg.get("delta")) + "|" + repr(
        {k: train.get(k) for k in ("seq_length", "inputs_length", "image_size") if hasattr(train, "get")})
    if key in _INFO_CACHE:
        _INFO_CACHE.move_to_end(key)
        return _INFO_CACHE[key]
    info = build_model_info(cfg)
    _INFO_CACHE[key] = info
    while len(_INFO_CACHE) > 6:
        _INFO_CACHE.popitem(last=False)
    return info


def _get(node, dotted: str):
    for part in dotted.split("."):
        node = node[part] if part in node else None
        if node is None:
            return None
    return node


def auto_fields(cfg) -> list[str]:
    """The searchable keys whose value is ``auto``. ``train.dist.auto=True`` makes all of them auto, the micro-batch
    size only when ``train.global_batch_size`` fixes the batch it divides."""
    if cfg.train.dist.auto is True:
        # the expert-parallel size only for MoE (_with_experts), the context-parallel size by its rule (_context_pass)
        keys = [k for k in AUTO_KEYS if k not in (EP_KEY, CP_KEY)]
        if cfg.train.global_batch_size is None and not is_auto(cfg.train.train_micro_batch_size):
            keys.remove("train.train_micro_batch_size")
        return keys + [k for k in (EP_KEY, CP_KEY) if is_auto(_get(cfg, k))]
    return [k for k in dict.fromkeys(AUTO_KEYS + (EP_KEY,)) if is_auto(_get(cfg, k))]


def _with_experts(cfg, autos: list[str], info: ModelInfo) -> list[str]:
    """``autos`` plus the expert-parallel size when ``train.dist.auto=True`` leaves it to the search of a MoE
    model."""
    if info.expert_counts and EP_KEY not in autos and cfg.train.dist.auto is True:
        return autos + [EP_KEY]
    return autos


def _dist_cfg(cfg, layout: Layout) -> ConfigDict:
    """The config's ``train.dist`` node with ``layout``'s values."""
    d = ConfigDict(cfg.train.dist)
    d.update(data_parallel_size=layout.data_parallel_size, tensor_parallel_size=layout.tensor_parallel_size,
             pipeline_parallel_size=layout.pipeline_parallel_size, sequence_parallel=layout.sequence_parallel,
             virtual_pipeline_size=layout.virtual_pipeline_size, pipeline_schedule=layout.pipeline_schedule,
             expert_parallel_size=layout.expert_parallel_size, context_parallel_size=layout.context_parallel_size,
             data_parallel_replicate_size=layout.data_parallel_replicate_size,
             context_parallel_mode=layout.context_parallel_mode,
             context_parallel_a2a_size=layout.context_parallel_a2a_size)
    d.pop("auto", None)
    return d


def check_layout(info: ModelInfo, cfg, layout: Layout) -> None:
    """Raise LayoutError exactly where ``dufu train`` would, for ``layout`` on ``info``'s model."""
    dims = ParallelDims(layout.data_parallel_size, layout.tensor_parallel_size, layout.pipeline_parallel_size,
                        layout.world_size, layout.expert_parallel_size, layout.context_parallel_size,
                        data_parallel_replicate_size=layout.data_parallel_replicate_size,
                        context_parallel_mode=layout.context_parallel_mode,
                        context_parallel_a2a_size=layout.context_parallel_a2a_size)
    zero_cfg = ConfigDict(cfg.train.zero_optimization, enabled=bool(layout.zero_stage), stage=layout.zero_stage or 1)
    stage_ids = validate_layout(dims, info.model, _dist_cfg(cfg, layout), zero_cfg, info.seq_length,
                                layout.num_accumulation_steps)
    if stage_ids is not None and contract_of(info.model).pipeline_loss is None:
        raise LayoutError(f"{info.name} defines no `pipeline_loss`; use pipeline_parallel_size=1.")


def layout_from_config(cfg, world_size: int) -> Layout:
    """The layout a config without ``auto`` values runs on ``world_size`` processes."""
    t = cfg.train
    dims = ParallelDims.from_config(t.dist, world_size)
    micro = fixed_int(t.train_micro_batch_size, "train.train_micro_batch_size")
    micro, global_, accum = resolve_batch_sizes(micro, t.global_batch_size, t.num_accumulation_steps,
                                                dims.data_parallel_size)
    zero = t.zero_optimization
    ckpt = t.activation_checkpoint
    return Layout(dims.data_parallel_size, dims.tensor_parallel_size, dims.pipeline_parallel_size,
                  bool(t.dist.sequence_parallel), int(t.dist.virtual_pipeline_size or 1),
                  t.dist.pipeline_schedule, micro, accum, global_,
                  int(zero.stage) if zero.enabled else 0, ckpt.mode if ckpt.enabled else False,
                  dims.expert_parallel_size, dims.context_parallel_size, dims.data_parallel_replicate_size,
                  dims.context_parallel_mode, dims.context_parallel_a2a_size)


def _memory_limit(hw: Hardware, world_size: int) -> int:
    """Bytes tensors may use on one device: its memory less what the runtime keeps; on a CPU the machine's memory
    is shared by every process of the job."""
    usable = hw.memory_bytes - hw.reserved_bytes
    if hw.synchronous:
        usable /= max(1, min(world_size, hw.devices_per_node))
    return int(usable)


def evaluate(info: ModelInfo, setup: Setup, layout: Layout, hw: Hardware, world_size: int) -> Estimate:
    """The estimate of a layout already known to be valid."""
    trace = get_trace(info, setup.dtype, layout.activation_checkpoint or None, "cpu" if hw.synchronous else "cuda",
                      layout.expert_parallel_size, layout.context_parallel_size, layout.context_a2a_size)
    worst, ranks = estimate_memory(info, trace, layout, setup, asynchronous=not hw.synchronous)
    times, details = estimate_time(info, trace, layout, setup, hw, world_size)
    step = details["step_time_s"]
    samples = layout.global_batch_size
    tokens = samples * info.tokens_per_sample
    model_flops = info.flops_per_token * tokens
    peak = hw.peak(setup.dtype, details["threads_per_process"])
    limit = _memory_limit(hw, world_size)
    memory = _memory_parts(worst)
    per_gpu = sum(memory.values())
    est = Estimate(
        layout=_layout_dict(layout), memory=memory, memory_per_gpu_bytes=per_gpu, time=times, step_time_s=step,
        fits=per_gpu <= limit, world_size=world_size, hardware=hw.name, dtype=setup.dtype, tokens_per_step=tokens,
        tokens_per_s=tokens / step, samples_per_s=samples / step, model_flops_per_step=model_flops,
        model_tflops_per_gpu=model_flops / step / world_size / 1e12,
        mfu=model_flops / step / (peak * world_size) if peak else 0.0,
        hardware_flops_per_gpu_step=details["flops_per_rank_step"], memory_limit_bytes=limit,
        peak_where=f"pipeline rank {worst.rank}, {worst.where}" if layout.pipeline_parallel_size > 1 else worst.where,
        memory_by_rank=[int(r.peak) for r in ranks],
        model_states={k: int(round(v)) for k, v in worst.states.items()},
    )
    assumed = assumed_figures(hw)
    if assumed:
        est.notes.append(f"{hw.name}: {assumed} -- assumed, not measured; the step time rests on these stand-ins")
    if info.trainable < info.num_params:
        est.notes.append(f"delta run: {info.trainable:,} of {info.num_params:,} parameters train; gradients and "
                         "optimizer states are counted for those only")
    if layout.zero_stage == 1:
        est.notes.append("ZeRO stage 1 runs with stage-2 sharding in dufu (same communication, less memory)")
    if info.expert_counts:
        est.notes.append("mixture of experts: FLOPs are those of the top_k experts a token uses, memory holds every "
                         "expert (1 / ep of them per rank), the routing is taken as balanced")
    cp, a2a = layout.context_parallel_size, layout.context_a2a_size
    if cp > 1 and a2a == 1:
        est.notes.append(f"context parallelism: traced as rank 0 of {cp} (T / cp tokens, the whole K and V "
                         "gathered per layer); its all-gathers and reduce-scatters are not overlapped")
    elif cp > 1:
        across = f", K and V all-gathered across {cp // a2a} groups" if a2a < cp else ""
        est.notes.append(f"context parallelism: traced as rank 0 of {cp} (T / cp tokens; attention heads exchanged by "
                         f"all-to-alls over {a2a} ranks{across}); its collectives are not overlapped")
    if layout.data_parallel_replicate_size > 1:
        R = layout.data_parallel_replicate_size
        est.notes.append(f"hybrid sharding: {R} replicas of {layout.data_shard_size} shards; ZeRO's gathers run inside "
                         "a replica, the gradient shards are all-reduced across replicas")
    mla = next((m for m in info.model.modules() if isinstance(m, MLA)), None)
    if mla is not None:
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.dtype, torch.float32)
        full = mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * low.itemsize
        kept = mla.cache_bytes_per_token(low)
        est.notes.append(f"multi-head latent attention: generation's KV cache keeps {kept:,} B per token and layer "
                         f"in {setup.dtype} (the compressed latent and the rotary key), against "
                         f"{full:,} B for its {mla.num_heads} heads' full keys and values")
    if setup.optimizer == "muon":
        est.notes.append("Muon: one momentum buffer per hidden matrix (AdamW's two moments for the rest); every rank "
                         "orthogonalises every matrix whole (Newton-Schulz), after one all-gather of each sharded one")
    return est


def _memory_parts(worst) -> dict:
    """The peak's bytes by part (KEYS)."""
    memory = {k: int(round(worst.breakdown.get(k, 0.0))) for k in KEYS}
    for k in KEYS:  # a part freed by another part's events (stage boundaries) can read a few bytes below zero
        if memory[k] < 0:
            memory["temporaries"] += memory[k]
            memory[k] = 0
    memory["temporaries"] = max(memory["temporaries"], 0)
    return memory


@dataclass
class PeakMemory:
    """The per-rank peak of a layout alone (no step time, no device figures): what a running job puts beside its
    measured peak (dufu.engine.reporting.memory.planned_memory)."""

    memory_per_gpu_bytes: int
    peak_where: str
    memory_by_rank: list


def estimate_peak_memory(cfg, world_size: int, device_type: str = "cpu") -> PeakMemory:
    """:func:`estimate`'s memory alone, for a config whose ``train.amp.enabled`` names its precision (a running job
    knows it): no device is measured, and the timing model is not calibrated (about half of estimate()'s cost)."""
    info = model_info(cfg)
    setup = setup_from_config(cfg, None)
    layout = layout_from_config(cfg, world_size)
    check_layout(info, cfg, layout)
    asynchronous = device_type == "cuda"
    trace = get_trace(info, setup.dtype, layout.activation_checkpoint or None, "cuda" if asynchronous else "cpu",
                      layout.expert_parallel_size, layout.context_parallel_size, layout.context_a2a_size)
    worst, ranks = estimate_memory(info, trace, layout, setup, asynchronous=asynchronous)
    where = f"pipeline rank {worst.rank}, {worst.where}" if layout.pipeline_parallel_size > 1 else worst.where
    return PeakMemory(sum(_memory_parts(worst).values()), where, [int(r.peak) for r in ranks])


def _layout_dict(layout: Layout) -> dict:
    d = layout.as_dict()
    return {
        "data_parallel_size": d["data_parallel_size"], "tensor_parallel_size": d["tensor_parallel_size"],
        "pipeline_parallel_size": d["pipeline_parallel_size"], "sequence_parallel": d["sequence_parallel"],
        "virtual_pipeline_size": d["virtual_pipeline_size"], "pipeline_schedule": d["pipeline_schedule"],
        "micro_batch_size": d["micro_batch_size"], "num_accumulation_steps": d["num_accumulation_steps"],
        "global_batch_size": d["global_batch_size"], "zero_stage": d["zero_stage"],
        "activation_checkpoint": d["activation_checkpoint"], "expert_parallel_size": d["expert_parallel_size"],
        "context_parallel_size": d["context_parallel_size"],
        "data_parallel_replicate_size": d["data_parallel_replicate_size"],
        "context_parallel_mode": d["context_parallel_mode"],
        "context_parallel_a2a_size": d["context_parallel_a2a_size"],
    }


# ------------------------------------------------------------------------------------------------ public API


def estimate(cfg, world_size: int, hardware="cpu", hardware_files=None) -> Estimate:
    """Predict per-rank peak memory and step time of ``cfg``'s layout on ``world_size`` devices of ``hardware``
    (a name, a dict of figures or a :class:`Hardware`). ``cfg`` is a loaded config with overrides applied and no
    ``auto`` values (see :func:`search` for those)."""
    autos = auto_fields(cfg)
    if autos:
        raise ConfigError(f"estimate() takes a config without auto values, but {', '.join(autos)} "
                          f"{'is' if len(autos) == 1 else 'are'} auto; use dufu.plan.search() to choose them.")
    hw = get_hardware(hardware, hardware_files)
    info = model_info(cfg)
    setup = setup_from_config(cfg, hw)
    layout = layout_from_config(cfg, world_size)
    check_layout(info, cfg, layout)
    return evaluate(info, setup, layout, hw, world_size)


def search(cfg, world_size: int, hardware="cpu", hardware_files=None, max_micro_batch: int = 1024) -> Plan:
    """Every valid layout for the ``auto`` fields of ``cfg`` on ``world_size`` devices, best first (fitting ones by
    predicted throughput, then the others by memory); without ``auto`` fields, the config's own layout alone."""
    hw = get_hardware(hardware, hardware_files)
    info = model_info(cfg)
    setup = setup_from_config(cfg, hw)
    autos = _with_experts(cfg, auto_fields(cfg), info)
    if not autos:
        layout = layout_from_config(cfg, world_size)
        check_layout(info, cfg, layout)
        est = evaluate(info, setup, layout, hw, world_size)
        if not est.fits:
            est.reason = _miss(est)
        return Plan([est], auto=[])
    rejected, estimates, notes = [], [], []

    def run(candidates) -> None:
        for structure in candidates:
            checked = False
            for mb_layout in with_micro_batches(cfg, structure, autos, setup, max_micro_batch, rejected):
                try:
                    if not checked:
                        # everything but the micro-batch count once per structure (heads, vocabulary, layers ...)
                        check_layout(info, cfg, replace(mb_layout,
                                                        num_accumulation_steps=64 * mb_layout.pipeline_parallel_size))
                        checked = True
                    if pipeline_counts_differ(mb_layout):
                        check_layout(info, cfg, mb_layout)
                except DufuError as e:
                    rejected.append((_layout_dict(mb_layout), " ".join(str(e).split())))
                    if not checked:
                        break
                    continue
                est = evaluate(info, setup, mb_layout, hw, world_size)
                estimates.append(est)
                if not est.fits:
                    break  # a larger micro-batch only needs more memory

    requested = cfg.train.dist.auto is True and CP_KEY not in autos
    run(structures(cfg, world_size, autos, info, cps=[1] if requested else None))
    cps = _context_pass(cfg, info, autos, estimates, world_size)
    if cps:
        autos = autos + [CP_KEY]
        run(structures(cfg, world_size, autos, info, cps=cps))
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: -e.tokens_per_s)
    others = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_per_gpu_bytes)
    if fitting:
        best = fitting[0]
        best.reason = "best"
        for e in fitting[1:]:
            detail = explain(e, best)
            e.reason = (f"slower: {e.tokens_per_s / best.tokens_per_s:.2f}x the best's throughput"
                        + (f" ({detail})" if detail else ""))
    for e in others:
        e.reason = _miss(e)
    if not estimates and rejected:
        notes.append("no candidate layout is valid for this model and world size")
    if any(e.layout["zero_stage"] for e in estimates) and "train.zero_optimization.stage" in autos:
        notes.append("ZeRO stage 1 is not searched: dufu runs it with stage-2 sharding, so it equals stage 2")
    return Plan(fitting + others, rejected=rejected, notes=notes, auto=autos)


_TIME_WORDS = {"compute": "compute", "dp_copies": "FSDP buffer copies",
               "tp_comm": "tensor-parallel communication", "ep_comm": "expert-parallel all-to-all",
               "cp_comm": "context-parallel K/V all-gathers",
               "dp_comm_exposed": "data-parallel communication not hidden", "bubble": "pipeline bubble",
               "p2p": "pipeline point-to-point", "optimizer": "optimizer step"}


def _context_pass(cfg, info: ModelInfo, autos: list[str], estimates: list, world_size: int) -> list[int]:
    """The context-parallel sizes > 1 that ``train.dist.auto=True`` adds to a search whose layouts without them
    are ``estimates`` (the rule of the module docstring), or []."""
    if CP_KEY in autos or cfg.train.dist.auto is not True:
        return []
    if not contract_of(info.model).supports_context_parallel:
        return []
    global_ = cfg.train.global_batch_size
    if any(e.fits for e in estimates) and not (global_ is not None and global_ < world_size):
        return []
    return [c for c in context_parallel_sizes(world_size, info.seq_length, every=False) if c > 1]


def explain(worse: Estimate, best: Estimate) -> str:
    """Why ``worse`` is slower than ``best``: the (at most two) parts of the step time that differ most."""
    def sec(s: float) -> str:
        return f"{s:,.2f} s" if s >= 1 else f"{s * 1e3:,.1f} ms"

    diffs = []
    for key, words in _TIME_WORDS.items():
        d = worse.time.get(key, 0.0) - best.time.get(key, 0.0)
        if abs(d) > 0.01 * best.step_time_s:
            diffs.append((abs(d), key, words))
    diffs.sort(reverse=True)
    return "; ".join(f"{words} {sec(worse.time.get(k, 0.0))} vs {sec(best.time.get(k, 0.0))}"
                     for _, k, words in diffs[:2])


def _miss(e: Estimate) -> str:
    over = e.memory_per_gpu_bytes - e.memory_limit_bytes
    return (f"does not fit: {e.memory_per_gpu_bytes / GiB:,.1f} GiB per device, {over / GiB:,.1f} GiB over the "
            f"{e.memory_limit_bytes / GiB:,.1f} GiB available")


def apply_layout(cfg, layout_dict: dict):
    """A copy of ``cfg`` with the concrete values of ``layout_dict`` (an Estimate's ``layout``)."""
    cfg = copy.deepcopy(cfg)
    if "auto" in cfg.train.dist:
        cfg.train.dist["auto"] = False
    layout = Layout(**layout_dict)
    overrides = layout.overrides()
    if layout.expert_parallel_size == 1 and "expert_parallel_size" in cfg.train.dist:
        overrides.append("train.dist.expert_parallel_size=1")
    if layout.context_parallel_size == 1 and "context_parallel_size" in cfg.train.dist:
        overrides.append("train.dist.context_parallel_size=1")
    if layout.context_parallel_mode == "all_gather" and "context_parallel_mode" in cfg.train.dist:
        overrides.append("train.dist.context_parallel_mode=all_gather")
    if layout.context_parallel_a2a_size == 1 and "context_parallel_a2a_size" in cfg.train.dist:
        overrides.append("train.dist.context_parallel_a2a_size=1")
    if cfg.train.global_batch_size is None:
        overrides.append(f"train.num_accumulation_steps={layout.num_accumulation_steps}")
    return LazyConfig.apply_overrides(cfg, overrides)
