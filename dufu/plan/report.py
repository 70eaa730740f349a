"""What ``dufu plan`` prints: the breakdown of one layout, the ranking of a search, JSON, and a memory plot."""

from __future__ import annotations

import json

from dufu.plan.device import as_dict
from dufu.plan.layout import layout_text
from dufu.plan.memory import KEYS
from dufu.plan.search import Estimate, Plan

GiB = 1024**3
TIME_NAMES = {
    "compute": "compute", "dp_copies": "FSDP buffer copies",
    "tp_comm": "tensor-parallel communication", "ep_comm": "expert-parallel all-to-all",
    "cp_comm": "context-parallel K/V all-gathers",
    "dp_comm": "data-parallel communication",
    "dp_comm_exposed": "data-parallel communication not hidden", "bubble": "pipeline bubble",
    "p2p": "pipeline point-to-point", "optimizer": "optimizer step",
}
MEMORY_NAMES = {
    "parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer states",
    "activations": "activations", "communication": "communication buffers",
    "pipeline_in_flight": "pipeline in-flight micro-batches", "temporaries": "temporaries (logits, grads, casts)",
}


def _bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:,.2f} GiB"
    return f"{n / 1024**2:,.1f} MiB"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.1f} ms"


def breakdown(est: Estimate) -> str:
    """The per-rank peak memory and the step time of one estimate, part by part."""
    lines = [f"layout   {layout_text(est.layout)}",
             f"         {est.world_size} x {est.hardware}, {est.dtype}"]
    lines.append(f"memory   {_bytes(est.memory_per_gpu_bytes)} per device at its peak ({est.peak_where}); "
                 f"{_bytes(est.memory_limit_bytes)} available: {'fits' if est.fits else 'DOES NOT FIT'}")
    for key in KEYS:
        value = est.memory.get(key, 0)
        if value:
            lines.append(f"         {MEMORY_NAMES[key]:<36} {_bytes(value):>12}")
    if len(est.memory_by_rank) > 1:
        lines.append("         per pipeline rank: " + ", ".join(_bytes(m) for m in est.memory_by_rank))
    lines.append(f"time     {_seconds(est.step_time_s)} per optimizer step: {est.tokens_per_s:,.0f} tokens/s, "
                 f"{est.model_tflops_per_gpu:,.3g} TFLOP/s of model FLOPs per device (MFU {100 * est.mfu:.1f}%)")
    for key, value in est.time.items():
        if value and key != "dp_comm_exposed":
            extra = ""
            if key == "dp_comm":
                extra = f"  ({_seconds(est.time.get('dp_comm_exposed', 0.0))} not hidden by computation)"
            lines.append(f"         {TIME_NAMES.get(key, key):<36} {_seconds(value):>12}{extra}")
    lines += [f"note     {n}" for n in est.notes]
    return "\n".join(lines)


def table(plan: Plan, top: int = 10) -> str:
    """The ranking of a search: the best ``top`` layouts, then why the others lost."""
    if not plan:
        return "no layout to show"
    best = plan.best
    rows = [("#", "layout", "step", "tokens/s", "memory/device", "fits", "why not the best")]
    for i, e in enumerate(plan[:top]):
        why = e.reason if e is not best else "best"
        rows.append((str(i + 1), layout_text(e.layout), _seconds(e.step_time_s), f"{e.tokens_per_s:,.0f}",
                     _bytes(e.memory_per_gpu_bytes), "yes" if e.fits else "no", why))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        out.append("  ".join(r[c].ljust(widths[c]) if c == 1 else r[c].rjust(widths[c])
                             for c in range(len(widths))) + "  " + r[-1])
    rest = len(plan) - top
    if rest > 0:
        slower = sum(1 for e in plan[top:] if e.fits)
        out.append(f"... and {rest} more estimated: {slower} slower, {rest - slower} that do not fit")
    if plan.rejected:
        reasons: dict = {}
        for _, why in plan.rejected:
            reasons.setdefault(why.split(". ")[0], 0)
            reasons[why.split(". ")[0]] += 1
        out.append(f"{len(plan.rejected)} candidate(s) dufu would refuse at start-up, e.g.:")
        for why, n in sorted(reasons.items(), key=lambda x: -x[1])[:3]:
            out.append(f"  {n} x {why}.")
    out += [f"note: {n}" for n in plan.notes]
    return "\n".join(out)


def to_json(plan: Plan, hardware=None) -> str:
    """``{"layouts": [...], "best": {...}}`` (best is null when nothing fits)."""
    data = {
        "layouts": [e.as_dict() for e in plan],
        "best": plan.best.as_dict() if plan.best is not None else None,
        "auto": list(plan.auto),
        "rejected": [{"layout": layout, "reason": why} for layout, why in plan.rejected],
        "notes": list(plan.notes),
    }
    if hardware is not None:
        data["hardware"] = as_dict(hardware)
    return json.dumps(data, indent=1, default=str)


def plot_memory(plan: Plan, path: str, top: int = 8) -> str:
    """Stacked bars of the per-device peak memory of the first ``top`` layouts against the device's limit."""
    import matplotlib  # here, not at the top: about a second to import, for --plot only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    shown = list(plan[:top])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shown) + 3), 5))
    tallest = max((e.memory_per_gpu_bytes for e in shown), default=0)
    limit_bytes = shown[0].memory_limit_bytes if shown else 0
    scale, unit = (GiB, "GiB") if max(tallest, min(limit_bytes, 3 * tallest)) >= GiB else (1024**2, "MiB")
    bottoms = [0.0] * len(shown)
    x = list(range(len(shown)))
    for key in KEYS:
        values = [e.memory.get(key, 0) / scale for e in shown]
        if not any(values):
            continue
        ax.bar(x, values, bottom=bottoms, label=MEMORY_NAMES[key])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    title_extra = ""
    if limit_bytes and limit_bytes <= 2.5 * tallest:
        limit = limit_bytes / scale
        ax.axhline(limit, color="black", linestyle="--", linewidth=1)
        ax.text(len(shown) - 0.5, limit, f" available {limit:,.1f} {unit}", va="bottom", ha="right", fontsize=8)
    elif limit_bytes:
        title_extra = f" (available: {limit_bytes / GiB:,.1f} GiB, off the chart)"
    labels = []
    for e in shown:
        lay = e.layout
        labels.append(f"dp{lay['data_parallel_size']} tp{lay['tensor_parallel_size']} pp{lay['pipeline_parallel_size']}"
                      + (f" ep{lay['expert_parallel_size']}" if lay.get("expert_parallel_size", 1) > 1 else "")
                      + (f" cp{lay['context_parallel_size']}" if lay.get("context_parallel_size", 1) > 1 else "")
                      + f"\nmb{lay['micro_batch_size']}" + (f" z{lay['zero_stage']}" if lay["zero_stage"] else "")
                      + (" ckpt" if lay["activation_checkpoint"] else ""))
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(f"peak memory per device ({unit})")
    hw = shown[0].hardware if shown else ""
    ax.set_title(f"dufu plan: per-device peak memory on {hw}{title_extra}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
