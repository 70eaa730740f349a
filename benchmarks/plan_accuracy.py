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
``dufu train`` under torchrun as a user starts it (``parallel_memory.worker_job``), with a hook recording every
rank's peak resident set size (RSS) per phase (build, train, checkpoint; ``benchmarks/harness/memory.py``),
glibc malloc with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the system, so RSS follows live
tensors) and one thread per process.

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

import parallel_memory
from harness import machine, proc, results as results_files
from harness.launch import read_metrics
from harness.memory import phase_mib
from harness.results import fmt
from parallel_memory import BASELINE_MODEL, MEMORY_MODEL, MEMORY_SEQ, QUICK_MEMORY_MODEL
from plan_accuracy_report import compare, observations, plot, report, summary

CORES = os.cpu_count() or 1

GLOBAL_BATCH = 4  # sequences; micro-batch 1 (parallel_memory.worker_job): dp 4 accumulates 1, pp 2 gets 4 micro-batches
STEPS, WARMUP = 6, 2
QUICK_STEPS, QUICK_WARMUP = 5, 2
ALLOCATOR = "mmap64k"  # harness.memory.ALLOCATORS: MALLOC_MMAP_THRESHOLD_=65536
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
    run, ranks = parallel_memory.worker_job(label, layout.nproc, GLOBAL_BATCH, model, layout.overrides(), ALLOCATOR,
                                            work,
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
    parallel_memory.prepare_data_cache()  # tokenize once, here: no measured run pays for it
    counts = parallel_memory.parameter_counts(model)
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
            "threads_per_process": 1, "allocator": parallel_memory.ALLOCATORS[ALLOCATOR],
            "baseline_model": BASELINE_MODEL,
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


# ----------------------------------------------------------------------------- main
def add_predictions(results: dict) -> None:
    estimate, error = load_estimate()
    if estimate is None:
        print(f"dufu.plan is not importable ({error}): writing the measured columns only.", flush=True)
        results["planner"] = {"available": False, "error": error}
        results["predictions"] = None
    else:
        results["planner"] = {"available": True, "dufu_commit": machine.dufu_commit(),
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
    results_files.write(stem, results, report(results))
    drew = plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if drew else " (no plot: matplotlib is missing)"))


def run_measurements(args, layouts: list[Layout]) -> dict:
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
    t0, busy0 = time.perf_counter(), proc.system_busy_seconds()
    results = {"date": results_files.today(), "quick": args.quick, "machine": machine.describe(),
               "cores": CORES, "load_avg_start": round(load0, 2)}
    try:
        model = QUICK_MEMORY_MODEL if args.quick else MEMORY_MODEL
        results["measured"] = measure(layouts, model, steps, warmup, work, cache, args.timeout,
                                      lambda msg: print(msg, flush=True))
    finally:
        if tmp is not None:
            tmp.cleanup()
    results["measure_s"] = time.perf_counter() - t0
    results["cpu_s"] = proc.own_cpu_seconds()
    busy1 = proc.system_busy_seconds()
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
    out_dir = Path(args.results_dir) if args.results_dir else results_files.RESULTS
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
        stem = results_files.stem(out_dir, "plan-accuracy", results["date"])
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
