"""``dufu train`` with ``auto`` layout values (or ``train.dist.auto=True``): run the planner's best layout.

:func:`resolve_auto_layout` is called by ``dufu train`` before anything else reads the layout, on the device type
the run will use and the world size it is started with. With ``--nproc`` the launcher decides once and hands the
workers the chosen values as overrides (:func:`resolved_overrides`), with the reason in ``DUFU_PLAN_NOTICE`` for
the start-up summary; a worker started by torchrun directly decides for itself, from the same inputs as every
other (this CPU's measured figures are read from one cache file, written once under a lock; a GPU's come from
the catalog).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

import torch

from dufu.errors import LayoutError
from dufu.plan.cpu import measured_cpu
from dufu.plan.hardware import CATALOG, Hardware
from dufu.plan.report import _bytes, _seconds, layout_text
from dufu.plan.search import search
from dufu.engine.schema import auto_layout_keys


def has_auto(cfg) -> bool:
    """Whether the config leaves any layout setting to the planner (cheap: no planner import needed)."""
    return bool(auto_layout_keys(cfg))


def hardware_for_run(cfg) -> Hardware:
    """The device a run trains on, as the planner knows it: this CPU (measured), or the catalog's GPU whose name and
    memory match ``torch.cuda``'s device."""
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda"):
        return measured_cpu()
    props = torch.cuda.get_device_properties(0)
    name = props.name.upper()
    memory_gb = props.total_memory / 1e9
    best: Optional[Hardware] = None
    for hw in CATALOG.values():
        family = hw.name.split("-")[0].upper()
        if family in name.replace(" ", "") or family in name:
            if best is None or abs(hw.memory_bytes / 1e9 - memory_gb) < abs(best.memory_bytes / 1e9 - memory_gb):
                best = hw
    if best is None:
        raise LayoutError(
            f"train.dist auto values need the planner's figures for this GPU ({props.name}), which dufu plan's "
            "catalog lacks. Add it to a hardware file ($DUFU_HARDWARE, see docs/plan.md), or set the layout "
            "explicitly."
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or best.devices_per_node))
    return replace(best, devices_per_node=per_node)


def resolve_auto_layout(cfg, world_size: int, hardware: Optional[Hardware] = None) -> Optional[str]:
    """Replace the config's ``auto`` layout values by the planner's best layout for ``world_size`` processes (in
    place); return the start-up summary's line saying which layout was chosen and why, or None without auto."""
    if not has_auto(cfg):
        return None
    requested = cfg.train.dist.auto is True
    hw = hardware or hardware_for_run(cfg)
    plan = search(cfg, world_size, hw)
    best = plan.best
    if best is None:
        if not plan:
            reasons = "; ".join(sorted({why for _, why in plan.rejected})[:2])
            raise LayoutError(f"no layout of {world_size} processes is valid for this model: {reasons}")
        closest = plan[0]
        over = closest.memory_per_gpu_bytes - closest.memory_limit_bytes
        raise LayoutError(
            f"no layout of {world_size} x {hw.name} fits this model: the closest ({layout_text(closest.layout)}) "
            f"needs {closest.memory_per_gpu_bytes / 2**30:,.1f} GiB per device, {over / 2**30:,.1f} GiB more than "
            f"the {closest.memory_limit_bytes / 2**30:,.1f} GiB available. Use more processes or smaller batches "
            "(`dufu plan` shows every candidate)."
        )
    _apply(cfg, best.layout)
    fitting = sum(1 for e in plan if e.fits)
    runner_up = next((e for e in plan[1:] if e.fits), None)
    why = f"best of {fitting} layouts that fit" if fitting > 1 else "the only layout that fits"
    if runner_up is not None:
        why += f" (next: {layout_text(runner_up.layout)}, {runner_up.reason.removeprefix('slower: ')})"
    if requested:
        auto = "train.dist.auto=True"
    else:
        auto = "auto " + ", ".join(k.removeprefix("train.").removeprefix("dist.") for k in plan.auto)
    return (f"layout chosen by the planner for {auto}: {layout_text(best.layout)}; predicted "
            f"{_seconds(best.step_time_s)} per step and {_bytes(best.memory_per_gpu_bytes)} per process on "
            f"{hw.name}; {why}")


def _apply(cfg, layout: dict) -> None:
    t = cfg.train
    d = t.dist
    if "auto" in d:
        d["auto"] = False
    d.data_parallel_size = layout["data_parallel_size"]
    d.tensor_parallel_size = layout["tensor_parallel_size"]
    d.pipeline_parallel_size = layout["pipeline_parallel_size"]
    d.sequence_parallel = layout["sequence_parallel"]
    d.virtual_pipeline_size = layout["virtual_pipeline_size"]
    d.pipeline_schedule = layout["pipeline_schedule"]
    ep = layout.get("expert_parallel_size", 1)
    if ep > 1 or "expert_parallel_size" in d:
        d.expert_parallel_size = ep
    cp = layout.get("context_parallel_size", 1)
    if cp > 1 or "context_parallel_size" in d:
        d.context_parallel_size = cp
    for key, default in (("context_parallel_mode", "all_gather"), ("context_parallel_a2a_size", 1)):
        if key in layout and (layout[key] != default or key in d):  # a searched cp of 1 runs without a mode
            d[key] = layout[key]
    t.train_micro_batch_size = layout["micro_batch_size"]
    if t.global_batch_size is None:
        t.num_accumulation_steps = layout["num_accumulation_steps"]
    t.zero_optimization.enabled = bool(layout["zero_stage"])
    t.zero_optimization.stage = layout["zero_stage"] or 1
    ckpt = layout["activation_checkpoint"]
    t.activation_checkpoint.enabled = bool(ckpt)
    if ckpt:
        t.activation_checkpoint.mode = ckpt


# What _apply writes: the keys a launcher passes on to its workers as overrides.
RESOLVED_KEYS = ("train.dist.data_parallel_size", "train.dist.tensor_parallel_size",
                 "train.dist.pipeline_parallel_size", "train.dist.sequence_parallel",
                 "train.dist.virtual_pipeline_size", "train.dist.pipeline_schedule",
                 "train.dist.expert_parallel_size", "train.dist.context_parallel_size", "train.train_micro_batch_size",
                 "train.num_accumulation_steps", "train.zero_optimization.enabled", "train.zero_optimization.stage",
                 "train.activation_checkpoint.enabled", "train.activation_checkpoint.mode")


def resolved_overrides(cfg) -> list[str]:
    """``key=value`` overrides that set a resolved config's layout (after :func:`resolve_auto_layout`)."""
    out = ["train.dist.auto=False"] if "auto" in cfg.train.dist else []
    for key in RESOLVED_KEYS:
        if key.rsplit(".", 1)[1] in ("expert_parallel_size", "context_parallel_size") and \
                key.rsplit(".", 1)[1] not in cfg.train.dist:
            continue  # a config written before expert (context) parallelism had the key, run without it
        node = cfg
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        out.append(f"{key}={'null' if node is None else json.dumps(node)}")
    d = cfg.train.dist
    for key, default in (("context_parallel_mode", "all_gather"), ("context_parallel_a2a_size", 1)):
        if d.get(key, default) != default:  # the context-parallel mode a config sets (kept by the search)
            out.append(f"train.dist.{key}={json.dumps(d[key])}")
    return out
