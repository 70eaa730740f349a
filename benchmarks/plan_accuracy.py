"""How well ``dufu plan`` predicts: per-rank peak memory and step time of real training runs on this machine,
predicted vs measured, layout by layout, in one table.

    python benchmarks/plan_accuracy.py                   # measure every layout (~8 minutes on 2 cores), predict
    python benchmarks/plan_accuracy.py --only measure    # the runs only: measured columns, written to the .json
    python benchmarks/plan_accuracy.py --only compare    # predictions for the newest results .json (no runs)
    python benchmarks/plan_accuracy.py --quick --results-dir /tmp/pa   # 4 layouts of a small model (~1 minute)
    python benchmarks/plan_accuracy.py --layouts 1proc,dp2z3,tp2sp

**What runs.** ``gpt_debug`` scaled up until model state dominates (the memory model of
``benchmarks/parallel.py``: 8 layers, hidden 512, 8 heads, vocabulary 8,192, sequence 64; 29.4M parameters),
AdamW, no dropout, no compile, in 18 layouts: one process (fp32, bf16 autocast, full activation checkpointing),
DDP and ZeRO 1/2/3 at dp 2, ZeRO 1/2/3 at dp 4, tp2, tp2 + SP (also with full activation checkpointing), pp2
with 1F1B and with interleaved 1F1B (2 stages per rank), dp2 x tp2, dp2 x pp2, and dp2 ZeRO-3 in bf16. Every
layout trains ``--steps`` steps (default 6) of the same global batch (4 sequences of 64 tokens, micro-batch 1,
so the accumulation steps, which are a pipeline's micro-batches, are 4 / dp). Each run is
``benchmarks/_worker.py`` under torchrun (``parallel.worker_job``): ``dufu train`` as a user starts it, plus
every rank's peak resident set size (RSS) per phase (build, train, checkpoint), glibc malloc with
``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the system, so RSS follows live tensors) and one
thread per process.

**Measured memory** = per rank, the process's peak RSS over the whole run minus the peak RSS of the same rank in
a baseline run: the same command (layout, dtype, checkpointing) with a tiny model (1 layer, or one per pipeline
stage, hidden 64), which holds what every process holds anyway (Python, torch, gloo, data: ~300 MiB). The
larger of the ranks is compared with the prediction (pipeline ranks differ: the last stage holds the head).

**Measured step time** = the median ``step_time_s`` of rank 0's ``metrics.jsonl`` (one record per step; the
trainer reduces each window's time over the ranks) over the steps after ``--warmup`` (default 2).

**Predicted** = ``dufu.plan.estimate(cfg, world_size=N, hardware="cpu")`` on the same config and overrides the
run had: ``memory_per_gpu_bytes`` and ``step_time_s``. A prediction is within tolerance when it is within 10%
(memory) or 25% (step time) of the measurement. On a CPU the processes of a layout share the machine's cores
(here 2 cores, up to 4 processes of one thread), so the results record the cores and the processes per core of
every layout: a prediction for ``cpu`` has to account for that. When ``dufu.plan`` cannot be imported the
script says so and writes the measured columns only; ``--only compare`` adds the predictions later (and can run
again whenever the planner changes: the results say when, and on which commit, the predictions were made).

The results also record the load average and the CPU seconds every other process on the machine used while the
runs were measured (``/proc/stat`` minus the runs' own): step times are only comparable on an otherwise idle
machine. ``--note TEXT`` adds a sentence to the results (e.g. what else was running).

Results: ``benchmarks/results/plan-accuracy-<YYYY-MM-DD>.json`` and ``.md``, and ``.png`` (predicted vs
measured per layout); ``--quick`` writes them only with ``--results-dir``. ``--only compare`` rewrites the files
of the measurement it reads. Run directories and ``DUFU_CACHE_DIR`` live in a temporary directory (``--work-dir``
keeps them).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _machine
import parallel
from parallel import (BASELINE_MODEL, CORES, MEMORY_MODEL, MEMORY_SEQ, QUICK_MEMORY_MODEL, REPO, MiB, fmt,
                      phase_mib, read_metrics, table)

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.25
GLOBAL_BATCH = 4  # sequences; micro-batch 1 (parallel.worker_job): dp 4 accumulates 1, pp 2 gets 4 micro-batches
STEPS, WARMUP = 6, 2
QUICK_STEPS, QUICK_WARMUP = 5, 2
ALLOCATOR = "mmap64k"  # parallel.ALLOCATORS: MALLOC_MMAP_THRESHOLD_=65536
CONFIG = "gpt_debug"


@dataclass(frozen=True)
class Layout:
    """One measured layout: parallel degrees, ZeRO stage (0: off, i.e. DDP when dp > 1), the pipeline schedule
    and its stages per rank, activation checkpointing and the compute dtype."""

    key: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    schedule: str = "1f1b"
    virtual: int = 1
    checkpointing: str | None = None  # train.activation_checkpoint.mode, None: off
    dtype: str = "fp32"

    @property
    def nproc(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def title(self) -> str:
        parts = []
        if self.dp > 1:
            parts.append(f"dp{self.dp} " + (f"ZeRO-{self.zero}" if self.zero else "DDP"))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + (" + SP" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp} " + ("1F1B" if self.virtual == 1 else f"interleaved x{self.virtual}"))
        text = " x ".join(parts) or "1 process"
        if self.checkpointing:
            text += f", {self.checkpointing} AC"
        return text + (f", {self.dtype}" if self.dtype != "fp32" else "")

    def overrides(self) -> list[str]:
        o = [f"train.dist.data_parallel_size={self.dp}", f"train.dist.tensor_parallel_size={self.tp}",
             f"train.dist.pipeline_parallel_size={self.pp}", f"train.dist.sequence_parallel={self.sp}"]
        if self.pp > 1:
            o += [f"train.dist.pipeline_schedule={self.schedule}", f"train.dist.virtual_pipeline_size={self.virtual}"]
        o += (["train.zero_optimization.enabled=True", f"train.zero_optimization.stage={self.zero}"] if self.zero
              else ["train.zero_optimization.enabled=False"])
        o.append(f"train.activation_checkpoint.enabled={self.checkpointing is not None}")
        if self.checkpointing:
            o.append(f"train.activation_checkpoint.mode={self.checkpointing}")
        o.append("train.amp.enabled=" + ("False" if self.dtype == "fp32" else self.dtype))
        # Compilation would add a warm-up of its own that a few steps cannot hide.
        return o + ["train.compile.enabled=False"]

    def describe(self) -> dict:
        return {"key": self.key, "layout": self.title, "nproc": self.nproc, "dp": self.dp, "tp": self.tp,
                "pp": self.pp, "sequence_parallel": self.sp, "zero_stage": self.zero,
                "pipeline_schedule": self.schedule if self.pp > 1 else None,
                "virtual_stages": self.virtual, "activation_checkpoint": self.checkpointing, "dtype": self.dtype,
                "accumulation_steps": GLOBAL_BATCH // self.dp}


LAYOUTS = [
    Layout("1proc"),
    Layout("1proc-bf16", dtype="bf16"),
    Layout("1proc-ac", checkpointing="full"),
    Layout("dp2", dp=2),
    Layout("dp2z1", dp=2, zero=1),
    Layout("dp2z2", dp=2, zero=2),
    Layout("dp2z3", dp=2, zero=3),
    Layout("dp2z3-bf16", dp=2, zero=3, dtype="bf16"),
    Layout("dp4z1", dp=4, zero=1),
    Layout("dp4z2", dp=4, zero=2),
    Layout("dp4z3", dp=4, zero=3),
    Layout("tp2", tp=2),
    Layout("tp2sp", tp=2, sp=True),
    Layout("tp2sp-ac", tp=2, sp=True, checkpointing="full"),
    Layout("pp2", pp=2),
    Layout("pp2i", pp=2, schedule="interleaved_1f1b", virtual=2),
    Layout("dp2tp2", dp=2, tp=2),
    Layout("dp2pp2", dp=2, pp=2),
]
QUICK_LAYOUTS = ["1proc", "dp2z3", "tp2sp", "pp2i"]
BY_KEY = {layout.key: layout for layout in LAYOUTS}


# ----------------------------------------------------------------------------- measuring
def spread(values: list[float]) -> dict:
    return {"max": max(values), "min": min(values), "per_rank": values}


def run_overrides(cmd: list[str]) -> list[str]:
    """The ``key=value`` overrides a run's command gave ``dufu train`` (its temporary output directory left out):
    what the prediction's config gets too."""
    return [a for a in cmd[cmd.index(CONFIG) + 1:] if not a.startswith("train.output_dir=")]


def step_times(out: Path, warmup: int) -> dict:
    """Rank 0's logged steps: every step time and loss, and the median step time after ``warmup`` steps."""
    recs = read_metrics(out)
    timed = [r["step_time_s"] for r in recs if r["step"] > warmup]
    return {"step_times_s": [r["step_time_s"] for r in recs], "losses": [r["loss"] for r in recs],
            "timed_steps": len(timed), "median_step_time_s": statistics.median(timed) if timed else None}


def one_run(label: str, layout: Layout, model: dict, steps: int, warmup: int, work: Path, cache: Path,
            timeout: float) -> dict:
    run, ranks = parallel.worker_job(label, layout.nproc, GLOBAL_BATCH, model, layout.overrides(), ALLOCATOR, work,
                                     cache, timeout, steps=steps)
    rec = {"label": label, "model": model, "returncode": run.rc, "wall_s": round(run.seconds, 1),
           "load_avg_before": round(run.load_before, 2), "overrides": run_overrides(run.cmd),
           **step_times(work / "memory" / label / "run", warmup)}
    if ranks is None:
        rec["error"] = run.log_tail or "no memory record was written"
    else:
        rec["ranks"] = ranks
        rec["peak_mib"] = [phase_mib(r, "peak") for r in ranks]
    return rec


def baseline_model(layout: Layout) -> dict:
    """The tiny model, with one layer per pipeline stage."""
    return {**BASELINE_MODEL, "num_layers": max(BASELINE_MODEL["num_layers"], layout.pp * layout.virtual)}


def derive_row(row: dict) -> None:
    """Per rank: the model run minus the baseline run, for the whole run's peak and each phase."""
    run, base = row["run"], row.get("baseline") or {}
    if "ranks" not in run or "ranks" not in base:
        return
    for phase in ("peak", "build", "train", "checkpoint"):
        row[f"{phase}_minus_baseline_mib"] = spread(
            [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(run["ranks"], base["ranks"])])


def measure(layouts: list[Layout], model: dict, steps: int, warmup: int, work: Path, cache: Path, timeout: float,
            progress) -> dict:
    """Every layout after its baseline (the same command with the tiny model; identical commands share one)."""
    parallel.prepare_data_cache()  # tokenize once, here: no measured run pays for it
    counts = parallel.parameter_counts(model)
    baselines: dict[tuple, dict] = {}
    rows = []
    n_jobs = len({tuple(layout.overrides()) for layout in layouts}) + len(layouts)
    i = 0
    for layout in layouts:
        key = tuple(layout.overrides())
        if key not in baselines:
            i += 1
            base = one_run(f"baseline-{layout.key}", layout, baseline_model(layout), steps, warmup, work, cache,
                           timeout)
            baselines[key] = base
            state = (f"peak RSS per rank {', '.join(f'{p:,.0f}' for p in base['peak_mib'])} MiB"
                     if "peak_mib" in base else f"FAILED (exit {base['returncode']})")
            progress(f"[{i}/{n_jobs}] baseline {layout.title:<26} {state}  "
                     f"[{base['wall_s']:.0f} s, load {base['load_avg_before']:.1f}]")
        i += 1
        row = {**layout.describe(), "baseline": baselines[key],
               "run": one_run(layout.key, layout, model, steps, warmup, work, cache, timeout)}
        derive_row(row)
        run = row["run"]
        if "peak_minus_baseline_mib" in row:
            t = run["median_step_time_s"]
            msg = (f"peak - baseline {row['peak_minus_baseline_mib']['max']:,.0f} MiB (largest rank), "
                   f"step {fmt(t and 1000 * t)} ms (median of {run['timed_steps']})")
        else:
            last = ((run.get("error") or "").strip().splitlines() or ["baseline failed"])[-1][:160]
            msg = f"FAILED (exit {run['returncode']}): {last}"
        progress(f"[{i}/{n_jobs}] {layout.title:<35} {layout.nproc} proc  {msg}  "
                 f"[{run['wall_s']:.0f} s, load {run['load_avg_before']:.1f}]")
        rows.append(row)
    ref = next((r for r in rows if r["key"] == "1proc" and r["run"]["losses"]), None)
    for r in rows:
        n = min(len(r["run"]["losses"]), len(ref["run"]["losses"])) if ref else 0
        if n and r["dtype"] == "fp32":
            r["max_abs_loss_diff_vs_1proc"] = max(abs(a - b) for a, b in
                                                  zip(r["run"]["losses"][:n], ref["run"]["losses"][:n]))
    return {"config": CONFIG, "model": model, "parameters": counts["total"], "seq_length": MEMORY_SEQ,
            "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1, "steps": steps, "warmup": warmup,
            "threads_per_process": 1, "allocator": parallel.ALLOCATORS[ALLOCATOR], "baseline_model": BASELINE_MODEL,
            "rows": rows}


# ----------------------------------------------------------------------------- predicting and comparing
def load_estimate():
    """``dufu.plan.estimate``, or the reason it cannot be imported."""
    try:
        from dufu.plan import estimate
    except Exception as e:  # noqa: BLE001 - any import failure means: no predictions, say why
        return None, f"{type(e).__name__}: {e}"
    return estimate, None


def config_for(overrides: list[str]):
    """The run's config: the recipe with the run's own overrides."""
    from dufu.config import LazyConfig, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path(CONFIG)))
    return LazyConfig.apply_overrides(cfg, overrides)


def _plain(x):
    """A JSON-ready copy of an estimate's breakdown (numbers as numbers, anything else as its text)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, (int, float)):
        return x if math.isfinite(x) else str(x)
    return str(x)


def predict(rows: list[dict], estimate) -> dict:
    """key -> the planner's figures for that row's config and world size (or the error it raised)."""
    out = {}
    for r in rows:
        try:
            est = estimate(config_for(r["run"]["overrides"]), world_size=r["nproc"], hardware="cpu")
            out[r["key"]] = {"memory_per_gpu_bytes": float(est.memory_per_gpu_bytes),
                             "step_time_s": float(est.step_time_s), "memory": _plain(est.memory),
                             "time": _plain(est.time), "layout": _plain(est.layout)}
        except Exception as e:  # noqa: BLE001 - one layout the planner rejects must not hide the others
            out[r["key"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured or measured <= 0:
        return None
    return predicted / measured


def compare(rows: list[dict], predictions: dict | None, cores: int) -> list[dict]:
    """Per layout: measured and predicted memory (MiB) and step time (s), predicted / measured, within tolerance;
    ``cores``: the CPU cores of the machine that measured (processes per core)."""
    out = []
    for r in rows:
        p = (predictions or {}).get(r["key"], {})
        mem = (r.get("peak_minus_baseline_mib") or {}).get("max")
        t = r["run"].get("median_step_time_s") if "peak_minus_baseline_mib" in r else None
        pmem = p["memory_per_gpu_bytes"] / MiB if "memory_per_gpu_bytes" in p else None
        pt = p.get("step_time_s")
        mr, tr = _ratio(pmem, mem), _ratio(pt, t)
        out.append({
            "key": r["key"], "layout": r["layout"], "nproc": r["nproc"], "processes_per_core": r["nproc"] / cores,
            "measured_memory_mib": mem, "predicted_memory_mib": pmem, "memory_ratio": mr,
            "memory_within": None if mr is None else abs(mr - 1) <= MEMORY_TOLERANCE,
            "measured_step_time_s": t, "predicted_step_time_s": pt, "time_ratio": tr,
            "time_within": None if tr is None else abs(tr - 1) <= TIME_TOLERANCE,
            "prediction_error": p.get("error"),
        })
    return out


def summary(comparison: list[dict]) -> dict:
    """How many layouts are within tolerance, of those with both a measurement and a prediction."""
    def count(what: str, tol: float, label: str) -> dict:
        judged = [c for c in comparison if c[f"{what}_within"] is not None]
        n = sum(c[f"{what}_within"] for c in judged)
        return {"within": n, "compared": len(judged), "tolerance": tol,
                "line": f"{label}: {n} of {len(judged)} within {100 * tol:.0f}%"}
    return {"memory": count("memory", MEMORY_TOLERANCE, "Peak memory per rank"),
            "time": count("time", TIME_TOLERANCE, "Step time")}


# ----------------------------------------------------------------------------- reporting
def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f} ({100 * (ratio - 1):+.0f}%)"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def _span(d: dict | None) -> str:
    """max over ranks, the min in parentheses where ranks differ by 5 MiB or more."""
    if d is None:
        return "-"
    return f"{d['max']:,.0f}" if d["max"] - d["min"] < 5 else f"{d['max']:,.0f} ({d['min']:,.0f})"


def comparison_table(results: dict) -> list[str]:
    rows = {r["key"]: r for r in results["measured"]["rows"]}
    body = []
    for c in results["comparison"]:
        r = rows[c["key"]]
        failed = "peak_minus_baseline_mib" not in r
        ms = lambda s: fmt(s and 1000 * s)  # noqa: E731
        body.append([
            c["layout"], str(c["nproc"]), f"{c['processes_per_core']:g}",
            "failed" if failed else _span(r["peak_minus_baseline_mib"]), fmt(c["predicted_memory_mib"]),
            _pct(c["memory_ratio"]), _verdict(c["memory_within"]),
            "failed" if failed else ms(c["measured_step_time_s"]), ms(c["predicted_step_time_s"]),
            _pct(c["time_ratio"]), _verdict(c["time_within"]),
            _span(r.get("train_minus_baseline_mib")), fmt(r["baseline"].get("peak_mib") and max(r["baseline"]["peak_mib"])),
            fmt(r["run"]["load_avg_before"], ".1f"),
        ])
    return table(["layout", "procs", "procs / core", "measured MiB (peak - baseline)", "predicted MiB",
                  "predicted / measured", "within 10%", "measured ms/step", "predicted ms/step",
                  "predicted / measured", "within 25%", "train phase - baseline MiB", "baseline peak RSS MiB",
                  "load avg at start"], body)


def observations(results: dict) -> list[str]:
    obs = list(results.get("notes", []))
    m = results["measured"]
    failed = [r["layout"] for r in m["rows"] if "peak_minus_baseline_mib" not in r]
    if failed:
        obs.append(f"Failed runs: {', '.join(failed)} (the JSON file holds the log tail).")
    diffs = [r["max_abs_loss_diff_vs_1proc"] for r in m["rows"] if "max_abs_loss_diff_vs_1proc" in r]
    if diffs:
        obs.append(f"The fp32 layouts log the same losses as the 1-process run to within {max(diffs):.1e} (largest "
                   "absolute difference): every layout trains the same model on the same samples.")
    by_nproc: dict[int, list[float]] = {}
    for r in m["rows"]:
        t = r["run"].get("median_step_time_s")
        if t and r["dtype"] == "fp32" and not r["activation_checkpoint"]:
            by_nproc.setdefault(r["nproc"], []).append(t)
    if by_nproc:
        obs.append("Measured fp32 step time by process count (median over layouts): "
                   + ", ".join(f"{n} proc {1000 * statistics.median(v):,.0f} ms" for n, v in sorted(by_nproc.items()))
                   + f"; {results['machine']['logical_cpus']} cores: more processes than cores share them.")
    planner = results.get("planner") or {}
    if planner.get("available"):
        errors = [c for c in results["comparison"] if c["prediction_error"]]
        if errors:
            obs.append("The planner raised for " + "; ".join(f"{c['layout']}: {c['prediction_error'][:200]}"
                                                              for c in errors) + ".")
        for what, label in (("memory", "memory"), ("time", "step time")):
            ratios = [c[f"{what}_ratio"] for c in results["comparison"] if c[f"{what}_ratio"] is not None]
            if ratios:
                worst = max(results["comparison"], key=lambda c: abs((c[f"{what}_ratio"] or 1) - 1))
                obs.append(f"Predicted / measured {label}: {min(ratios):.2f} to {max(ratios):.2f} "
                           f"(median {statistics.median(ratios):.2f}); furthest off: {worst['layout']} "
                           f"({worst[f'{what}_ratio']:.2f}).")
    return obs


def report(results: dict) -> str:
    info, m = results["machine"], results["measured"]
    lines = [f"# Planner accuracy - {results['date']}", ""]
    # The load average counts the measured runs' own processes (up to 4 here), so it cannot say whether other
    # work ran; the CPU time of everything else on the machine can.
    load = (f"Load average {results['load_avg_start']:.2f} at the start, {results['load_avg_end']:.2f} at the end "
            "(the runs' own processes included).")
    others = results.get("other_cpu_s")
    if others is not None:
        share = others / (results["measure_s"] * info["logical_cpus"])
        load += (f" Other processes used {others:,.0f} CPU seconds meanwhile, {100 * share:.0f}% of the cores"
                 + (": the step times are slower than on an idle machine." if share > 0.05 else "."))
    lines.append(f"Machine: {info['cpu']}, {info['logical_cpus']} cores, {info.get('memory_gib')} GiB RAM; torch "
                 f"{info['torch']}, Python {info['python']}, {info.get('libc', '')}; dufu {info.get('dufu_commit')}. "
                 f"Measuring took {results['measure_s']:.0f} s, {results['cpu_s']:.0f} CPU seconds in the runs. {load}")
    lines.append("")
    lines.append(
        f"`{m['config']}` with {m['model']}: {m['parameters']:,} parameters; AdamW, no compile; global batch "
        f"{m['global_batch_size']} sequences x {m['seq_length']} tokens, micro-batch {m['micro_batch_size']}; "
        f"{m['steps']} steps, the first {m['warmup']} left out of the step time; one thread per process, "
        f"`MALLOC_MMAP_THRESHOLD_=65536`. Measured memory: per rank, the whole run's peak RSS minus the same rank's "
        f"peak in a baseline run (the same command with a {m['baseline_model']['num_layers']}-layer, hidden-"
        f"{m['baseline_model']['hidden_size']} model, one layer per pipeline stage), the largest rank (the "
        "smallest in parentheses where ranks differ by 5 MiB or more). Measured step time: median `step_time_s` of "
        "the logged steps after warm-up. Predicted: `dufu.plan.estimate(cfg, world_size=N, hardware=\"cpu\")` on "
        f"the run's config: `memory_per_gpu_bytes`, `step_time_s`. {info['logical_cpus']} cores are shared by the "
        "processes of a layout (procs / core).")
    lines.append("")
    planner = results.get("planner") or {}
    if planner.get("available"):
        probe = planner.get("cpu_probe")
        probe_text = (f" CPU figures: {probe['source']}; one-thread calibration step {probe['calibration_1_thread_s']:.4f} s, "
                      f"{probe['op_overhead_us']} us per op, gloo {probe['gloo_bandwidth_gbs']} GB/s and "
                      f"{probe['gloo_latency_us']} us, new memory {probe['page_fault_gbs']} GB/s." if probe else "")
        lines += [f"Predictions made {planner.get('predicted_at', '?')} with dufu {planner.get('dufu_commit', '?')}."
                  + probe_text,
                  ""]
    else:
        lines += [f"**No predictions**: `dufu.plan` could not be imported ({planner.get('error', 'not run')}); "
                  "measured columns only (`python benchmarks/plan_accuracy.py --only compare` adds them).", ""]
    lines += comparison_table(results)
    lines.append("")
    if planner.get("available"):
        s = results["summary"]
        lines += [f"**{s['memory']['line']}**; **{s['time']['line']}**.", ""]
    obs = observations(results)
    if obs:
        lines += ["## Observations", ""] + [f"* {o}" for o in obs] + [""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Predicted vs measured per layout (memory, step time), the tolerance band shaded; measured bars alone when
    there are no predictions. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    comp = results["comparison"]
    panels = [("memory", "peak memory per rank above baseline (MiB)", 1.0, MEMORY_TOLERANCE),
              ("step_time", "step time (ms)", 1000.0, TIME_TOLERANCE)]
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    for ax, (what, label, scale, tol) in zip(axes, panels):
        ratio_key = "memory" if what == "memory" else "time"
        pts = [(c["key"], c[f"measured_{what}" + ("_mib" if what == "memory" else "_s")],
                c[f"predicted_{what}" + ("_mib" if what == "memory" else "_s")], c[f"{ratio_key}_within"])
               for c in comp]
        have = [(k, m * scale, p * scale, ok) for k, m, p, ok in pts if m is not None and p is not None]
        if have:
            lo = min(min(m, p) for _, m, p, _ in have) * 0.8
            hi = max(max(m, p) for _, m, p, _ in have) * 1.2
            xs = [lo, hi]
            ax.plot(xs, xs, color="black", lw=1)
            ax.fill_between(xs, [x * (1 - tol) for x in xs], [x * (1 + tol) for x in xs], color="tab:green",
                            alpha=0.15, label=f"within {100 * tol:.0f}%")
            spots: dict[tuple, list] = {}  # layouts within ~2% of each other in both axes share one label
            for k, m, p, ok in have:
                spots.setdefault((round(50 * math.log(m)), round(50 * math.log(p)), ok), []).append((k, m, p))
            for i, ((_, _, ok), group) in enumerate(sorted(spots.items(), key=lambda s: s[1][0][1])):
                m, p = group[0][1], group[0][2]
                ax.scatter([m], [p], color="tab:green" if ok else "tab:red", zorder=3)
                # neighbours along x alternate above and below their point, so labels overlap less
                ax.annotate(", ".join(k for k, _, _ in group), (m, p), textcoords="offset points",
                            xytext=(5, 4 if i % 2 == 0 else -11), fontsize=7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, minor ticks at 2, 3, 5 x 10^k
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
                axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if f"{v:.0e}"[0] in "1235" else ""))
            ax.tick_params(axis="both", which="minor", labelsize=7)
            ax.set_xlabel(f"measured {label}")
            ax.set_ylabel(f"predicted {label}")
            ax.legend(loc="upper left")
            missing = [k for k, m, p, _ in pts if m is not None and p is None]
            if missing:
                ax.set_title("no prediction: " + ", ".join(missing), fontsize=8)
        else:
            meas = [(k, m * scale) for k, m, _, _ in pts if m is not None]
            ax.barh([k for k, _ in meas], [m for _, m in meas], color="tab:blue")
            ax.invert_yaxis()
            ax.set_xlabel(f"measured {label}")
            ax.set_title("no predictions", fontsize=9)
    info = results["machine"]
    fig.suptitle(f"dufu plan vs measured, {results['measured']['parameters'] / 1e6:.1f}M-parameter GPT, "
                 f"{info['logical_cpus']} CPU cores, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main
def add_predictions(results: dict) -> None:
    estimate, error = load_estimate()
    if estimate is None:
        print(f"dufu.plan is not importable ({error}): writing the measured columns only.", flush=True)
        results["planner"] = {"available": False, "error": error}
        results["predictions"] = None
    else:
        results["planner"] = {"available": True, "dufu_commit": parallel.machine_info()["dufu_commit"],
                              "predicted_at": _dt.datetime.now().isoformat(timespec="minutes"),
                              "cpu_probe": cpu_probe()}
        results["predictions"] = predict(results["measured"]["rows"], estimate)
    finish(results)


def cpu_probe() -> dict:
    """The figures of this machine's CPU the predictions used (``dufu plan``'s cached probe, see dufu.plan.cpu):
    step-time predictions move with them, and two probes of one machine can differ (a probe taken while other
    work runs reads slower)."""
    from dufu.plan.cpu import measured_cpu

    hw = measured_cpu()
    return {"source": hw.source, "calibration_1_thread_s": hw.calibration.get(1),
            "op_overhead_us": round(hw.op_overhead_s * 1e6, 2),
            "gloo_bandwidth_gbs": round(hw.intra_node_bandwidth / 1e9, 2),
            "gloo_latency_us": round(hw.intra_latency_s * 2e6, 1),
            "page_fault_gbs": round(hw.page_fault_bandwidth / 1e9, 2)}


def finish(results: dict) -> None:
    """The comparison and summary from the measurements and predictions the results hold."""
    results["comparison"] = compare(results["measured"]["rows"], results.get("predictions"), results["cores"])
    results["summary"] = summary(results["comparison"])
    results["observations"] = observations(results)


def newest_results(out_dir: Path) -> Path | None:
    found = sorted(out_dir.glob("plan-accuracy-*.json"))
    return found[-1] if found else None


def write(results: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(report(results))
    drew = plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if drew else " (no plot: matplotlib is missing)"))


def machine() -> dict:
    """_machine's description plus what parallel.py records (RAM, libc, the dufu commit)."""
    extra = parallel.machine_info()
    return _machine.machine_info(**{k: extra[k] for k in ("memory_gib", "libc", "dufu_commit")})


def run_measurements(args, layouts: list[Layout]) -> dict:
    import resource

    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    if warmup >= steps:
        raise SystemExit(f"--warmup {warmup} leaves no timed steps out of --steps {steps}")
    tmp = None
    if args.work_dir:
        work = Path(args.work_dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="dufu-plan-accuracy-")
        work = Path(tmp.name)
    cache = work / "cache"
    os.environ["DUFU_CACHE_DIR"] = str(cache)  # this process tokenizes the corpus: not into the user's cache
    load0 = os.getloadavg()[0]
    if load0 > CORES:
        print(f"warning: load average {load0:.1f} on {CORES} cores: other work is running, step times will be "
              "noisy.", flush=True)
    t0, busy0 = time.perf_counter(), _machine.system_busy_seconds()
    results = {"date": _dt.date.today().isoformat(), "quick": args.quick, "machine": machine(),
               "cores": CORES, "load_avg_start": round(load0, 2)}
    try:
        model = QUICK_MEMORY_MODEL if args.quick else MEMORY_MODEL
        results["measured"] = measure(layouts, model, steps, warmup, work, cache, args.timeout,
                                      lambda msg: print(msg, flush=True))
    finally:
        if tmp is not None:
            tmp.cleanup()
    results["measure_s"] = time.perf_counter() - t0
    kids, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    results["cpu_s"] = kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime
    busy1 = _machine.system_busy_seconds()
    if busy0 is not None and busy1 is not None:  # every process's CPU time minus this script's and its runs'
        results["other_cpu_s"] = max(0.0, busy1 - busy0 - results["cpu_s"])
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"development run: layouts {', '.join(QUICK_LAYOUTS)} of "
                                                         f"a small model, {QUICK_STEPS} steps")
    ap.add_argument("--only", choices=["measure", "compare"],
                    help="measure: the runs only (measured columns); compare: predictions for an earlier "
                         "measurement (--measurements, default the newest results .json; measured now if none)")
    ap.add_argument("--measurements", metavar="PATH", help="the results .json --only compare reads")
    ap.add_argument("--layouts", help=f"comma-separated layouts (default: all): {', '.join(BY_KEY)}")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {STEPS}; quick "
                                                            f"{QUICK_STEPS})")
    ap.add_argument("--warmup", type=int, default=None, help=f"steps left out of the step time (default {WARMUP})")
    ap.add_argument("--results-dir", default=None, help="where to write the results (default benchmarks/results)")
    ap.add_argument("--work-dir", default=None, help="keep run directories and the dufu cache here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    ap.add_argument("--note", action="append", default=[],
                    help="a sentence about the measurement (e.g. what else ran), kept in the results (repeatable)")
    args = ap.parse_args(argv)
    keys = args.layouts.split(",") if args.layouts else (QUICK_LAYOUTS if args.quick else list(BY_KEY))
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(BY_KEY)}")
    out_dir = Path(args.results_dir or REPO / "benchmarks" / "results")
    save = not args.quick or args.results_dir is not None

    results, stem = None, None
    if args.only == "compare":
        path = Path(args.measurements) if args.measurements else newest_results(out_dir)
        if path is not None and path.exists():
            print(f"measurements from {path}", flush=True)
            results, stem, save = json.loads(path.read_text()), path.with_suffix(""), True
        else:
            print(f"no measurements found ({args.measurements or out_dir / 'plan-accuracy-*.json'}): measuring now",
                  flush=True)
    if results is None:
        results = run_measurements(args, [BY_KEY[k] for k in keys])
        stem = out_dir / f"plan-accuracy-{results['date']}"
    results["notes"] = [*results.get("notes", []), *args.note]
    if args.only == "measure":
        results["planner"], results["predictions"] = {"available": False, "error": "not run (--only measure)"}, None
        finish(results)
    else:
        add_predictions(results)
    print()
    print(report(results))
    if save:
        write(results, stem)
    failed = [r for r in results["measured"]["rows"] if "peak_minus_baseline_mib" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
