"""Parallel layouts side by side in one run: training throughput of a small GPT in ten layouts, the per-rank
peak memory of ZeRO stages 0-3 at dp 2 and dp 4 next to the theory, and the build-phase memory per rank with
``train.meta_init=True`` vs ``False`` next to what each should hold.

    python benchmarks/parallel.py                    # full run: ~15 CPU-minutes, so ~9 minutes on 2 idle cores
    python benchmarks/parallel.py --quick            # smoke run: ~3 CPU-minutes; 4 layouts, 6 steps, small model
    python benchmarks/parallel.py --only throughput  # or --only memory, --only init
    python benchmarks/parallel.py --layouts 1proc,tp2sp,dp2tp2pp2

On a CPU these numbers only show that the machinery works and how memory scales with the layout: here 2 cores
are shared by up to 8 processes, so more processes never means more speed.

**Throughput.** Every layout trains the same model (``gpt_debug`` scaled to 4 layers, hidden 128, 4 heads,
sequence 64, byte vocabulary padded to 384; fp32, no dropout) on the same global batch (16 sequences = 1,024
tokens; micro-batch 4, so the accumulation steps, which are the pipeline's micro-batches, are 16 / (4 x dp)).
Each layout is started the way a user starts it, ``python -m dufu train gpt_debug --nproc N key=value ...``,
with ``train.log_period=1``; the result is the median ``tokens_per_s`` of the steps after ``--warmup`` in the
run's ``metrics.jsonl``. Every process runs one thread (``OMP_NUM_THREADS=1``, torchrun's default; ``--threads``
changes it): with 2 threads, the 1-process run here was 6-40x slower whenever other processes competed for
the cores, because OpenMP threads wait for each other at every parallel region. Since every
layout sees the same samples from the same initial weights, the logged losses must agree with the 1-process
run; the table shows the largest difference as a check that the layouts compute the same thing.

**Memory.** A larger GPT (8 layers, hidden 512, 8 heads, vocabulary 8,192, sequence 64: 29.4M parameters)
runs 2 steps at dp 2 and dp 4 with ZeRO off (``replicate``, i.e. DDP) and ZeRO stages 1, 2, 3, and as a
reference on one process (with the tied embedding/head and without), launched as
``python -m torch.distributed.run --standalone --nproc-per-node N -m dufu train ... train.hooks=[MemoryPhases]``:
the hook (``benchmarks/harness/memory.py``) records every rank's peak resident set size (RSS) in three phases
(build, train, checkpoint; see its docstring). A baseline run of the same layout with a tiny model (1 layer,
hidden 64) measures what every process holds anyway (Python, torch, gloo, data): ~300 MiB. The table reports
peak - baseline per rank (the larger of the ranks) next to

* the ZeRO paper's model-state memory per rank (Rajbhandari et al. 2020): fp32 parameters 4 B + gradients 4 B +
  AdamW's two moments 8 B per parameter; stage 1 divides the optimizer states by dp, stage 2 also the
  gradients, stage 3 also the parameters;
* the same plus one FSDP unit's working set, the figure ZeRO-3 is held to: the paper counts model states only
  and leaves activations and temporary buffers to its "residual states"; FSDP2 works one unit at a time, so
  beyond its shards a rank holds, while a block is in backward, that block's gathered parameters and
  full-size gradient and the next block's parameters (gathered one unit ahead), 12 B per block parameter,
  and at the end of backward the embedding's full-size gradient and the reduce-scatter buffer it is copied
  into, 8 B per parameter; the larger of the two. Activations (micro-batch 1 x sequence 64: about 3 MiB per
  block at the start of backward) are in neither; a third figure adds them as measured: the 1-process run's
  training peak above baseline minus its model states (every dp rank holds its own micro-batch's);
* what dufu's mechanism should hold at its peak (``dufu/parallel/data_parallel.py``). ZeRO-3: FSDP units are
  the blocks, the embedding tables (freed after forward, never gathered in backward) and the final norm +
  head (gathered from its forward to its backward); a tied head holds a sharded copy of the embedding (4/dp
  B per table entry) whose gradient shard is added to the embedding's: the figure above + the copy. ZeRO-1
  and ZeRO-2 run the same (stage 1 with stage-2 sharding), with the blocks and a root unit holding
  embeddings, head and final norm, all kept gathered from forward to backward, so their peak can also be at
  the start of backward: 12/dp B/param of shards + every block and the root gathered (4 B) + the head's
  full gradient (4 B per head parameter). On gloo, dufu reduce-scatters gradients through an
  in-place all-reduce: gloo's own ``reduce_scatter_tensor`` stages a full copy of its input (about 1.3x the
  unit's gradient), which the paper's figure does not have and NCCL does not make.

``--before PATH`` adds the train-phase numbers of an earlier results file (e.g. the same script run on a
checkout of the previous code) next to this run's.

**Build memory, meta-device init vs the full model first** (``--only init``). The memory model runs 2 steps
in 1 process, dp2 ZeRO off (DDP), dp2 and dp4 ZeRO-3, tp2 and pp2 (1F1B, 2 micro-batches), each layout
twice: ``train.meta_init=True`` (the default: the model is built on the meta device, split into pipeline
stages and sharded, then each rank allocates and initialises only its shards, ``dufu/parallel/materialize.py``)
and ``train.meta_init=False`` (the full fp32 model is built and initialised on every rank first). Each layout
has its own baseline (the tiny model, with as many layers as pipeline stages). Besides the RSS per phase,
the hook counts the parameters each rank holds after the build (local shards of DTensors, a tied tensor
once). The table puts the build phase and the whole run's peak, minus baseline, next to

* meta: 4 B x the parameters the rank holds (about P / n: n = dp under ZeRO, tp, the stage's share under PP;
  the last stage holds its own copy of a tied embedding) + the largest single module, which the initialiser
  fills in full (a CPU tensor of the global shape) before the rank's shard is cut from it;
* full: 4 B x P, the whole model on every rank, + the same largest module (``meta_init=False`` fills the full
  model through the same per-module initialiser, which is why both give the same weights).

1 process and DDP are the controls: a rank there holds every parameter, so the two builds should match.

The memory runs use glibc malloc with ``MALLOC_MMAP_THRESHOLD_=65536``: every allocation of 64 KiB or more gets
its own mapping and goes back to the system when freed, so RSS follows the live tensors. glibc's default
threshold is dynamic: each freed mapping raises it to that size (up to 32 MiB), later tensors up to that size
come from the heap, and freed heap memory stays in the process. Peak RSS then says more about the allocator than
about the layout; a second table shows that for ZeRO off and ZeRO-3 at dp 2.

Results go to ``benchmarks/results/parallel-<YYYY-MM-DD>.json`` and ``.md`` (not for ``--quick`` unless
``--results-dir`` is given). ``DUFU_CACHE_DIR`` (tokenized corpus, measured peak FLOP/s) and all run
directories live in a temporary directory, removed at the end (``--work-dir`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import launch, machine, proc, results as results_files
from parallel_memory import (COMMON, MEMORY_MODEL, QUICK_MEMORY_MODEL, derive_memory_figures, init_runs,
                             memory_jobs, memory_runs, model_overrides, prepare_data_cache, rederive_init)
from parallel_report import CORES, NOTE, observations, report

# ----------------------------------------------------------------------------- what is measured
THROUGHPUT_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=384,
                        max_position_embeddings=64)
THROUGHPUT_SEQ = 64
THROUGHPUT_GLOBAL_BATCH = 16
THROUGHPUT_MICRO_BATCH = 4


@dataclass
class Layout:
    key: str
    title: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int | None = None

    @property
    def nproc(self) -> int:
        return self.dp * self.tp * self.pp

    def overrides(self) -> list[str]:
        o = [f"train.dist.data_parallel_size={self.dp}", f"train.dist.tensor_parallel_size={self.tp}",
             f"train.dist.pipeline_parallel_size={self.pp}"]
        if self.sp:
            o.append("train.dist.sequence_parallel=True")
        if self.pp > 1:
            o.append("train.dist.pipeline_schedule=1f1b")
        if self.zero is not None:
            o += ["train.zero_optimization.enabled=True", f"train.zero_optimization.stage={self.zero}"]
        return o


LAYOUTS = [
    Layout("1proc", "1 process"),
    Layout("dp2", "dp2", dp=2),
    Layout("tp2", "tp2", tp=2),
    Layout("tp2sp", "tp2 + sp", tp=2, sp=True),
    Layout("pp2", "pp2 (1f1b)", pp=2),
    Layout("dp2z3", "dp2 ZeRO-3", dp=2, zero=3),
    Layout("dp2tp2", "dp2 x tp2", dp=2, tp=2),
    Layout("dp2pp2", "dp2 x pp2", dp=2, pp=2),
    Layout("tp2pp2", "tp2 x pp2", tp=2, pp=2),
    Layout("dp2tp2pp2", "dp2 x tp2 x pp2", dp=2, tp=2, pp=2),
]
QUICK_LAYOUTS = ["1proc", "tp2sp", "dp2z3", "dp2tp2pp2"]

# Build memory with train.meta_init=True vs False (the memory model, 2 steps each).
INIT_LAYOUTS = [
    Layout("1proc", "1 process"),
    Layout("dp2", "dp2 ZeRO off (DDP)", dp=2),
    Layout("dp2z3", "dp2 ZeRO-3", dp=2, zero=3),
    Layout("dp4z3", "dp4 ZeRO-3", dp=4, zero=3),
    Layout("tp2", "tp2", tp=2),
    Layout("pp2", "pp2 (1f1b)", pp=2),
]
QUICK_INIT_LAYOUTS = ["dp2z3", "tp2"]


def drop_checkpoints(out: Path) -> None:
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


# ----------------------------------------------------------------------------- throughput
def throughput_runs(layouts: list[Layout], steps: int, warmup: int, threads: int, work: Path, cache: Path,
                    timeout: float, progress) -> list[dict]:
    results = []
    for i, layout in enumerate(layouts, 1):
        out = work / "throughput" / layout.key
        cmd = launch.dufu_train(["gpt_debug", f"train.output_dir={out / 'run'}", *COMMON, f"train.train_iter={steps}",
                                 f"train.global_batch_size={THROUGHPUT_GLOBAL_BATCH}",
                                 f"train.train_micro_batch_size={THROUGHPUT_MICRO_BATCH}",
                                 *model_overrides(THROUGHPUT_MODEL, THROUGHPUT_SEQ), *layout.overrides()],
                                layout.nproc)
        run = launch.execute(launch.Run(layout.title, cmd, launch.job_env(cache, threads), out), timeout)
        recs = launch.read_metrics(out / "run")
        timed = [r for r in recs if r["step"] > warmup]
        row = {
            "layout": layout.title, "key": layout.key, "nproc": layout.nproc, "threads_per_process": threads,
            "dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "sequence_parallel": layout.sp,
            "zero_stage": layout.zero,
            "accumulation_steps": THROUGHPUT_GLOBAL_BATCH // (THROUGHPUT_MICRO_BATCH * layout.dp),
            "returncode": run.rc, "wall_s": round(run.seconds, 1), "load_avg_before": round(run.load_before, 2),
            "command": " ".join(cmd[1:]),
        }
        if run.rc == 0 and timed:
            row.update(
                median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                median_step_ms=1000 * statistics.median(r["step_time_s"] for r in timed),
                timed_steps=len(timed),
                tokens_per_s=[round(r["tokens_per_s"], 1) for r in recs],
                losses=[r["loss"] for r in recs],
            )
            msg = (f"{row['median_tokens_per_s']:>9,.0f} tokens/s (median of {len(timed)} steps), "
                   f"{row['median_step_ms']:,.0f} ms/step")
        else:
            row["error"] = run.log_tail or "no steps after warm-up were logged"
            last = (run.log_tail.strip().splitlines() or [""])[-1][:160]
            msg = f"FAILED (exit {run.rc}): {last}"
        drop_checkpoints(out / "run")
        progress(f"[throughput {i}/{len(layouts)}] {layout.title:<17} {layout.nproc} proc x {threads} thr  "
                 f"{msg}  [{run.seconds:.0f} s, load {run.load_before:.1f}]")
        results.append(row)
    ref = next((r for r in results if r["key"] == "1proc" and "losses" in r), None)
    for r in results:
        if "median_tokens_per_s" in r and ref is not None:
            r["speedup_vs_1proc"] = r["median_tokens_per_s"] / ref["median_tokens_per_s"]
            n = min(len(r["losses"]), len(ref["losses"]))
            r["max_abs_loss_diff_vs_1proc"] = max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
    return results


# ----------------------------------------------------------------------------- main
def load_before(path: Path) -> dict:
    """What the report uses of an earlier results file: its date, machine and memory rows (without ranks)."""
    old = json.loads(path.read_text())
    rows = [{k: v for k, v in r.items() if k != "ranks"} for r in old.get("memory", {}).get("rows", [])]
    return {"date": old.get("date"), "machine": old["machine"], "memory": {"rows": rows}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 layouts, 6 steps, a smaller memory model, dp 2 only; init: dp2 ZeRO-3 and tp2")
    ap.add_argument("--only", choices=["throughput", "memory", "init"],
                    help="run one part only (init: build memory with train.meta_init=True vs False)")
    ap.add_argument("--layouts", help=f"comma-separated throughput layouts (default: all): "
                                      f"{', '.join(l.key for l in LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=None, help="training steps per throughput run (default 25; quick 6)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default 5; quick 2)")
    ap.add_argument("--results-dir", default=None, help="where to write the results (default benchmarks/results)")
    ap.add_argument("--work-dir", default=None, help="keep run directories and the dufu cache here")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every throughput process (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    ap.add_argument("--memory-model", metavar="KEY=VALUE", action="append", default=[],
                    help="change the memory model (repeatable), e.g. fused_loss=False")
    ap.add_argument("--before", metavar="PATH", help="an earlier results .json (e.g. this script on the previous code): "
                                                     "its train-phase memory goes next to this run's")
    ap.add_argument("--from-json", metavar="PATH", help="only re-render the .md report (and print it) from a results "
                                                        ".json written by this script")
    args = ap.parse_args(argv)
    if args.from_json:
        path = Path(args.from_json)
        results = json.loads(path.read_text())
        if "init" in results:
            rederive_init(results["init"])
        if "memory" in results and "embedding_unit" in results["memory"]["parameters"]:
            derive_memory_figures(results["memory"])
        results["observations"] = observations(results)
        text = report(results)
        path.write_text(json.dumps(results, indent=1) + "\n")
        path.with_suffix(".md").write_text(text)
        print(text)
        return 0

    steps = args.steps or (6 if args.quick else 25)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    if warmup >= steps:
        ap.error(f"--warmup {warmup} leaves no timed steps out of --steps {steps}")
    keys = args.layouts.split(",") if args.layouts else (QUICK_LAYOUTS if args.quick else [l.key for l in LAYOUTS])
    unknown = [k for k in keys if k not in {l.key for l in LAYOUTS}]
    if unknown:
        ap.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(l.key for l in LAYOUTS)}")
    layouts = [l for l in LAYOUTS if l.key in keys]

    tmp = None
    if args.work_dir:
        work = Path(args.work_dir).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="dufu-parallel-")
        work = Path(tmp.name)
    cache = work / "cache"
    # Also for this process (parameter_counts imports dufu): nothing may land in the user's cache.
    os.environ["DUFU_CACHE_DIR"] = str(cache)

    def progress(msg: str) -> None:
        print(msg, flush=True)

    print(NOTE, flush=True)
    load0 = os.getloadavg()[0]
    if load0 > CORES:
        print(f"warning: load average {load0:.1f} on {CORES} cores: other work is running, throughput will be "
              "noisy.", flush=True)
    t0 = time.perf_counter()
    date = results_files.today()
    results: dict = {"date": date, "quick": args.quick, "machine": machine.describe(),
                     "load_avg_start": round(load0, 2), "note": NOTE}
    if args.before:
        results["before"] = load_before(Path(args.before))
    try:
        if args.only in (None, "throughput"):
            results["throughput_setup"] = {
                "model": THROUGHPUT_MODEL, "seq_length": THROUGHPUT_SEQ, "global_batch_size": THROUGHPUT_GLOBAL_BATCH,
                "micro_batch_size": THROUGHPUT_MICRO_BATCH, "steps": steps, "warmup": warmup, "dtype": "fp32",
            }
            results["throughput"] = throughput_runs(layouts, steps, warmup, args.threads, work, cache, args.timeout, progress)
        if args.only in (None, "memory", "init"):
            prepare_data_cache()
        if args.only in (None, "memory"):
            if args.quick:
                jobs = memory_jobs([2], [0, 3], [], reference=False)
            else:
                jobs = memory_jobs([2, 4], [0, 1, 2, 3], [(2, 0), (2, 3)], reference=True)
            model = dict(QUICK_MEMORY_MODEL if args.quick else MEMORY_MODEL)
            for kv in args.memory_model:
                key, _, value = kv.partition("=")
                model[key] = value
            results["memory"] = memory_runs(jobs, model, work, cache, args.timeout, progress)
        if args.only in (None, "init"):
            init_layouts = [l for l in INIT_LAYOUTS if not args.quick or l.key in QUICK_INIT_LAYOUTS]
            results["init"] = init_runs(init_layouts, QUICK_MEMORY_MODEL if args.quick else MEMORY_MODEL, work,
                                        cache, args.timeout, progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    results["total_s"] = time.perf_counter() - t0
    results["cpu_s"] = proc.own_cpu_seconds()
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    results["observations"] = observations(results)
    text = report(results)
    print()
    print(text)
    out_dir = results_files.results_dir(args.results_dir, args.quick)
    if out_dir is not None:
        stem = results_files.write(results_files.stem(out_dir, "parallel", date), results, text)
        print(f"wrote {stem}.json and {stem}.md")
    failed = [r for r in results.get("throughput", []) if r.get("returncode") != 0]
    failed += [r for r in results.get("memory", {}).get("rows", []) if r.get("returncode") != 0]
    failed += [r for r in results.get("init", {}).get("rows", []) if r.get("returncode") != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())