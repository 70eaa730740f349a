"""Does distillation help? The default recipe's trained GPT teaches the `gpt_distill` student (a quarter of its
width, half its depth) on the built-in corpus; the same student is trained from scratch for the same steps, with
the same data order, schedule and seed. Both are evaluated with `dufu eval` on the whole validation split.

    python benchmarks/distill.py                 # teacher 400 steps, students 400 steps (~4 minutes on 2 cores)
    python benchmarks/distill.py --steps 200 --teacher-run output/default   # reuse a trained teacher

Writes benchmarks/results/distill-<date>.md and .json with the machine. Held-out perplexity does not depend on
how busy the machine is; the wall times are recorded for reference only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, results as results_files


def dufu(*args: str) -> float:
    t0 = time.perf_counter()
    job = subprocess.run([sys.executable, "-m", "dufu", *args], capture_output=True, text=True,
                         env=launch.job_env(threads=None))
    if job.returncode != 0:
        sys.exit(f"dufu {' '.join(args)} failed:\n{job.stderr[-3000:]}")
    return time.perf_counter() - t0


def evaluate(run: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "dufu", "eval", str(run), "--json"], capture_output=True, text=True,
                         check=True, env=launch.job_env(threads=None)).stdout
    return json.loads(out[out.index("{"):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="student training steps (default 400, the recipe's)")
    ap.add_argument("--teacher-run", default=None, help="an already trained default-recipe run to use as teacher")
    ap.add_argument("--kd-weight", type=float, default=0.9)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--results-dir", default=str(results_files.RESULTS))
    args = ap.parse_args(argv)
    info = machine.describe()
    work = Path(tempfile.mkdtemp(prefix="dufu-distill-"))
    common = ["train.amp.enabled=False",  # fp32 everywhere: the comparison is of the numbers, not the dtype
              "train.checkpointer.period=0", "train.tensorboard=False", "train.generation.enabled=False"]
    times = {}
    teacher = Path(args.teacher_run) if args.teacher_run else work / "teacher"
    if args.teacher_run is None:
        print("training the teacher (the default recipe) ...", flush=True)
        times["teacher"] = dufu("train", "default", f"train.output_dir={teacher}", *common)
    student = [f"train.train_iter={args.steps}", *common]
    print(f"training the student from scratch, {args.steps} steps ...", flush=True)
    # kd_weight 0: the distill section stays (same config), its soft term is off; the teacher still runs, so the
    # scratch run is also timed with the teacher's forward: for a fair time, see the distilled run's overhead.
    times["scratch"] = dufu("train", "gpt_distill", f"train.output_dir={work / 'scratch'}", *student,
                            f"distill.teacher={teacher}", "distill.kd_weight=0.0")
    print(f"training the student with the teacher, {args.steps} steps ...", flush=True)
    times["distilled"] = dufu("train", "gpt_distill", f"train.output_dir={work / 'distilled'}", *student,
                              f"distill.teacher={teacher}", f"distill.kd_weight={args.kd_weight}",
                              f"distill.temperature={args.temperature}")
    rows = {name: evaluate(work / name) for name in ("teacher", "scratch", "distilled")} if args.teacher_run is None \
        else {"teacher": evaluate(teacher), **{n: evaluate(work / n) for n in ("scratch", "distilled")}}
    date = results_files.today()
    result = {"date": date, "machine": info, "steps": args.steps, "kd_weight": args.kd_weight,
              "temperature": args.temperature, "wall_s": {k: round(v, 1) for k, v in times.items()},
              "runs": {k: {f: v[f] for f in ("model", "parameters", "eval_loss", "eval_ppl", "eval_samples")}
                       for k, v in rows.items()}}
    r = result["runs"]
    gain = r["scratch"]["eval_ppl"] / r["distilled"]["eval_ppl"]
    lines = [f"# Distillation - {date}", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['logical_cpus']} CPUs; torch "
             f"{result['machine']['torch']}; {machine.peaks_text(info)}. fp32. Teacher: the default recipe (400 "
             "steps). Students: `gpt_distill` "
             f"({r['scratch']['parameters']:,} parameters), {args.steps} steps each, the same seed, data order and "
             f"schedule; the distilled one with kd_weight {args.kd_weight}, temperature {args.temperature}. "
             f"Held-out perplexity: `dufu eval RUN` over the whole validation split ({r['scratch']['eval_samples']} "
             "samples of 128 tokens).", "",
             "| model | parameters | held-out loss | held-out perplexity |", "|---|---|---|---|"]
    for name, label in (("teacher", "teacher (default recipe)"), ("scratch", "student from scratch"),
                        ("distilled", "student distilled")):
        lines.append(f"| {label} | {r[name]['parameters']:,} | {r[name]['eval_loss']:.4f} | "
                     f"{r[name]['eval_ppl']:.2f} |")
    lines += ["", f"The distilled student's perplexity is {gain:.3f}x lower than the same student trained from "
              f"scratch ({r['distilled']['eval_ppl']:.2f} vs {r['scratch']['eval_ppl']:.2f})."]
    result["perplexity_ratio_scratch_over_distilled"] = gain
    results_files.write(results_files.stem(Path(args.results_dir), "distill", date), result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
