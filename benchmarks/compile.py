"""torch.compile on vs off: warm-up (cold and warm compile cache) and steady-state step time, side by side.

    python benchmarks/compile.py                    # both parts below
    python benchmarks/compile.py --only steps       # training steps of the default model and gpt2_small
    python benchmarks/compile.py --only recipe      # `dufu train` end to end, 400 steps
    python benchmarks/compile.py --quick            # gpt_debug, a few steps: smoke run

Each measurement is a fresh process (its own Python, so no compiled code survives from one to the next except
through the on-disk cache), in three states per model and dtype, run in this order:

* ``off``  -- ``train.compile.enabled=False``;
* ``cold`` -- ``train.compile.enabled=True`` with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a new
  directory): the first run of a model on a machine;
* ``warm`` -- the same again with the cache the cold run filled: every later run (dufu keeps the cache under its
  cache directory, ``dufu.parallel.compile.use_compile_cache``).

Part 1, steps: a worker builds ``dufu.engine.trainer.Trainer`` for the model (the default recipe's model on its
micro-batch 16 x 128, ``--default-steps``; ``gpt2_small`` at batch 2 x 256 with the byte tokenizer, so no BPE is
trained while the model keeps its 50,304-token vocabulary, ``--gpt2-steps``) in fp32 and bf16 autocast, and times
each ``Trainer.train_step()`` in wall and CPU seconds (``--threads`` torch threads, default 1: CPU time per step
is what other processes on a shared machine disturb least). Steady step = median after the warm-up steps;
warm-up = the warm-up steps' time minus as many steady steps (compilation: the forward at the first step, the
backward in it too). Break-even = the extra warm-up over the off run's / the saving per steady step.

Part 2, recipe: ``python -m dufu train`` as it ships (dufu/configs/default.py: 400 steps, evaluation every 100,
generation at the end; bf16 autocast; ``--recipe-dtypes``, ``--recipe-threads``): the wall and CPU time of
the whole process, the steady step and first-window warm-up from its ``metrics.jsonl`` (whose windows exclude
evaluation and checkpoint time), and recompiles ("Recompiling function" lines with ``TORCH_LOGS=recompiles``:
evaluation under ``no_grad`` and generation with a growing KV cache compile graphs of their own).

Results: ``benchmarks/results/compile-<YYYY-MM-DD>.{md,json}`` with the machine and its measured matmul peaks
(``--quick``: only with ``--results-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, proc, results as results_files

REPO = launch.REPO
STATES = ("off", "cold", "warm")
DTYPES = ("fp32", "bf16")

COMMON = ("train.tensorboard=False",)
QUIET = ("train.evaluation.enabled=False", "train.generation.enabled=False", "train.checkpointer.period=0")
# The steps part: each model on its own training batch (gpt2_small at batch 2 x 256 with the byte tokenizer, so
# no BPE is trained; the model keeps its 50,304-token vocabulary).
STEP_ARGS = {
    "default": [*QUIET],
    "gpt2_small": [*QUIET, "train.train_micro_batch_size=2", "train.global_batch_size=2",
                   "dataloader.train.seq_length=256", "tokenization.tokenizer.kind=byte",
                   "tokenization.tokenizer.vocab_size=None"],
}
QUICK_ARGS = [*QUIET]


def worker(config: str, steps: int, overrides: list[str]) -> None:
    """In a fresh process: build the Trainer, run ``steps`` training steps, print per-step wall and CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    from dufu.config import LazyConfig, resolve_config_path
    from dufu.engine.trainer import Trainer

    cfg = LazyConfig.load(resolve_config_path(config))
    LazyConfig.apply_overrides(cfg, overrides)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    build = (time.perf_counter() - t0, time.process_time() - c0)
    walls, cpus, losses = [], [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        loss, _ = trainer.train_step()
        loss = float(loss)  # the step's end on any device (the loop itself reads it once per log period)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
        losses.append(loss)
    print("RESULT " + json.dumps({"build_wall_s": build[0], "build_cpu_s": build[1], "wall": walls, "cpu": cpus,
                                  "losses": losses}))


def run_steps(config: str, steps: int, overrides: list[str], dtype: str, state: str, workdir: Path,
              inductor_dir: Path, cache_dir: Path, threads: int) -> dict:
    """A worker process (see :func:`worker`) -> steady step time and first-steps warm-up, wall and CPU."""
    out = workdir / f"steps-{config}-{dtype}-{state}"
    shutil.rmtree(out, ignore_errors=True)
    args = [*COMMON, *overrides, f"train.output_dir={out}", f"train.amp.enabled={dtype == 'bf16'}",
            "train.amp.dtype=bf16", f"train.compile.enabled={state != 'off'}", "train.peak_tflops=1.0"]
    env = launch.job_env(cache_dir, threads, {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)})
    t0, b0 = time.perf_counter(), proc.system_busy_seconds()
    job = subprocess.run([sys.executable, __file__, "--worker", config, str(steps), *args], env=env, cwd=REPO,
                         capture_output=True, text=True)
    wall, b1 = time.perf_counter() - t0, proc.system_busy_seconds()
    if job.returncode != 0:
        raise SystemExit(f"worker failed ({config} {dtype} {state}):\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    r = json.loads(next(line for line in job.stdout.splitlines() if line.startswith("RESULT "))[7:])
    warm = max(2, steps // 4)  # steps counted as warm-up: compilation happens in the first two (forward, backward)
    res = {"config": config, "dtype": dtype, "state": state, "steps": steps, "threads": threads,
           "process_wall_s": wall, "build_wall_s": r["build_wall_s"], "last_loss": r["losses"][-1]}
    for kind in ("wall", "cpu"):
        steady = statistics.median(r[kind][warm:])
        res[f"steady_{kind}_s"] = steady
        res[f"first_{kind}_s"] = r[kind][0]
        res[f"warmup_{kind}_s"] = sum(r[kind][:warm]) - warm * steady
    # the share of the machine's CPU time other processes used while this one ran (0: a quiet machine)
    res["other_load"] = proc.other_load(b0, b1, sum(r["cpu"]) + r["build_cpu_s"], wall)
    return res




def run_one(config: str, overrides: list[str], dtype: str, state: str, workdir: Path, inductor_dir: Path,
            cache_dir: Path, threads=None) -> dict:
    out = workdir / f"{config}-{dtype}-{state}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "dufu", "train", config, f"train.output_dir={out}", *COMMON, *overrides,
           f"train.amp.enabled={dtype == 'bf16'}", "train.amp.dtype=bf16", f"train.compile.enabled={state != 'off'}"]
    # threads None: torch's default, one thread per core
    env = launch.job_env(cache_dir, threads or 0, {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir),
                                                       "TORCH_LOGS": "recompiles"})
    c0, t0 = proc.children_cpu_seconds(), time.perf_counter()
    job = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu = proc.children_cpu_seconds() - c0  # the run and the compiler processes it waited for
    if job.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    records = launch.read_records(out)
    windows = [r for r in records if "step_time_s" in r]
    steps = [w["step"] - (windows[i - 1]["step"] if i else 0) for i, w in enumerate(windows)]
    seconds = [w["step_time_s"] * n for w, n in zip(windows, steps)]
    steady = statistics.median(w["step_time_s"] for w in windows[1:])
    last_loss = windows[-1]["loss"]
    evals = [r for r in records if "eval_loss" in r]
    return {"config": config, "dtype": dtype, "state": state, "wall_s": wall, "cpu_s": cpu, "train_s": sum(seconds),
            "steps": sum(steps), "steady_step_s": steady, "first_window_steps": steps[0],
            "warmup_s": seconds[0] - steps[0] * steady, "other_s": wall - sum(seconds),
            "recompiles": job.stderr.count("Recompiling function"), "last_loss": last_loss,
            "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
            "inductor_cache_mb": _dir_mb(inductor_dir)}


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def machine_info() -> dict:
    return machine.describe(compiler=shutil.which("g++") or shutil.which("c++"))


def summarise(step_rows: list[dict]) -> list[dict]:
    """Per (model, dtype): compiled vs off - steady speed-up, extra warm-up, steps to pay it back."""
    out = []
    for config in dict.fromkeys(r["config"] for r in step_rows):
        for dtype in DTYPES:
            by = {r["state"]: r for r in step_rows if r["config"] == config and r["dtype"] == dtype}
            if "off" not in by:
                continue
            off = by["off"]
            for state in ("cold", "warm"):
                if state not in by:
                    continue
                on = by[state]
                saving = off["steady_cpu_s"] - on["steady_cpu_s"]
                extra = on["warmup_wall_s"] - off["warmup_wall_s"]
                out.append({"config": config, "dtype": dtype, "cache": state,
                            "speedup_cpu": off["steady_cpu_s"] / on["steady_cpu_s"],
                            "speedup_wall": off["steady_wall_s"] / on["steady_wall_s"],
                            "saving_per_step_s": saving, "extra_warmup_s": extra,
                            "break_even_steps": extra / saving if saving > 0 else None})
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# compile benchmark, {result['date']}", "",
             f"`python benchmarks/compile.py{' ' + ' '.join(result['argv']) if result['argv'] else ''}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}, C++ compiler {m['compiler']}; {machine.peaks_text(m)}. Load average "
             f"{result['loadavg_start']} at start, {result['loadavg_end']} at end; the run took "
             f"{result['seconds'] / 60:.1f} min.", ""]
    if result["steps"]:
        lines += ["## Training steps (Trainer.train_step() in a fresh process per row)", "",
                  f"{result['threads']} torch thread(s) per process. Steady = median over the steps after the "
                  "warm-up steps (a quarter of them, at least 2); warm-up = the warm-up steps' time minus as many "
                  "steady steps. CPU = this process's CPU time (inductor's compiler workers not included), which "
                  "other processes on the machine disturb far less than wall time.", "",
                  "| config | dtype | compile | steps | build (s) | first step (s) | warm-up extra, wall (s) | "
                  "steady wall (s) | steady CPU (s) | other load | last loss |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["steps"]:
            load = f"{100 * r['other_load']:.0f}%" if r["other_load"] is not None else "-"
            lines.append(f"| {r['config']} | {r['dtype']} | {r['state']} | {r['steps']} | {r['build_wall_s']:.1f} | "
                         f"{r['first_wall_s']:.2f} | {r['warmup_wall_s']:.1f} | {r['steady_wall_s']:.4f} | "
                         f"{r['steady_cpu_s']:.4f} | {load} | {r['last_loss']:.4f} |")
        lines += ["", "### Compiled vs off", "",
                  "| config | dtype | cache | steady speed-up (CPU) | (wall) | saving/step, CPU (s) | "
                  "extra warm-up, wall (s) | break-even (steps) |", "|---|---|---|---:|---:|---:|---:|---:|"]
        for x in result["summary"]:
            be = f"{x['break_even_steps']:.0f}" if x["break_even_steps"] is not None else "never (slower)"
            lines.append(f"| {x['config']} | {x['dtype']} | {x['cache']} | {x['speedup_cpu']:.2f}x | "
                         f"{x['speedup_wall']:.2f}x | {x['saving_per_step_s']:+.4f} | {x['extra_warmup_s']:.1f} | "
                         f"{be} |")
        lines.append("")
    if result["recipe"]:
        iters = result.get("recipe_iters") or 400
        lines += [f"## The default recipe end to end (`python -m dufu train`, {iters} steps)", "",
                  f"{result['recipe_threads'] or 'torch default'} thread(s). wall = the whole process; training = the logged windows (without "
                  "evaluation and checkpoint saves); other = wall - training (start-up, evaluation, checkpoints, "
                  "generation and their compilation); steady step = median window step time after the first; "
                  "recompiles = dynamo's 'Recompiling function' log lines (TORCH_LOGS=recompiles).", "",
                  "| dtype | compile | wall (s) | CPU (s) | training (s) | steady step (s) | warm-up extra (s) | "
                  "other (s) | recompiles | last loss | last eval loss |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["recipe"]:
            ev = f"{r['last_eval_loss']:.4f}" if r["last_eval_loss"] is not None else "-"
            lines.append(f"| {r['dtype']} | {r['state']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['train_s']:.1f} | "
                         f"{r['steady_step_s']:.4f} | {r['warmup_s']:.1f} | {r['other_s']:.1f} | {r['recompiles']} | "
                         f"{r['last_loss']:.4f} | {ev} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("steps", "recipe"), default=None, help="one part only")
    parser.add_argument("--models", default="default,gpt2_small", help="models of the steps part")
    parser.add_argument("--dtypes", default="fp32,bf16", help="dtypes of the steps part")
    parser.add_argument("--recipe-dtypes", default="bf16", help="dtypes of the end-to-end recipe runs")
    parser.add_argument("--default-steps", type=int, default=30)
    parser.add_argument("--gpt2-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the steps part")
    parser.add_argument("--recipe-iters", type=int, default=None,
                        help="train.train_iter of the recipe runs (default: the recipe's 400)")
    parser.add_argument("--recipe-threads", type=int, default=None,
                        help="torch threads of the recipe runs (default: torch's, one per core)")
    parser.add_argument("--quick", action="store_true", help="gpt_debug, few steps, no recipe run")
    parser.add_argument("--results-dir", default=None)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        config, steps, *overrides = args.worker
        return worker(config, int(steps), overrides)
    start, load0 = time.time(), [round(x, 2) for x in os.getloadavg()]
    info = machine_info()
    steps_rows, recipe_rows = [], []
    with tempfile.TemporaryDirectory(prefix="dufu-compile-bench-") as tmp:
        tmp = Path(tmp)
        cache_dir = tmp / "dufu_cache"  # tokenized corpus etc., shared; filled by a 1-step run first
        plan = [("gpt_debug", 6, QUICK_ARGS)] if args.quick else \
            [(m, args.default_steps if m == "default" else args.gpt2_steps, STEP_ARGS[m])
             for m in args.models.split(",")]
        if args.only != "recipe":
            for config, _, overrides in plan:
                prime(config, overrides, tmp, cache_dir)
            for config, steps, overrides in plan:
                for dtype in args.dtypes.split(","):
                    inductor = tmp / f"inductor-steps-{config}-{dtype}"
                    for state in STATES:
                        row = run_steps(config, steps, overrides, dtype, state, tmp, inductor, cache_dir,
                                        args.threads)
                        steps_rows.append(row)
                        print(f"steps  {config:10s} {dtype} {state:4s}: first {row['first_wall_s']:6.1f} s, warm-up "
                              f"{row['warmup_wall_s']:6.1f} s, steady {row['steady_wall_s']:.4f} s wall "
                              f"{row['steady_cpu_s']:.4f} s CPU, other load {row['other_load']:.0%}", flush=True)
        if args.only != "steps" and not args.quick:
            prime("default", [], tmp, cache_dir)
            for dtype in args.recipe_dtypes.split(","):
                inductor = tmp / f"inductor-recipe-{dtype}"
                for state in STATES:
                    iters = [f"train.train_iter={args.recipe_iters}"] if args.recipe_iters else []
                    row = run_one("default", iters, dtype, state, tmp, inductor, cache_dir, args.recipe_threads)
                    recipe_rows.append(row)
                    print(f"recipe default    {dtype} {state:4s}: wall {row['wall_s']:6.1f} s, steady step "
                          f"{row['steady_step_s']:.4f} s, warm-up {row['warmup_s']:6.1f} s, other "
                          f"{row['other_s']:5.1f} s, recompiles {row['recompiles']}", flush=True)
    result = {"date": results_files.today(), "argv": sys.argv[1:], "machine": info,
              "threads": args.threads, "loadavg_start": load0, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "recipe_threads": args.recipe_threads, "recipe_iters": args.recipe_iters, "seconds": time.time() - start, "steps": steps_rows,
              "recipe": recipe_rows,
              "summary": summarise(steps_rows)}
    text = markdown(result)
    print("\n" + text)
    out = results_files.results_dir(args.results_dir, args.quick)
    if out is None:
        return
    stem = results_files.write(results_files.stem(out, "compile", result["date"]), result, text)
    print(f"wrote {stem}.md and .json")


def prime(config: str, overrides: list[str], tmp: Path, cache_dir: Path) -> None:
    """One step of ``config`` so that its tokenizer and tokenized corpus are cached before anything is timed."""
    args = dict.fromkeys([*COMMON, *QUIET, *overrides, "train.train_iter=1"])  # each key once
    out = tmp / f"prime-{config}"  # a run directory of its own: dufu does not train into a finished run's
    subprocess.run(launch.dufu_train([config, f"train.output_dir={out}", *args]), env=launch.job_env(cache_dir, None),
                   cwd=REPO, capture_output=True, check=True)


if __name__ == "__main__":
    main()
