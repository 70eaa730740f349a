"""How well ``dufu plan`` predicts: per-rank peak memory and step time of real training runs on this machine,
predicted vs measured, layout by layout, in one table.

    python benchmarks/plan_accuracy.py                   # measure every layout (~8 minutes on 2 cores), predict
    python benchmarks/plan_accuracy.py --only measure    # the runs only: measured columns, written to the .json
    python benchmarks/plan_accuracy.py --only compare    # predictions for the newest results .json (no runs)
    python benchmarks/plan_accuracy.py --quick --results-dir /tmp/pa   # 4 layouts of a small model (~1 minute)
    python benchmarks/plan_accuracy.py --layouts 1proc,dp2z3,tp2sp
    python benchmarks/plan_accuracy.py --model held-out  # the held-out models, 8 layouts each (~15 minutes)
    python benchmarks/plan_accuracy.py --model gpt-8x512,held-out --layouts held-out   # with the in-sample reference
    python benchmarks/plan_accuracy.py --model gpt-16x256,llama-8x512 --layouts 1proc,tp2sp

**What runs.** By default the calibration model (``--model gpt-8x512``): ``gpt_debug`` scaled up until model
state dominates (the memory model of ``benchmarks/parallel.py``: 8 layers, hidden 512, 8 heads, vocabulary 8,192,
sequence 64; 29.4M parameters), AdamW, no dropout, no compile, in 18 layouts: one process (fp32, bf16 autocast,
full activation checkpointing), DDP and ZeRO 1/2/3 at dp 2, ZeRO 1/2/3 at dp 4, tp2, tp2 + SP (also with full
activation checkpointing), pp2 with 1F1B and with interleaved 1F1B (2 stages per rank), dp2 x tp2, dp2 x pp2, and
dp2 ZeRO-3 in bf16. Every layout trains ``--steps`` steps (default 6) of the same global batch (4 sequences of
64 tokens, micro-batch 1, so the accumulation steps, which are a pipeline's micro-batches, are 4 / dp). Each run
is ``dufu train`` under torchrun as a user starts it (``parallel_memory.worker_job``), with a hook recording every
rank's peak resident set size (RSS) per phase (build, train, checkpoint; ``benchmarks/harness/memory.py``),
glibc malloc with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the system, so RSS follows live
tensors) and one thread per process.

**Held-out models.** The constants of the CPU cost model (``dufu/plan/cpu.py``: ``_DTENSOR_OP_FACTOR``, the
calibration step's model) were set on that model, so its table is in sample. ``--model`` (repeatable or
comma-separated; ``held-out``: all of them) measures models that were not used to set them, each against a
baseline of its own family (``benchmarks/plan_accuracy_models.py``): ``gpt-16x256`` (deep and narrow),
``gpt-4x1024`` (wide and shallow) and ``llama-8x512`` (another family: RMSNorm, SwiGLU, rotary positions,
grouped-query attention, untied head), by default in the 8 layouts of :data:`HELD_OUT_LAYOUTS` (one process in
fp32 and bf16, dp2 ZeRO-3, dp4 ZeRO-1, tp2 + SP, pp2 1F1B, dp2 x tp2, dp2 x pp2).

**Measured memory** = per rank, the process's peak RSS over the whole run minus the peak RSS of the same rank in a
baseline run: the same command (layout, dtype, checkpointing) with a tiny model of the same family (1 layer, or one
per pipeline stage, hidden 64), which holds what every process holds anyway (Python, torch, gloo, data: ~300 MiB).
The larger of the ranks is compared with the prediction (pipeline ranks differ: the last stage holds the head).

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

The predictions are made with the runs' settings in this process's environment (``OMP_NUM_THREADS=1``,
``MALLOC_MMAP_THRESHOLD_=65536``: ``dufu.plan`` reads them as settings of the runs it predicts) and a CPU probe
taken before the first run, while the machine is as quiet as at the start (the best of each figure over
three probes).

Results: ``benchmarks/results/plan-accuracy-<YYYY-MM-DD>-<model>.json`` and ``.md``, and ``.png`` (predicted vs
measured per layout); with several models also ``plan-accuracy-<YYYY-MM-DD>-heldout.json`` and ``.md`` (``-models``
without a held-out model), one line per model. ``--quick`` writes them only with ``--results-dir``. ``--only
compare`` rewrites the files of the measurement it reads. Run directories and ``DUFU_CACHE_DIR`` live in a temporary
directory (``--work-dir`` keeps them)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import re
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
from parallel_memory import MEMORY_SEQ

from dufu.environment import environment
from plan_accuracy_models import BY_NAME, CALIBRATION, HELD_OUT, Model, select
from plan_accuracy_report import compare, models_report, observations, plot, report, summary

CORES = os.cpu_count() or 1

GLOBAL_BATCH = 4  # sequences; micro-batch 1 (parallel_memory.worker_job): dp 4 accumulates 1, pp 2 gets 4 micro-batches
STEPS, WARMUP = 6, 2
QUICK_STEPS, QUICK_WARMUP = 5, 2
PROBES, QUICK_PROBES = 3, 1  # CPU probes before the runs, each figure's best kept
ALLOCATOR = "mmap64k"  # harness.memory.ALLOCATORS: MALLOC_MMAP_THRESHOLD_=65536


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
# A held-out model's default: one process (fp32, bf16), ZeRO-3 and ZeRO-1, tensor (+ sequence), pipeline and 2-D
HELD_OUT_LAYOUTS = ["1proc", "1proc-bf16", "dp2z3", "dp4z1", "tp2sp", "pp2", "dp2tp2", "dp2pp2"]
BY_KEY = {layout.key: layout for layout in LAYOUTS}
LAYOUT_SETS = {"all": list(BY_KEY), "held-out": HELD_OUT_LAYOUTS, "quick": QUICK_LAYOUTS}  # names for --layouts


# ----------------------------------------------------------------------------- measuring
def spread(values: list[float]) -> dict:
    return {"max": max(values), "min": min(values), "per_rank": values}


def run_overrides(cmd: list[str], recipe: str) -> list[str]:
    """The ``key=value`` overrides a run's command gave ``dufu train RECIPE`` (its temporary output directory left
    out): what the prediction's config gets too."""
    return [a for a in cmd[cmd.index(recipe) + 1:] if not a.startswith("train.output_dir=")]


def step_times(out: Path, warmup: int) -> dict:
    """Rank 0's logged steps: every step time and loss, and the median step time after ``warmup`` steps."""
    recs = read_metrics(out)
    timed = [r["step_time_s"] for r in recs if r["step"] > warmup]
    return {"step_times_s": [r["step_time_s"] for r in recs], "losses": [r["loss"] for r in recs],
            "timed_steps": len(timed), "median_step_time_s": statistics.median(timed) if timed else None}


def one_run(label: str, layout: Layout, recipe: str, sizes: dict, steps: int, warmup: int, work: Path, cache: Path,
            timeout: float) -> dict:
    """``recipe`` with ``sizes`` in ``layout``: the run's record (every rank's memory, the logged steps)."""
    run, ranks = parallel_memory.worker_job(label, layout.nproc, GLOBAL_BATCH, sizes, layout.overrides(), ALLOCATOR,
                                            work, cache, timeout, steps=steps, recipe=recipe)
    rec = {"label": label, "model": sizes, "returncode": run.rc, "wall_s": round(run.seconds, 1),
           "load_avg_before": round(run.load_before, 2), "overrides": run_overrides(run.cmd, recipe),
           **step_times(work / "memory" / label / "run", warmup)}
    if ranks is None:
        rec["error"] = run.log_tail or "no memory record was written"
    else:
        rec["ranks"] = ranks
        rec["peak_mib"] = [phase_mib(r, "peak") for r in ranks]
    return rec


def baseline_model(layout: Layout, model: Model = CALIBRATION) -> dict:
    """The tiny model of ``model``'s family, with one layer per pipeline stage."""
    return {**model.baseline, "num_layers": max(model.baseline["num_layers"], layout.pp * layout.virtual)}


def derive_row(row: dict) -> None:
    """Per rank: the model run minus the baseline run, for the whole run's peak and each phase."""
    run, base = row["run"], row.get("baseline") or {}
    if "ranks" not in run or "ranks" not in base:
        return
    for phase in ("peak", "build", "train", "checkpoint"):
        row[f"{phase}_minus_baseline_mib"] = spread(
            [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(run["ranks"], base["ranks"])])


def measure(layouts: list[Layout], model: Model, quick: bool, steps: int, warmup: int, work: Path, cache: Path,
            timeout: float, progress) -> dict:
    """Every layout of ``model`` (its ``quick`` sizes in a quick run) after its baseline (the same command with
    the model family's tiny model; identical commands share one)."""
    recipe, sizes = model.recipe, (model.quick if quick else model.sizes)
    parallel_memory.prepare_data_cache(recipe)  # tokenize once, here: no measured run pays for it
    counts = parallel_memory.parameter_counts(sizes, recipe)
    baselines: dict[tuple, dict] = {}
    rows = []
    n_jobs = len({tuple(layout.overrides()) for layout in layouts}) + len(layouts)
    i = 0
    for layout in layouts:
        key = tuple(layout.overrides())
        if key not in baselines:
            i += 1
            base = one_run(f"baseline-{layout.key}", layout, recipe, baseline_model(layout, model), steps, warmup,
                           work, cache, timeout)
            baselines[key] = base
            state = (f"peak RSS per rank {', '.join(f'{p:,.0f}' for p in base['peak_mib'])} MiB"
                     if "peak_mib" in base else f"FAILED (exit {base['returncode']})")
            progress(f"[{i}/{n_jobs}] baseline {layout.title:<26} {state}  "
                     f"[{base['wall_s']:.0f} s, load {base['load_avg_before']:.1f}]")
        i += 1
        row = {**layout.describe(), "baseline": baselines[key],
               "run": one_run(layout.key, layout, recipe, sizes, steps, warmup, work, cache, timeout)}
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
    return {**model.describe(quick), "config": recipe, "model": sizes, "parameters": counts["total"],
            "seq_length": MEMORY_SEQ, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1, "steps": steps,
            "warmup": warmup, "threads_per_process": 1, "allocator": parallel_memory.ALLOCATORS[ALLOCATOR],
            "baseline_model": model.baseline, "rows": rows}


# ----------------------------------------------------------------------------- predicting and comparing
def load_estimate():
    """``dufu.plan.estimate``, or the reason it cannot be imported."""
    try:
        from dufu.plan import estimate
    except Exception as e:  # noqa: BLE001 - any import failure means: no predictions, say why
        return None, f"{type(e).__name__}: {e}"
    return estimate, None


def config_for(overrides: list[str], recipe: str = CALIBRATION.recipe):
    """The run's config: the recipe with the run's own overrides."""
    from dufu.config import LazyConfig, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path(recipe)))
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


# The settings of the runs that dufu.plan reads from the planning process's environment as settings of the runs it
# predicts (docs/plan.md): one thread per process, and glibc returning freed memory (whose page faults runs pay).
RUN_SETTINGS = {"OMP_NUM_THREADS": "1", **parallel_memory.ALLOCATORS[ALLOCATOR]}


@contextlib.contextmanager
def planning_as_run(settings: dict):
    """This process's environment with ``settings`` (and no malloc setting the runs did not have), restored after."""
    keys = {*settings, *(k for a in parallel_memory.ALLOCATORS.values() for k in a)}
    with environment({k: settings.get(k) for k in keys}):
        yield


def predict(rows: list[dict], estimate, recipe: str = CALIBRATION.recipe, settings: dict | None = None) -> dict:
    """key -> the planner's figures for that row's config (``recipe`` with the run's overrides) and world size (or
    the error it raised), planned with the runs' ``settings`` (default :data:`RUN_SETTINGS`)."""
    out = {}
    with planning_as_run(RUN_SETTINGS if settings is None else settings):
        for r in rows:
            try:
                est = estimate(config_for(r["run"]["overrides"], recipe), world_size=r["nproc"], hardware="cpu")
                out[r["key"]] = {"memory_per_gpu_bytes": float(est.memory_per_gpu_bytes),
                                 "step_time_s": float(est.step_time_s), "memory": _plain(est.memory),
                                 "time": _plain(est.time), "layout": _plain(est.layout)}
            except Exception as e:  # noqa: BLE001 - one layout the planner rejects must not hide the others
                out[r["key"]] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run_settings(measured: dict) -> dict:
    """The settings of a measurement's runs (:data:`RUN_SETTINGS` for results that predate recording them)."""
    return {"OMP_NUM_THREADS": str(measured.get("threads_per_process", 1)),
            **measured.get("allocator", parallel_memory.ALLOCATORS[ALLOCATOR])}


# ----------------------------------------------------------------------------- main
def add_predictions(results: dict) -> None:
    estimate, error = load_estimate()
    if estimate is None:
        print(f"dufu.plan is not importable ({error}): writing the measured columns only.", flush=True)
        results["planner"] = {"available": False, "error": error}
        results["predictions"] = None
    else:
        m = results["measured"]
        settings = run_settings(m)
        results["planner"] = {"available": True, "dufu_commit": machine.dufu_commit(),
                              "predicted_at": _dt.datetime.now().isoformat(timespec="minutes"),
                              "cpu_probe": cpu_probe(), "settings": settings}
        results["predictions"] = predict(m["rows"], estimate, m.get("config", CALIBRATION.recipe), settings)
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


def probe_first(times: int) -> None:
    """Probe the CPU for the predictions now, before the runs, on the machine as quiet as it is at the start (a
    probe taken right after the runs reads slower), ``times`` times keeping each figure's best (``dufu plan
    --remeasure``: other work only ever makes a reading worse); every prediction of this invocation uses it (unless
    the probe saw other work and was not cached)."""
    if load_estimate()[0] is None:
        return
    from dufu.plan.cpu import measured_cpu

    for i in range(times):
        measured_cpu(remeasure=i > 0)
    probe = cpu_probe()
    print(f"CPU probe for the predictions: {probe['source']}; one-thread calibration step "
          f"{probe['calibration_1_thread_s']:.4f} s, {probe['op_overhead_us']} us per op", flush=True)


def finish(results: dict) -> None:
    """The comparison and summary from the measurements and predictions the results hold."""
    results["comparison"] = compare(results["measured"]["rows"], results.get("predictions"), results["cores"])
    results["summary"] = summary(results["comparison"])
    results["observations"] = observations(results)


def stem_for(out_dir: Path, name: str, date: str) -> Path:
    """``plan-accuracy-<date>-<model>``."""
    return results_files.stem(out_dir, "plan-accuracy", date, name)


def newest_results(out_dir: Path, model: Model = CALIBRATION) -> Path | None:
    """The newest results ``.json`` of ``model`` in ``out_dir`` (None: none); for the calibration model also the
    files that name no model (they predate the others)."""
    tag = "-" + re.escape(model.name) + ("" if model.held_out else "|")
    pattern = re.compile(rf"plan-accuracy-\d{{4}}-\d{{2}}-\d{{2}}(?:{tag})\.json")
    found = sorted(p for p in out_dir.glob("plan-accuracy-*.json") if pattern.fullmatch(p.name))
    return found[-1] if found else None


def write(results: dict, stem: Path) -> None:
    results_files.write(stem, results, report(results))
    drew = plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, {stem}.md" + (f" and {stem}.png" if drew else " (no plot: matplotlib is missing)"))


def write_models(entries: list[tuple[dict, Path]], out_dir: Path) -> None:
    """One line per model of this invocation: ``plan-accuracy-<date>-heldout`` (``-models`` without a held-out
    model)."""
    held_out = any(r["measured"].get("held_out") for r, _ in entries)
    date = max(r["date"] for r, _ in entries)
    stem = results_files.stem(out_dir, "plan-accuracy", date, "heldout" if held_out else "models")
    data, text = models_report([(r, s.name) for r, s in entries])
    results_files.write(stem, data, text)
    print(f"wrote {stem}.json, {stem}.md")


@contextlib.contextmanager
def work_dir(given: str | None):
    """The folder of the run directories and the dufu cache: ``given`` (kept), else a temporary one."""
    if given:
        path = Path(given).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        with tempfile.TemporaryDirectory(prefix="dufu-plan-accuracy-") as tmp:
            yield Path(tmp)


def run_measurements(args, model: Model, layouts: list[Layout], work: Path, cache: Path) -> dict:
    """``model``'s layouts measured (run directories in ``work``), with the machine and what else ran."""
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    load0 = os.getloadavg()[0]
    if load0 > CORES:
        print(f"warning: load average {load0:.1f} on {CORES} cores: other work is running, step times will be "
              "noisy.", flush=True)
    t0, busy0 = time.perf_counter(), proc.system_busy_seconds()
    cpu0 = proc.own_cpu_seconds()
    results = {"date": results_files.today(), "quick": args.quick, "machine": machine.describe(),
               "cores": CORES, "load_avg_start": round(load0, 2)}
    results["measured"] = measure(layouts, model, args.quick, steps, warmup, work, cache, args.timeout,
                                  lambda msg: print(msg, flush=True))
    results["measure_s"] = time.perf_counter() - t0
    results["cpu_s"] = proc.own_cpu_seconds() - cpu0
    busy1 = proc.system_busy_seconds()
    if busy0 is not None and busy1 is not None:  # every process's CPU time minus this script's and its runs'
        results["other_cpu_s"] = max(0.0, busy1 - busy0 - results["cpu_s"])
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


def layout_keys(text: str) -> list[str]:
    """The layout keys of ``--layouts``: keys and names of :data:`LAYOUT_SETS`, comma-separated, each once."""
    keys = [k for item in text.split(",") if item for k in LAYOUT_SETS.get(item, [item])]
    return list(dict.fromkeys(keys))


def layouts_for(model: Model, args) -> list[Layout]:
    """``--layouts``, else the quick ones, else every layout for the calibration model and
    :data:`HELD_OUT_LAYOUTS` for a held-out one."""
    if args.layouts:
        keys = layout_keys(args.layouts)
    else:
        keys = QUICK_LAYOUTS if args.quick else (HELD_OUT_LAYOUTS if model.held_out else list(BY_KEY))
    return [BY_KEY[k] for k in keys]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"development run: layouts {', '.join(QUICK_LAYOUTS)} of "
                                                         f"a small model, {QUICK_STEPS} steps")
    ap.add_argument("--model", action="append", default=[], metavar="NAME",
                    help="the model(s) to measure, repeatable or comma-separated (default: the calibration model "
                         f"{CALIBRATION.name}): {', '.join(BY_NAME)}; {HELD_OUT}: every held-out model")
    ap.add_argument("--only", choices=["measure", "compare"],
                    help="measure: the runs only (measured columns); compare: predictions for an earlier "
                         "measurement (--measurements, default each model's newest results .json; measured now if "
                         "none)")
    ap.add_argument("--measurements", metavar="PATH", help="the results .json --only compare reads")
    ap.add_argument("--layouts", help=f"comma-separated layouts (default: all for {CALIBRATION.name}, "
                                      f"{','.join(HELD_OUT_LAYOUTS)} for a held-out model): {', '.join(BY_KEY)}; "
                                      f"or the sets {', '.join(LAYOUT_SETS)}")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {STEPS}; quick "
                                                            f"{QUICK_STEPS})")
    ap.add_argument("--warmup", type=int, default=None, help=f"steps left out of the step time (default {WARMUP})")
    ap.add_argument("--results-dir", default=None, help="where to write the results (default benchmarks/results)")
    ap.add_argument("--work-dir", default=None, help="keep run directories and the dufu cache here")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    ap.add_argument("--note", action="append", default=[],
                    help="a sentence about the measurement (e.g. what else ran), kept in the results (repeatable)")
    args = ap.parse_args(argv)
    try:
        models = select(args.model) or [CALIBRATION]
    except ValueError as e:
        ap.error(str(e))
    unknown = [k for k in layout_keys(args.layouts or "") if k not in BY_KEY]
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join([*BY_KEY, *LAYOUT_SETS])}")
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)
    if warmup >= steps:
        ap.error(f"--warmup {warmup} leaves no timed steps out of --steps {steps}")
    if args.measurements and len(models) > 1:
        ap.error("--measurements reads one model's results: give at most one --model")
    out_dir = Path(args.results_dir) if args.results_dir else results_files.RESULTS
    save = not args.quick or args.results_dir is not None

    jobs = []  # [model, results read back or None, their stem]
    for model in models:
        results, stem = None, None
        if args.only == "compare":
            path = Path(args.measurements) if args.measurements else newest_results(out_dir, model)
            if path is not None and path.exists():
                print(f"measurements from {path}", flush=True)
                results, stem = json.loads(path.read_text()), path.with_suffix("")
            else:
                print(f"no measurements of {model.name} found ({args.measurements or out_dir}): measuring now",
                      flush=True)
        jobs.append([model, results, stem])

    written, failed = [], False
    measuring = any(results is None for _, results, _ in jobs)
    with work_dir(args.work_dir) if measuring else contextlib.nullcontext() as work:
        if measuring:  # this process tokenizes the corpus and probes the CPU: not into the user's cache
            os.environ["DUFU_CACHE_DIR"] = str(work / "cache")
            if args.only != "measure":
                probe_first(QUICK_PROBES if args.quick else PROBES)
        for model, results, stem in jobs:
            read_back = results is not None
            if not read_back:
                layouts = layouts_for(model, args)
                print(f"== {model.name} ({'held out' if model.held_out else 'calibration model'}): {len(layouts)} "
                      f"layouts", flush=True)
                results = run_measurements(args, model, layouts, work / model.name, work / "cache")
                stem = stem_for(out_dir, model.name, results["date"])
            results["notes"] = [*results.get("notes", []), *args.note]
            if args.only == "measure":
                results["planner"], results["predictions"] = {"available": False,
                                                              "error": "not run (--only measure)"}, None
                finish(results)
            else:
                add_predictions(results)
            print()
            print(report(results))
            if save or read_back:
                write(results, stem)
                written.append((results, stem))
            failed |= any("peak_minus_baseline_mib" not in r for r in results["measured"]["rows"])
    if len(written) > 1:
        write_models(written, out_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
