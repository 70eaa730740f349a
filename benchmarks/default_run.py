"""The main job (`dufu train`, the default recipe) with each precision setting, side by side in one run.

    python benchmarks/default_run.py                 # auto, fp32 and bf16, one run each, interleaved
    python benchmarks/default_run.py --repeats 2     # two rounds (the order rotates between rounds)
    python benchmarks/default_run.py --quick         # 40 steps each, a smoke run

What it answers: is `train.amp.enabled="auto"` (the default) within 5% of the faster of amp on (bf16 autocast)
and amp off (fp32) on this CPU, and how long does the README's main job take here. Each run is the real command
`python -m dufu train train.amp.enabled=<setting> train.output_dir=<tmp>` in a fresh process (the user's
command, only the precision and the output folder given), timed from launch to exit. Also read from each run:
the time in the training loop (the metrics' step times), the final validation perplexity, and the precision
the run chose (the start-up summary's `precision` line).

The runs share one compile/data cache directory (a first run that tokenizes the corpus would otherwise pay
for the others): a warm-up run of 5 steps fills it before anything is timed.

Results: benchmarks/results/default_run-<YYYY-MM-DD>.json and .md, with the machine (CPU model, its fp32 and bf16
matmul peaks measured by dufu at the start), and the load average (a busy machine makes absolute times long;
compare the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import launch, machine, results as results_files

REPO = launch.REPO

SETTINGS = {"auto": "auto", "fp32": "false", "bf16": "bf16"}


def run_once(setting: str, workdir: Path, env: dict, extra: list[str]) -> dict:
    out = workdir / f"{setting}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "dufu", "train", f"train.amp.enabled={SETTINGS[setting]}",
           f"train.output_dir={out}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "step_time_s" in r]
    # step_time_s is the mean of the steps since the previous record: weight by the steps each record covers
    loop_s, prev = 0.0, 0
    for r in steps:
        loop_s += r["step_time_s"] * (r["step"] - prev)
        prev = r["step"]
    evals = [r for r in records if "eval_ppl" in r]
    precision = re.search(r"precision\s+(.*)", proc.stdout + proc.stderr)
    return {"setting": setting, "wall_s": wall, "loop_s": loop_s, "steps": prev,
            "final_eval_ppl": evals[-1]["eval_ppl"] if evals else None,
            "precision": precision.group(1).strip() if precision else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="40 steps per run")
    ap.add_argument("--results-dir", type=Path, default=results_files.RESULTS)
    args = ap.parse_args()

    extra = ["train.train_iter=40", "train.evaluation.eval_period=20", "train.checkpointer.period=0"] \
        if args.quick else []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dufu-default-run-") as tmp:
        work = Path(tmp)
        # One cache for this process and the runs: the peaks measured here are the ones the runs decide on.
        os.environ["DUFU_CACHE_DIR"] = str(work / "cache")
        env = launch.job_env(work / "cache", threads=None)
        info = machine.describe()  # dufu's measurement of the peaks, kept as the runs' MFU basis in the cache
        cpu = info["cpu"]
        peaks = {k: 1e9 * info["matmul_peaks_gflops"][k] for k in ("fp32", "bf16")}
        run_once("fp32", work, env, ["train.train_iter=5", "train.evaluation.enabled=False",
                                     "train.generation.enabled=False", "train.checkpointer.period=0"])
        order = list(SETTINGS)
        results = []
        for r in range(args.repeats):
            for setting in order[r % len(order):] + order[:r % len(order)]:
                res = run_once(setting, work, env, extra)
                print(f"{setting:5s} wall {res['wall_s']:6.1f} s  loop {res['loop_s']:6.1f} s  "
                      f"ppl {res['final_eval_ppl']}  {res['precision']}", flush=True)
                results.append(res)
    load_end = os.getloadavg()[0]

    def best(setting, key):
        return min(r[key] for r in results if r["setting"] == setting)

    fastest_explicit = min(best("fp32", "wall_s"), best("bf16", "wall_s"))
    ratio = best("auto", "wall_s") / fastest_explicit
    date = results_files.today()
    data = {
        "date": date, "cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "peaks_gflops": {k: v / 1e9 for k, v in peaks.items()},
        "load_avg_start": load_start, "load_avg_end": load_end, "quick": args.quick, "runs": results,
        "auto_vs_fastest_explicit_wall": ratio, "machine": info,
    }
    lines = [
        f"# The main job by precision - {date}", "",
        f"Machine: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}. Measured matmul peaks: "
        f"fp32 {peaks['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:,.0f} GFLOP/s "
        f"({peaks['bf16'] / peaks['fp32']:.2f}x). Load average {load_start:.2f} at the start, {load_end:.2f} at the end.",
        "", f"`python -m dufu train train.amp.enabled=<setting>`{' (40 steps)' if args.quick else ''}, "
        "each a fresh process, interleaved; wall = launch to exit, loop = the training steps' time.", "",
        "| setting | precision chosen | wall s | loop s | final validation perplexity |", "|---|---|---|---|---|",
    ]
    for r in results:
        ppl = f"{r['final_eval_ppl']:.1f}" if r["final_eval_ppl"] else "-"
        lines.append(f"| {r['setting']} | {r['precision']} | {r['wall_s']:.1f} | {r['loop_s']:.1f} | {ppl} |")
    lines += ["", f"auto / faster of fp32 and bf16 (best wall time of each): **{ratio:.3f}** (target <= 1.05)."]
    print("\n".join(lines))
    if not args.quick or args.results_dir != results_files.RESULTS:
        results_files.write(results_files.stem(args.results_dir, "default_run", date), data, "\n".join(lines))


if __name__ == "__main__":
    main()
