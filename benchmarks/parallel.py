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
``python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/_worker.py train ...``:
``_worker.py`` runs ``dufu.cli.main`` and records every rank's peak resident set size (RSS) in three phases
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
``_worker.py`` counts the parameters each rank holds after the build (local shards of DTensors, a tied tensor
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
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_worker.py"
CORES = os.cpu_count() or 1
MiB = 1024 * 1024

NOTE = (
    "Absolute CPU numbers here only show that the machinery works and how memory scales with the layout: "
    f"{CORES} CPU cores are shared by up to 8 processes, so more processes never means more speed on this "
    "machine."
)

# ----------------------------------------------------------------------------- what is measured
THROUGHPUT_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=384,
                        max_position_embeddings=64)
THROUGHPUT_SEQ = 64
THROUGHPUT_GLOBAL_BATCH = 16
THROUGHPUT_MICRO_BATCH = 4

MEMORY_MODEL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=8192, max_position_embeddings=64)
QUICK_MEMORY_MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=2048,
                          max_position_embeddings=64)
BASELINE_MODEL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=384, max_position_embeddings=64)
MEMORY_SEQ = 64
MEMORY_STEPS = 2  # step 1 creates AdamW's state; step 2 runs forward/backward with every model state alive

ALLOCATORS = {
    # RSS follows live tensors: allocations >= 64 KiB are mmap'ed and unmapped on free.
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    # glibc's default: the mmap threshold grows with freed blocks (up to 32 MiB); freed memory below it stays.
    "default": {},
}

COMMON = [
    "train.evaluation.enabled=False",
    "train.tensorboard=False",
    "train.checkpointer.period=0",  # the trainer still saves once, after the last step
    "train.log_period=1",
]


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


def model_overrides(model: dict, seq: int) -> list[str]:
    return [f"model.{k}={v}" for k, v in model.items()] + [f"dataloader.train.seq_length={seq}"]


# ----------------------------------------------------------------------------- running one job
@dataclass
class Run:
    label: str
    cmd: list[str]
    env: dict
    out: Path
    rc: int | None = None
    seconds: float = 0.0
    load_before: float = 0.0
    log_tail: str = ""
    extra: dict = field(default_factory=dict)


def execute(run: Run, timeout: float) -> Run:
    """Run one job in its own process group (so a hung job can be stopped completely), log to out/run.log."""
    run.out.mkdir(parents=True, exist_ok=True)
    log = run.out / "run.log"
    run.load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(run.cmd, stdout=f, stderr=subprocess.STDOUT, env=run.env, cwd=REPO,
                                start_new_session=True)
        try:
            run.rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the job this script started, nothing else
            proc.wait()
            run.rc = -9
            f.write(f"\n[benchmark] killed after {timeout:.0f} s\n")
        except BaseException:  # Ctrl-C: the job runs in its own session and would not see it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    run.seconds = time.perf_counter() - t0
    if run.rc != 0:
        run.log_tail = log.read_text(errors="replace")[-3000:]
    return run


def base_env(cache_dir: Path, threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "DUFU_BENCH_MEMORY_DIR"):
        env.pop(k, None)
    env.update(DUFU_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def drop_checkpoints(out: Path) -> None:
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


# ----------------------------------------------------------------------------- throughput
def throughput_runs(layouts: list[Layout], steps: int, warmup: int, threads: int, work: Path, cache: Path,
                    timeout: float, progress) -> list[dict]:
    results = []
    for i, layout in enumerate(layouts, 1):
        out = work / "throughput" / layout.key
        cmd = [sys.executable, "-m", "dufu", "train", "gpt_debug"]
        if layout.nproc > 1:
            cmd += ["--nproc", str(layout.nproc)]
        cmd += [f"train.output_dir={out / 'run'}", *COMMON, f"train.train_iter={steps}",
                f"train.global_batch_size={THROUGHPUT_GLOBAL_BATCH}",
                f"train.train_micro_batch_size={THROUGHPUT_MICRO_BATCH}",
                *model_overrides(THROUGHPUT_MODEL, THROUGHPUT_SEQ), *layout.overrides()]
        run = execute(Run(layout.title, cmd, base_env(cache, threads), out), timeout)
        recs = read_metrics(out / "run")
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


# ----------------------------------------------------------------------------- memory
def parameter_counts(model: dict) -> dict:
    """Exact parameter counts of the memory model, built on the meta device: total, root unit (everything
    outside the blocks), one block, the FSDP end units of ``dufu.parallel.data_parallel`` (embedding tables,
    final norm + head, a tied head counted in both) and the tied copy a rank holds under ZeRO, and the largest
    module's own parameters and buffers (what the meta-device initialisation fills in full at once:
    ``dufu.parallel.materialize.ModuleInitializer``)."""
    import torch

    from dufu.config import LazyConfig, instantiate, resolve_config_path
    from dufu.parallel import transformer_blocks
    from dufu.parallel.data_parallel import end_units

    cfg = LazyConfig.load(str(resolve_config_path("gpt_debug")))
    cfg = LazyConfig.apply_overrides(cfg, [f"model.{k}={v}" for k, v in model.items()])
    with torch.device("meta"):
        m = instantiate(cfg.model)
    unique = lambda ps: sum(p.numel() for p in {id(p): p for p in ps}.values())  # noqa: E731 (tied weights once)
    total = unique(m.parameters())
    blocks = transformer_blocks(m)
    in_blocks = sum(unique(b.parameters()) for _, b in blocks)
    embeddings, last = end_units(m)
    tied_copy = sum(m.get_parameter(a).numel() for a, s in getattr(m, "tied_parameter_names", {}).items()
                    if m.get_parameter(a) is m.get_parameter(s))
    own = {name: sum(t.numel() * t.element_size() for t in [*mod._parameters.values(), *mod._buffers.values()]
                     if t is not None) for name, mod in m.named_modules()}
    largest = max(own, key=own.get)
    return {"total": total, "root": total - in_blocks, "per_block": in_blocks // max(1, len(blocks)),
            "num_blocks": len(blocks), "embedding_unit": unique(p for e in embeddings for p in e.parameters()),
            "head_unit": unique(p for h in last for p in h.parameters()), "tied_copy": tied_copy,
            "largest_module": largest, "largest_module_bytes": own[largest]}


def theory_bytes(P: int, stage: int, dp: int) -> float:
    """ZeRO paper, fp32 + AdamW: parameters 4 B, gradients 4 B, optimizer states 8 B per parameter."""
    params, grads, optim = 4.0 * P, 4.0 * P, 8.0 * P
    if stage >= 1:
        optim /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return params + grads + optim


def working_set_bytes(counts: dict) -> float:
    """What FSDP2 holds beyond the shards while one unit is in backward, the larger of: a block's gathered
    parameters and full-size gradient, and the next block's parameters (FSDP2 gathers one unit ahead in
    backward), 12 B per block parameter; at the end, the embedding tables' full-size gradient and the
    reduce-scatter buffer it is copied into (never gathered: an embedding's backward needs only the indices),
    8 B per parameter of the end units."""
    end_unit = max(counts.get("embedding_unit", 0), counts.get("head_unit", 0))
    return max(12.0 * counts["per_block"], 8.0 * end_unit)


def dufu_estimate_bytes(counts: dict, stage: int, dp: int) -> float:
    """The peak memory of dufu's mechanism (see the module docstring)."""
    P = counts["total"]
    if stage == 0:
        return 16.0 * P  # replicate: everything on every rank
    if stage == 3:  # + the tied head's sharded copy of the embedding
        return 16.0 * P / dp + 4.0 * counts.get("tied_copy", 0) / dp + working_set_bytes(counts)
    # Stages 1 and 2: blocks and the root (embeddings, head, final norm) stay gathered from forward to
    # backward; at the start of backward the head's full gradient (the tied one held to the end) comes on top.
    gathered = counts["num_blocks"] * counts["per_block"] + counts["root"]
    start_of_backward = 12.0 * P / dp + 4.0 * gathered + 4.0 * counts["head_unit"]
    return max(start_of_backward, 16.0 * P / dp + working_set_bytes(counts))


def derive_memory_figures(mem: dict) -> None:
    """(Re)compute each row's model states, ZeRO figure and mechanism estimate from the parameter counts."""
    for r in mem["rows"]:
        if r["kind"] != "model":
            continue
        c = mem["parameters_untied" if r.get("variant") == "untied" else "parameters"]
        states = theory_bytes(c["total"], r["zero_stage"], r["dp"])
        r.update(theory_mib=states / MiB, dufu_estimate_mib=dufu_estimate_bytes(c, r["zero_stage"], r["dp"]) / MiB,
                 zero_figure_mib=(states + working_set_bytes(c)) / MiB if r["zero_stage"] else None)
    # The paper's figure counts model states only; activations are its "residual states", and every rank holds
    # those of its own micro-batch whatever the ZeRO stage. Measured, not modelled: the 1-process run's training
    # peak above baseline minus its model states (same micro-batch, same sequence as every dp rank here).
    one = next((r for r in mem["rows"] if r["kind"] == "model" and r["dp"] == 1 and not r.get("variant")
                and r.get("allocator", "mmap64k") == "mmap64k" and "train_minus_baseline_mib" in r), None)
    mem["activations_mib"] = (one["train_minus_baseline_mib"]["max"] - one["theory_mib"]) if one else None
    for r in mem["rows"]:
        if r["kind"] == "model" and r.get("zero_figure_mib") is not None and mem["activations_mib"] is not None:
            r["zero_figure_activations_mib"] = r["zero_figure_mib"] + mem["activations_mib"]


def read_ranks(mem_dir: Path, nproc: int) -> list[dict] | None:
    files = [mem_dir / f"rank{r}.json" for r in range(nproc)]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text()) for f in files]


def worker_job(label: str, nproc: int, global_batch: int, model: dict, overrides: list[str], allocator: str,
               work: Path, cache: Path, timeout: float, steps: int = MEMORY_STEPS) -> tuple[Run, list[dict] | None]:
    """One memory-recording training run (``_worker.py`` under torchrun), micro-batch 1, ``steps`` steps; every
    rank's record. The run's ``metrics.jsonl`` stays in ``<work>/memory/<label>/run``."""
    out = work / "memory" / label
    mem_dir = out / "mem"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           "train", "gpt_debug", f"train.output_dir={out / 'run'}", *COMMON, f"train.train_iter={steps}",
           "train.train_micro_batch_size=1", f"train.global_batch_size={global_batch}",
           "train.peak_tflops=1.0",  # skip the peak-FLOP/s matmul measurement (3 x 16 MiB of buffers)
           *model_overrides(model, MEMORY_SEQ), *overrides]
    env = base_env(cache, 1, {"DUFU_BENCH_MEMORY_DIR": str(mem_dir), **ALLOCATORS[allocator]})
    run = execute(Run(label, cmd, env, out), timeout)
    ranks = read_ranks(mem_dir, nproc) if run.rc == 0 else None
    drop_checkpoints(out / "run")
    return run, ranks


def memory_job(label: str, dp: int, stage: int, model: dict, allocator: str, work: Path, cache: Path,
               timeout: float) -> tuple[Run, list[dict] | None]:
    zero = ["train.zero_optimization.enabled=False"] if stage == 0 else [
        "train.zero_optimization.enabled=True", f"train.zero_optimization.stage={stage}"]
    return worker_job(label, dp, dp, model, [f"train.dist.data_parallel_size={dp}", *zero], allocator, work, cache,
                      timeout)


def phase_mib(rank: dict, phase: str) -> float:
    if phase == "peak":
        return rank["peak_kb"] / 1024
    return rank["phases_kb"].get(phase, 0) / 1024


@dataclass
class MemoryJob:
    kind: str  # "model" or "baseline"
    dp: int
    stage: int
    allocator: str
    variant: str = ""  # "untied": the same model with tie_word_embeddings=False

    @property
    def label(self) -> str:
        if self.kind == "baseline":
            return f"baseline-dp{self.dp}-{self.allocator}"
        return f"dp{self.dp}-zero{self.stage}-{self.allocator}{'-' + self.variant if self.variant else ''}"

    def describe(self) -> str:
        if self.kind == "baseline":
            return "baseline (tiny model)"
        what = f"ZeRO-{self.stage}" if self.stage else ("1 process" if self.dp == 1 else "ZeRO off (DDP)")
        return what + (", untied head" if self.variant == "untied" else "")


def memory_jobs(dps: list[int], stages: list[int], default_malloc: list[tuple[int, int]], reference: bool) -> list:
    jobs = []
    if reference:  # one process: the plain 16 B/param case, with and without the tied embedding/head
        jobs += [MemoryJob("baseline", 1, 0, "mmap64k"), MemoryJob("model", 1, 0, "mmap64k"),
                 MemoryJob("model", 1, 0, "mmap64k", "untied")]
    for dp in dps:
        jobs.append(MemoryJob("baseline", dp, 0, "mmap64k"))
        jobs += [MemoryJob("model", dp, s, "mmap64k") for s in stages]
    # No separate baseline for the default allocator: the tiny model makes almost no allocation of 64 KiB or
    # more, so its RSS is the same under both settings (measured: within 2 MiB).
    jobs += [MemoryJob("model", dp, s, "default") for dp, s in default_malloc]
    return jobs


def memory_runs(jobs: list[MemoryJob], model: dict, work: Path, cache: Path, timeout: float, progress) -> dict:
    counts = {"tied": parameter_counts(model), "untied": parameter_counts({**model, "tie_word_embeddings": False})}
    baselines, rows = {}, []
    for i, job in enumerate(jobs, 1):
        job_model = BASELINE_MODEL if job.kind == "baseline" else (
            {**model, "tie_word_embeddings": False} if job.variant == "untied" else model)
        run, ranks = memory_job(job.label, job.dp, job.stage, job_model, job.allocator, work, cache, timeout)
        row = {"kind": job.kind, "variant": job.variant, "dp": job.dp, "zero_stage": job.stage,
               "allocator": job.allocator, "returncode": run.rc, "wall_s": round(run.seconds, 1),
               "load_avg_before": round(run.load_before, 2)}
        head = f"[memory {i}/{len(jobs)}] dp{job.dp} {job.describe():<26} {job.allocator:<8}"
        if ranks is None:
            last = (run.log_tail.strip().splitlines() or [""])[-1][:160]
            progress(f"{head} FAILED (exit {run.rc}): {last}")
            rows.append({**row, "error": run.log_tail})
            continue
        peaks = [phase_mib(r, "peak") for r in ranks]
        progress(f"{head} peak RSS per rank {', '.join(f'{p:,.0f}' for p in peaks)} MiB  "
                 f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
        row.update(ranks=ranks, peak_mib_max_rank=max(peaks), meta_init=ranks[0].get("meta_init"))
        if job.kind == "baseline":
            baselines[(job.dp, job.allocator)] = ranks
            rows.append(row)
            continue
        c = counts["untied" if job.variant == "untied" else "tied"]
        row.update(parameters=c["total"])
        base = baselines.get((job.dp, job.allocator)) or baselines.get((job.dp, "mmap64k"))
        if base is not None:
            row["baseline_peak_mib_max_rank"] = max(phase_mib(b, "peak") for b in base)
            for phase in ("peak", "build", "train", "checkpoint"):
                diffs = [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(ranks, base)]
                row[f"{phase}_minus_baseline_mib"] = {"max": max(diffs), "min": min(diffs)}
        rows.append(row)
    mem = {"model": model, "parameters": counts["tied"], "parameters_untied": counts["untied"],
           "steps": MEMORY_STEPS, "seq_length": MEMORY_SEQ, "micro_batch_size": 1, "allocators": ALLOCATORS,
           "rows": rows}
    derive_memory_figures(mem)
    return mem


# ----------------------------------------------------------------------------- build memory: meta vs full init
def shard_divisor(layout: Layout) -> int:
    """n in the rough per-rank parameter share P / n: ZeRO shards the parameters over dp (every stage runs on
    FSDP2, whose parameters rest sharded; ZeRO off, i.e. DDP, replicates them), TP over tp, PP splits the
    blocks over pp stages."""
    return (layout.dp if layout.zero else 1) * layout.tp * layout.pp


def baseline_label(layout: Layout) -> str:
    return f"init-baseline-dp{layout.dp}-tp{layout.tp}-pp{layout.pp}"


def init_overrides(layout: Layout, meta_init: bool) -> list[str]:
    zero = [] if layout.zero is not None else ["train.zero_optimization.enabled=False"]
    return [*layout.overrides(), *zero, f"train.meta_init={meta_init}"]


def init_theory_mib(counts: dict, meta_init: bool, held_bytes: float) -> float:
    """What the build phase should hold: meta -- the rank's own parameters plus the largest module, filled in
    full before its shard is cut; full -- every parameter (4 B each in fp32) plus the largest module, since
    ``meta_init=False`` fills the full model through the same per-module initialiser (same weights)."""
    if meta_init:
        return (held_bytes + counts["largest_module_bytes"]) / MiB
    return (4.0 * counts["total"] + counts["largest_module_bytes"]) / MiB


def _spread(values: list[float]) -> dict:
    return {"max": max(values), "min": min(values), "per_rank": values}


def derive_init_row(row: dict, counts: dict, base: list[dict] | None) -> None:
    """The theory and the differences to the baseline, per rank, from the raw rank records."""
    ranks = row["ranks"]
    held = [r.get("held_parameter_bytes", 4.0 * counts["total"] / row["shard_divisor"]) for r in ranks]
    row["theory_build_mib"] = _spread([init_theory_mib(counts, row["meta_init"], h) for h in held])
    if base is None:
        return
    for phase in ("peak", "build", "train", "checkpoint"):
        row[f"{phase}_minus_baseline_mib"] = _spread(
            [phase_mib(r, phase) - phase_mib(b, phase) for r, b in zip(ranks, base)])
    row["build_minus_theory_mib"] = _spread(
        [b - t for b, t in zip(row["build_minus_baseline_mib"]["per_rank"], row["theory_build_mib"]["per_rank"])])


def rederive_init(init: dict) -> None:
    """Recompute the derived numbers of a results file's build comparison (for ``--from-json``)."""
    base = {r["key"]: r.get("ranks") for r in init["rows"] if r["kind"] == "baseline"}
    for row in init["rows"]:
        if row["kind"] == "model" and row.get("ranks"):
            derive_init_row(row, init["parameters"], base.get(row.get("baseline")))


def init_runs(layouts: list[Layout], model: dict, work: Path, cache: Path, timeout: float, progress) -> dict:
    """Every layout twice, ``train.meta_init=True`` and ``False``, after a baseline of the same layout (a tiny
    model with as many layers as pipeline stages)."""
    counts = parameter_counts(model)
    baselines: dict[tuple, list[dict] | None] = {}
    rows = []
    n_jobs = len({(l.dp, l.tp, l.pp) for l in layouts}) + 2 * len(layouts)
    i = 0
    for layout in layouts:
        shape = (layout.dp, layout.tp, layout.pp)
        gb = layout.dp * layout.pp  # micro-batch 1; a pipeline needs pp micro-batches
        if shape not in baselines:
            i += 1
            label = baseline_label(layout)
            tiny = {**BASELINE_MODEL, "num_layers": max(BASELINE_MODEL["num_layers"], layout.pp)}
            run, ranks = worker_job(label, layout.nproc, gb, tiny, init_overrides(layout, True), "mmap64k", work,
                                    cache, timeout)
            baselines[shape] = ranks
            rows.append({"kind": "baseline", "key": label, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
                         "model": tiny, "returncode": run.rc, "wall_s": round(run.seconds, 1),
                         "load_avg_before": round(run.load_before, 2),
                         **({"ranks": ranks} if ranks else {"error": run.log_tail})})
            state = ("peak RSS per rank " + ", ".join(f"{phase_mib(r, 'peak'):,.0f}" for r in ranks) + " MiB"
                     if ranks else f"FAILED (exit {run.rc})")
            progress(f"[init {i}/{n_jobs}] {'baseline ' + label[14:]:<28} {state}  "
                     f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
        base = baselines[shape]
        for meta_init in (True, False):
            i += 1
            label = f"init-{layout.key}-{'meta' if meta_init else 'full'}"
            run, ranks = worker_job(label, layout.nproc, gb, model, init_overrides(layout, meta_init), "mmap64k",
                                    work, cache, timeout)
            row = {"kind": "model", "key": layout.key, "layout": layout.title, "dp": layout.dp, "tp": layout.tp,
                   "pp": layout.pp, "zero_stage": layout.zero, "nproc": layout.nproc, "meta_init": meta_init,
                   "returncode": run.rc, "wall_s": round(run.seconds, 1), "load_avg_before": round(run.load_before, 2),
                   "shard_divisor": shard_divisor(layout),
                   "baseline": baseline_label(layout)}
            head = f"[init {i}/{n_jobs}] {layout.title:<18} meta_init={str(meta_init):<5}"
            if ranks is None:
                last = (run.log_tail.strip().splitlines() or [""])[-1][:160]
                progress(f"{head} FAILED (exit {run.rc}): {last}")
                rows.append({**row, "error": run.log_tail})
                continue
            if any(r.get("meta_init") is not None and r["meta_init"] != meta_init for r in ranks):
                row["note"] = "the trainer reported a different meta_init than requested"
            row.update(ranks=ranks, peak_mib_max_rank=max(phase_mib(r, "peak") for r in ranks),
                       held_parameters=[r.get("held_parameters") for r in ranks])
            derive_init_row(row, counts, base)
            build = row.get("build_minus_baseline_mib")
            progress(f"{head} build - baseline {fmt(build and build['max'])} MiB (theory "
                     f"{row['theory_build_mib']['max']:,.0f}), peak RSS {row['peak_mib_max_rank']:,.0f} MiB  "
                     f"[{run.seconds:.0f} s, load {run.load_before:.1f}]")
            rows.append(row)
    return {"model": model, "parameters": counts, "steps": MEMORY_STEPS, "seq_length": MEMORY_SEQ,
            "micro_batch_size": 1, "allocator": "mmap64k", "rows": rows}


def prepare_data_cache() -> None:
    """Tokenize the corpus into DUFU_CACHE_DIR once, here, so no measured run pays for (or holds memory of) it."""
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path("gpt_debug")))
    tokenizer = instantiate(cfg.tokenization.tokenizer)
    node = cfg.dataloader.train
    node.tokenizer = tokenizer
    node.seq_length = MEMORY_SEQ
    instantiate(node)


# ----------------------------------------------------------------------------- reporting
def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def fmt(x, spec=",.0f", none="-") -> str:
    return none if x is None else format(x, spec)


def signed(x: float) -> str:
    """A whole number of MiB with its sign, never "-0"."""
    return f"{round(x):+,}"


def throughput_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        if "median_tokens_per_s" not in r:
            body.append([r["layout"], str(r["nproc"]), str(r["threads_per_process"]), str(r["accumulation_steps"]),
                         "failed", "-", "-", "-", "-", fmt(r["wall_s"]), fmt(r["load_avg_before"], ".1f")])
            continue
        body.append([
            r["layout"], str(r["nproc"]), str(r["threads_per_process"]), str(r["accumulation_steps"]),
            fmt(r["median_tokens_per_s"]), fmt(r.get("speedup_vs_1proc"), ".2f") + "x",
            fmt(r["median_step_ms"]), f"{r['losses'][-1]:.4f}", fmt(r.get("max_abs_loss_diff_vs_1proc"), ".1e"),
            fmt(r["wall_s"]), fmt(r["load_avg_before"], ".1f"),
        ])
    return table(["layout", "procs", "threads/proc", "micro-batches/rank", "tokens/s (median)", "vs 1 process",
                  "ms/step", "last loss", "max abs loss diff vs 1 process", "wall s", "load avg at start"], body)


def _diff(r: dict, phase: str) -> str:
    d = r.get(f"{phase}_minus_baseline_mib")
    if d is None:
        return "-"
    return f"{d['max']:,.0f}" if abs(d["max"] - d["min"]) < 5 else f"{d['max']:,.0f} ({d['min']:,.0f})"


def _layout_name(r: dict) -> str:
    if r["dp"] == 1:
        return "1 process" + (", untied head" if r.get("variant") == "untied" else "")
    return f"dp{r['dp']} " + (f"ZeRO-{r['zero_stage']}" if r["zero_stage"] else "ZeRO off (DDP)")


def _model_rows(mem: dict, allocator: str) -> list[dict]:
    return [r for r in mem["rows"] if r["kind"] == "model" and r["allocator"] == allocator]


def _train_excess(r: dict) -> float | None:
    d = r.get("train_minus_baseline_mib")
    return None if d is None else d["max"] - r["dufu_estimate_mib"]


def _before_train(r: dict, before: dict | None) -> float | None:
    """The train-phase MiB above baseline of the same layout in an earlier results file (``--before``)."""
    if not before:
        return None
    for b in before.get("memory", {}).get("rows", []):
        if (b["kind"], b["dp"], b["zero_stage"], b.get("variant", ""), b["allocator"]) == (
                "model", r["dp"], r["zero_stage"], r.get("variant", ""), r["allocator"]):
            d = b.get("train_minus_baseline_mib")
            return None if d is None else d["max"]
    return None


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def memory_table(mem: dict, allocator: str, before: dict | None = None) -> list[str]:
    body = []
    for r in _model_rows(mem, allocator):
        if r.get("returncode") != 0:
            body.append([_layout_name(r), "failed"] + ["-"] * (14 if before else 13))
            continue
        train = r.get("train_minus_baseline_mib", {}).get("max")
        row = [_layout_name(r), f"{r['parameters'] / 1e6:.1f}M", fmt(r["theory_mib"]),
               fmt(r.get("zero_figure_mib")), fmt(r["dufu_estimate_mib"]), fmt(r["peak_mib_max_rank"]),
               fmt(r.get("baseline_peak_mib_max_rank")), _diff(r, "peak"), _diff(r, "build")]
        if before:
            row.append(fmt(_before_train(r, before)))
        row += [_diff(r, "train"), _ratio(train, r["theory_mib"]), _ratio(train, r.get("zero_figure_mib")),
                _ratio(train, r.get("zero_figure_activations_mib")), fmt(_train_excess(r), "+,.0f"),
                _diff(r, "checkpoint")]
        body.append(row)
    head = ["layout", "params", "ZeRO: model states", "ZeRO: + one unit's working set", "dufu mechanism estimate",
            "peak RSS", "baseline peak RSS", "peak - baseline", "build - baseline"]
    if before:
        head.append(f"train - baseline, before ({before['machine']['dufu_commit']})")
    head += ["train - baseline", "train / model states", "train / (model states + unit)",
             "train / (model states + unit + activations)", "train - baseline - estimate", "checkpoint - baseline"]
    return table(head, body)


def _span(d: dict | None, spec: str = ",.0f") -> str:
    """max over ranks, the min in parentheses where ranks differ by 5 MiB or more."""
    if d is None:
        return "-"
    return format(d["max"], spec) if abs(d["max"] - d["min"]) < 5 else f"{d['max']:{spec}} ({d['min']:{spec}})"


def init_pairs(init: dict) -> list[tuple[dict | None, dict | None]]:
    """(meta_init=True row, meta_init=False row) per layout, in run order."""
    keys = list(dict.fromkeys(r["key"] for r in init["rows"] if r["kind"] == "model"))
    pick = lambda k, m: next((r for r in init["rows"] if r["kind"] == "model" and r["key"] == k  # noqa: E731
                              and r["meta_init"] is m), None)
    return [(pick(k, True), pick(k, False)) for k in keys]


def _ok(r: dict | None) -> bool:
    return r is not None and "build_minus_baseline_mib" in r


def init_table(init: dict) -> list[str]:
    P = init["parameters"]["total"]
    body = []
    for meta, full in init_pairs(init):
        any_row = meta or full
        held = [h for h in (meta or {}).get("held_parameters", []) if h is not None]
        saved = None
        if _ok(meta) and _ok(full):
            saved = {k: full["build_minus_baseline_mib"][k] - meta["build_minus_baseline_mib"][k]
                     for k in ("max", "min")}
        body.append([
            any_row["layout"], str(any_row["nproc"]),
            (f"{max(held) / 1e6:.2f}M" + (f" ({min(held) / 1e6:.2f}M)" if max(held) - min(held) > 1e4 else "")
             if held else "-"),
            f"{P / any_row['shard_divisor'] / 1e6:.2f}M",
            _span(meta.get("theory_build_mib") if meta else None),
            _span(meta.get("build_minus_baseline_mib") if meta else None) if _ok(meta) else "failed",
            _span(full.get("theory_build_mib") if full else None),
            _span(full.get("build_minus_baseline_mib") if full else None) if _ok(full) else "failed",
            signed(saved["max"]) if saved else "-",
            _span(meta.get("peak_minus_baseline_mib") if meta else None),
            _span(full.get("peak_minus_baseline_mib") if full else None),
            _span(meta.get("train_minus_baseline_mib") if meta else None),
        ])
    return table(["layout", "procs", "parameters held per rank", "P / n", "theory, meta: 4 B x held + largest module",
                  "build - baseline, meta_init=True", "theory, full: 4 B x P + largest module", "build - baseline, meta_init=False",
                  "full - meta (build)", "peak - baseline, meta", "peak - baseline, full",
                  "train - baseline, meta"], body)


def allocator_table(mem: dict) -> list[str]:
    fixed = {(r["dp"], r["zero_stage"]): r for r in _model_rows(mem, "mmap64k") if r.get("returncode") == 0
             and not r.get("variant")}
    body = []
    for r in _model_rows(mem, "default"):
        if r.get("returncode") != 0:
            continue
        other = fixed.get((r["dp"], r["zero_stage"]), {})
        body.append([_layout_name(r), fmt(r["theory_mib"]), _diff(r, "train"), _diff(other, "train"),
                     fmt(r["peak_mib_max_rank"]), fmt(other.get("peak_mib_max_rank"))])
    return table(["layout", "theory", "train - baseline, default malloc", "train - baseline, mmap >= 64 KiB",
                  "peak RSS, default malloc", "peak RSS, mmap >= 64 KiB"], body)


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem_total = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    import torch

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--", "dufu"):
        commit += " (+ uncommitted changes in dufu/)"
    return {
        "cpu": cpu, "cores": CORES, "memory_gib": mem_total, "torch": torch.__version__,
        "python": platform.python_version(), "libc": " ".join(platform.libc_ver()), "platform": platform.platform(),
        "dufu_commit": commit,
    }


def report(results: dict) -> str:
    info, lines = results["machine"], []
    lines += [f"# Parallel layouts - {results['date']}", "", f"> {NOTE}", ""]
    lines.append(f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB RAM; torch {info['torch']}, "
                 f"Python {info['python']}, {info['libc']}; {info['platform']}; dufu {info['dufu_commit']}. "
                 f"Load average {results['load_avg_start']} at the start, {results['load_avg_end']} at the end"
                 + (f" (above {info['cores']}: other work shared the cores)"
                    if max(results['load_avg_start'], results['load_avg_end']) > info['cores'] else "")
                 + f". Total time {results['total_s']:.0f} s, "
                 f"{results['cpu_s']:.0f} CPU seconds in all benchmark processes."
                 + (" Quick run." if results["quick"] else ""))
    if "throughput" in results:
        t = results["throughput_setup"]
        lines += ["", "## Throughput", "",
                  f"`gpt_debug` with {t['model']}, sequence {t['seq_length']}; global batch {t['global_batch_size']} "
                  f"sequences ({t['global_batch_size'] * t['seq_length']:,} tokens) = micro {t['micro_batch_size']} "
                  f"x dp x accumulation; fp32; {t['steps']} steps, median `tokens_per_s` of the steps after "
                  f"{t['warmup']} (from `metrics.jsonl`, `log_period=1`). "
                  "Pipeline layouts run the accumulation steps as 1F1B micro-batches.", ""]
        lines += throughput_table(results["throughput"])
    if "memory" in results:
        mem = results["memory"]
        c = mem["parameters"]
        lines += ["", "## Memory per rank, ZeRO stages", "",
                  f"`gpt_debug` with {mem['model']}: {c['total']:,} parameters ({c['per_block']:,} per block; "
                  f"FSDP units besides the blocks: embedding tables {c.get('embedding_unit', c['root']):,}, final "
                  f"norm + head {c.get('head_unit', c['root']):,}, the head tied to the embedding); {mem['steps']} steps, "
                  f"micro-batch {mem['micro_batch_size']} x sequence {mem['seq_length']}, fp32, AdamW. All values "
                  "MiB per rank, the largest rank; where ranks differ by 5 MiB or more, the smallest follows in "
                  "parentheses. Peak RSS is measured per worker process (`benchmarks/_worker.py`); baseline = the "
                  "same layout with a 1-layer, hidden-64 model (Python, torch, gloo, data). Phases: build = "
                  f"`Trainer.__init__` (data, {_build_how(mem)}, process group, sharding), train = the "
                  "steps, checkpoint = the final save.", "",
                  "*ZeRO: model states* = the ZeRO paper's model states (Rajbhandari et al. 2020): 4 B parameters "
                  "+ 4 B gradients + 8 B AdamW moments per parameter; ZeRO-1 shards the moments over dp, ZeRO-2 "
                  "also the gradients, ZeRO-3 also the parameters. *+ one unit's working set* = that + what a "
                  "rank holds beyond its shards while one FSDP unit is in backward (the paper's temporary "
                  "buffers): a block's gathered parameters, its full-size gradient and the next block gathered "
                  f"ahead (12 B x {c['per_block']:,} parameters), or at the end the embedding's full-size "
                  "gradient and its reduce-scatter buffer (8 B per parameter), whichever is larger: "
                  f"{working_set_bytes(c) / MiB:,.0f} MiB. *dufu mechanism estimate* = ZeRO off (`replicate`): "
                  "16 B/param; ZeRO-3: the ZeRO figure + the tied head's sharded copy of the embedding "
                  f"({c.get('tied_copy', 0):,} parameters, 4/dp B each); ZeRO-1 and ZeRO-2 (one mechanism, "
                  "stage 1 with stage-2 sharding; blocks and root units): the larger of the ZeRO figure and the "
                  "start of backward, 12/dp B/param of shards + every block and the root (embeddings, head, "
                  "final norm) gathered + the head's full gradient (4 B each). Activations (micro-batch 1 x 64 tokens: about 3 MiB per block) are not in these figures "
                  "and appear in the last column. *+ activations* = the model states + one unit's working set + "
                  "the activations as the 1-process run measures them (its training peak above baseline minus "
                  "its model states" + (f": {mem['activations_mib']:,.0f} MiB" if mem.get("activations_mib")
                                         is not None else "") + ").", "",
                  "### glibc malloc with `MALLOC_MMAP_THRESHOLD_=65536` (RSS follows live tensors)", ""]
        lines += memory_table(mem, "mmap64k", results.get("before"))
        if _model_rows(mem, "default"):
            lines += ["", "### The same layouts with glibc's default malloc", ""]
            lines += allocator_table(mem)
    if "init" in results:
        init = results["init"]
        c = init["parameters"]
        lines += ["", "## Build memory per rank: meta-device initialisation vs the full model first", "",
                  f"The memory model again (`gpt_debug` with {init['model']}: P = {c['total']:,} parameters, "
                  f"4 B x P = {4 * c['total'] / MiB:,.0f} MiB in fp32), {init['steps']} steps, micro-batch "
                  f"{init['micro_batch_size']} (pp micro-batches per step under pipeline parallelism), glibc malloc "
                  "with `MALLOC_MMAP_THRESHOLD_=65536`, each layout run twice: `train.meta_init=True` (the default: "
                  "build on the meta device, split, shard, then allocate and initialise only the rank's shards, "
                  "`dufu/parallel/materialize.py`) and `train.meta_init=False` (the full fp32 model built and "
                  "initialised on every rank, then split and sharded). Baseline = the same layout with a tiny "
                  "model (1 layer, or as many as pipeline stages; hidden 64). MiB per rank, the largest rank; "
                  "where ranks differ by 5 MiB or more, the smallest follows in parentheses.", "",
                  "*parameters held per rank* = counted in each worker after the build (local shards of DTensors, "
                  "a tied tensor once; a last pipeline stage holds its own copy of a tied embedding); *P / n* = "
                  "the simple share, n = dp under ZeRO, x tp, x pp. *theory, meta* = 4 B x the parameters the rank "
                  f"holds + the largest single module filled in full before its shard is cut (`{c['largest_module']}`"
                  f", {c['largest_module_bytes'] / MiB:,.0f} MiB); *theory, full* = 4 B x P, the whole model on "
                  "every rank, + the same largest module (`meta_init=False` fills the full model through the "
                  "same per-module initialiser, so both give the same weights). *full - meta* = what building on the meta device saves in the build phase. "
                  "*peak* = the whole run's peak (build, train, checkpoint).", ""]
        lines += init_table(init)
    if results.get("observations"):
        lines += ["", "## Observations", ""] + [f"* {o}" for o in results["observations"]]
    return "\n".join(lines) + "\n"


def _build_how(mem: dict) -> str:
    flags = {r.get("meta_init") for r in mem["rows"] if r["kind"] == "model" and r.get("returncode") == 0}
    if flags == {True}:
        return "the model built on the meta device, each rank allocating its own shards (`train.meta_init=True`)"
    if flags == {False}:
        return "the full model on every rank (`train.meta_init=False`)"
    return "the full model on every rank"  # results from before the meta-device build recorded the flag


def observations(results: dict) -> list[str]:
    """Statements computed from this run's numbers (nothing here is a fixed claim)."""
    return run_observations(results) + init_observations(results.get("init"))


def run_observations(results: dict) -> list[str]:
    """Throughput and ZeRO memory."""
    obs = []
    rows = results.get("throughput", [])
    ok = [r for r in rows if "median_tokens_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["median_tokens_per_s"])
        worst = min(ok, key=lambda r: r["median_tokens_per_s"])
        loads = [r["load_avg_before"] for r in rows]
        cores = results["machine"]["cores"]
        obs.append(f"Throughput: fastest {best['layout']} ({best['median_tokens_per_s']:,.0f} tokens/s), slowest "
                   f"{worst['layout']} ({worst['median_tokens_per_s']:,.0f}). {cores} cores, 1 thread per process: "
                   f"up to {cores} processes add cores, more only add communication and time-slicing."
                   + (f" Other jobs kept the load average at {min(loads):.1f}-{max(loads):.1f} during these runs "
                      f"(on {cores} cores), so the rates carry their noise: only large gaps between layouts mean "
                      "anything." if max(loads) > cores else ""))
        tp = [r for r in ok if r["tp"] > 1]
        rest = [r for r in ok if r["tp"] == 1]
        if tp and rest:
            obs.append(
                f"Tensor-parallel layouts take {min(r['median_step_ms'] for r in tp):,.0f}-"
                f"{max(r['median_step_ms'] for r in tp):,.0f} ms per step, the others "
                f"{min(r['median_step_ms'] for r in rest):,.0f}-{max(r['median_step_ms'] for r in rest):,.0f}: "
                "TP exchanges activations inside every layer (forward and backward, every micro-batch), and on a "
                "model 128 wide those small collectives cost more than the matmuls they split. DP and PP "
                "communicate once per step or once per micro-batch and stage.")
        diffs = [r["max_abs_loss_diff_vs_1proc"] for r in ok if r.get("max_abs_loss_diff_vs_1proc") is not None]
        if diffs:
            obs.append(f"Every layout's logged losses match the 1-process run to {max(diffs):.1e} or better (fp32), "
                       "so all layouts train the same model on the same samples.")
    failed = [r["layout"] for r in rows if "median_tokens_per_s" not in r]
    if failed:
        obs.append(f"Failed layouts: {', '.join(failed)} (the JSON file holds the log tail).")
    mem = results.get("memory")
    if not mem:
        return obs
    fixed = {(r["dp"], r["zero_stage"], r.get("variant", "")): r for r in _model_rows(mem, "mmap64k")
             if "train_minus_baseline_mib" in r}
    train = {k: r["train_minus_baseline_mib"]["max"] for k, r in fixed.items()}
    full_mib = 4.0 * mem["parameters"]["total"] / MiB
    pairs = [f"dp{dp} {train[(dp, 1, '')]:,.0f} and {train[(dp, 2, '')]:,.0f}" for dp in sorted({k[0] for k in train})
             if (dp, 1, "") in train and (dp, 2, "") in train]
    if pairs:
        obs.append(f"ZeRO-1 and ZeRO-2 measure the same ({'; '.join(pairs)} MiB in training): one mechanism "
                   "(FSDP2 always reduce-scatters gradients; stage 1 runs with stage-2 sharding, as "
                   "`dufu/parallel/data_parallel.py` says), below the paper's ZeRO-1 figure, above its ZeRO-2 "
                   "figure: the blocks' gathered parameters stay from forward until their backward.")
    z3 = [(dp, fixed[(dp, 3, "")]) for dp in sorted({k[0] for k in fixed}) if (dp, 3, "") in fixed]
    if z3:
        obs.append("ZeRO-3 training peak above baseline: " + "; ".join(
            f"dp{dp} {train[(dp, 3, '')]:,.0f} MiB = {train[(dp, 3, '')] / r['theory_mib']:.2f}x the model states "
            f"({r['theory_mib']:,.0f}), {train[(dp, 3, '')] / r['zero_figure_mib']:.2f}x the model states + one "
            f"unit's working set ({r['zero_figure_mib']:,.0f})"
            + (f", {train[(dp, 3, '')] / r['zero_figure_activations_mib']:.2f}x that + the activations "
               f"({r['zero_figure_activations_mib']:,.0f})" if r.get("zero_figure_activations_mib") else "")
            + f", {train[(dp, 3, '')] - r['dufu_estimate_mib']:+,.0f} "
            f"MiB from the mechanism estimate ({r['dufu_estimate_mib']:,.0f})" for dp, r in z3) + ".")
        if mem.get("activations_mib") is not None:
            obs.append(f"Activations: the 1-process run holds {mem['activations_mib']:,.0f} MiB above its model "
                       "states at its training peak (saved activations of micro-batch 1, the fp32 logits); every "
                       "dp rank holds as much, whatever the ZeRO stage, so a figure of model states alone cannot "
                       "be met as dp grows (at dp 8 they would be half of a rank's model states here). The "
                       "ratio to model states + unit + activations is the one that stays meaningful.")
    before = results.get("before")
    if before:
        changes = []
        for k, r in fixed.items():
            b = _before_train(r, before)
            if b is not None and k[1]:
                changes.append(f"{_layout_name(r)} {b:,.0f} -> {train[k]:,.0f}")
        if changes:
            obs.append(f"Train phase above baseline, before ({before['machine']['dufu_commit']}, run "
                       f"{before.get('date', '?')} on {before['machine']['cpu']}) -> now: " + "; ".join(changes)
                       + " MiB.")
    drops = []
    for stage in (0, 1, 2, 3):
        if (2, stage, "") in train and (4, stage, "") in train:
            got = train[(2, stage, "")] - train[(4, stage, "")]
            want = fixed[(2, stage, "")]["dufu_estimate_mib"] - fixed[(4, stage, "")]["dufu_estimate_mib"]
            got = 0.0 if abs(got) < 0.5 else got
            drops.append(f"{'ZeRO-' + str(stage) if stage else 'ZeRO off'} {got:,.0f} (estimate {want:,.0f})")
    if drops:
        obs.append("The part that depends on dp follows the estimate: train-phase memory falls from dp2 to dp4 by "
                   + ", ".join(drops) + " MiB.")
    for r in _model_rows(mem, "mmap64k"):
        if r.get("rerun"):
            obs.append(f"{_layout_name(r)}: {r['rerun']}.")
    excess = {k: _train_excess(r) for k, r in fixed.items()}
    zero_excess = [v for k, v in excess.items() if k[0] > 1 and k[1] and v is not None]
    if (1, 0, "") in excess and (1, 0, "untied") in excess:
        obs.append(
            f"Above the estimate: one process holds {excess[(1, 0, '')]:+,.0f} MiB with the tied embedding/head "
            f"and {excess[(1, 0, 'untied')]:+,.0f} MiB untied. The tied weight's two gradients (embedding and "
            f"head, {4 * mem['parameters'].get('tied_copy', 0) / MiB:,.0f} MiB each) are alive together while "
            "autograd sums them: transient gradient memory, not a leak.")
    if zero_excess:
        obs.append(f"The ZeRO layouts measure {min(zero_excess):+,.0f} to {max(zero_excess):+,.0f} MiB from their "
                   "mechanism estimates (gloo's staging buffers, autograd's saved activations and allocator "
                   "rounding are not in the estimate).")
    builds = {k: r["build_minus_baseline_mib"]["max"] for k, r in fixed.items() if r["dp"] > 1}
    if builds:
        name = lambda k: f"dp{k[0]} " + (f"ZeRO-{k[1]}" if k[1] else "ZeRO off")  # noqa: E731
        share = max(((builds[k] / train[k], k) for k in builds if train.get(k, 0) > 0), default=None)
        obs.append("Build phase above baseline: " + ", ".join(f"{name(k)} {v:,.0f}" for k, v in builds.items())
                   + f" MiB, with {_build_how(mem)}; every parameter in fp32 is {full_mib:,.0f} MiB."
                   + (f" The largest share of the training phase is {100 * share[0]:.0f}% ({name(share[1])})."
                      if share else ""))
    ck = [r["checkpoint_minus_baseline_mib"]["max"] - train[k] for k, r in fixed.items()]
    if ck:
        obs.append(f"The final checkpoint save stays {-max(ck):,.0f} MiB or more below the training peak in "
                   "every layout (no gathering of full tensors).")
    for r in _model_rows(mem, "default"):
        other = fixed.get((r["dp"], r["zero_stage"], ""))
        if "train_minus_baseline_mib" in r and other:
            a, b = r["train_minus_baseline_mib"]["max"], train[(r["dp"], r["zero_stage"], "")]
            obs.append(f"Default malloc, {_layout_name(r)}: {a:,.0f} MiB above baseline in training vs {b:,.0f} "
                       f"with the fixed mmap threshold ({a / b:.1f}x): freed tensor memory stays in the process's "
                       "heap (the amount varies from run to run).")
    return obs


def init_observations(init: dict | None) -> list[str]:
    """The meta-device build against the full model first, from this run's numbers."""
    if not init:
        return []
    obs = []
    c = init["parameters"]
    full_mib, largest_mib = 4.0 * c["total"] / MiB, c["largest_module_bytes"] / MiB
    failed = [r.get("layout") or r["key"] for r in init["rows"] if r.get("returncode") != 0]
    if failed:
        obs.append(f"Build comparison, failed runs: {', '.join(failed)} (the JSON file holds the log tail).")
    pairs = [(m, f) for m, f in init_pairs(init) if _ok(m) and _ok(f)]
    if not pairs:
        return obs
    b = lambda r, ph="build": r[f"{ph}_minus_baseline_mib"]["max"]  # noqa: E731
    obs.append("Build phase above baseline (largest rank), meta_init=True vs False: "
               + "; ".join(f"{m['layout']} {b(m):,.0f} vs {b(f):,.0f}" for m, f in pairs) + " MiB.")
    noise = 4.0  # MiB: repeated runs of one layout differ by about 1-2 MiB here
    saving = lambda m, f: b(f) - b(m)  # noqa: E731
    predicted = lambda m, f: f["theory_build_mib"]["max"] - m["theory_build_mib"]["max"]  # noqa: E731
    as_predicted = [(m, f) for m, f in pairs if predicted(m, f) > noise and saving(m, f) >= 0.5 * predicted(m, f)]
    short = [(m, f) for m, f in pairs if predicted(m, f) > noise and saving(m, f) < 0.5 * predicted(m, f)]
    controls = [(m, f) for m, f in pairs if predicted(m, f) <= noise]
    if as_predicted:
        obs.append("The meta-device build lowers the build phase where a rank holds part of the parameters: "
                   + "; ".join(f"{m['layout']} by {saving(m, f):,.0f} MiB (theory {predicted(m, f):,.0f}; "
                               f"{100 * saving(m, f) / b(f):.0f}% of the full build)" for m, f in as_predicted)
                   + ".")
    if short:
        obs.append("The meta-device build saves less than half of what the theory says in "
                   + "; ".join(f"{m['layout']} ({saving(m, f):+,.0f} MiB, theory {predicted(m, f):,.0f})"
                               for m, f in short)
                   + ": something there allocates more than the rank's shards during the build.")
    if controls:
        obs.append(f"Where a rank holds every parameter ({', '.join(m['layout'] for m, f in controls)}) the theory "
                   "predicts no saving; full - meta measures "
                   + ", ".join(f"{signed(saving(m, f))}" for m, f in controls) + " MiB"
                   + (f": within {noise:,.0f} MiB, the same." if all(abs(saving(m, f)) <= noise for m, f in controls)
                      else "."))
    for meta_init, label, what in ((True, "meta_init=True", "4 B x held + largest module"),
                                   (False, "meta_init=False", "4 B x P + largest module")):
        rows = [m if meta_init else f for m, f in pairs]
        ex = [(r["build_minus_theory_mib"]["max"], r["build_minus_theory_mib"]["min"], r) for r in rows]
        lo, hi = min(e[1] for e in ex), max(e[0] for e in ex)
        span = signed(hi) if round(lo) == round(hi) else f"{signed(lo)} to {signed(hi)}"
        text = f"{label}: the build phase is {span} MiB from the theory ({what}) on every rank"
        over = [(e[0], e[2]) for e in ex if e[0] > largest_mib]
        if over:
            details = []
            for extra, r in over:
                ratio = r["build_minus_baseline_mib"]["max"] / full_mib
                why = ""
                if not meta_init and r["pp"] > 1:
                    why = (": the trainer cuts each stage from a deep copy of the full model "
                           "(`build_stage_module`) while the full model is still alive, so for a moment a rank "
                           "holds two full copies")
                elif not meta_init and r["tp"] > 1:
                    why = (f": the TP shards are cut while the full tensors are still alive (up to 4 B x P x "
                           f"(1 + 1/tp) = {full_mib * (1 + 1 / r['tp']):,.0f} MiB)")
                details.append(f"{r['layout']} {signed(extra)} MiB ({ratio:.2f} x 4 B x P){why}")
            text += f"; more than one largest module ({largest_mib:,.0f} MiB) above it in " + "; ".join(details)
        if meta_init:
            # distribute_tensor cuts the rank's piece of each full tensor as a new tensor before copying it in.
            cut = [(e[0], largest_mib / e[2]["shard_divisor"], e[2]) for e in ex
                   if e[2]["shard_divisor"] > 1 and e[0] > noise]
            if cut and all(abs(x - want) <= noise / 2 for x, want, _ in cut):
                text += ("; the excess in " + ", ".join(f"{r['layout']} ({signed(x)})" for x, _, r in cut)
                         + " matches one shard of the largest module ("
                         + ", ".join(f"{want:,.0f}" for _, want, _ in cut) + " MiB), the piece `distribute_tensor` "
                         "cuts from the full value before it is copied into the parameter")
        obs.append(text + ".")
    sets = {flag: [] for flag in (True, False)}
    for m, f in pairs:
        for r in (m, f):
            if b(r) >= max(b(r, "train"), b(r, "checkpoint")) - 1.0:
                sets[r["meta_init"]].append(r["layout"])
    obs.append("Whole-run peak above baseline, meta_init=True vs False: "
               + "; ".join(f"{m['layout']} {b(m, 'peak'):,.0f} vs {b(f, 'peak'):,.0f}" for m, f in pairs)
               + " MiB. The build phase sets the run's peak "
               + (f"with meta_init=False in {', '.join(sets[False])}" if sets[False] else
                  "in no layout with meta_init=False")
               + (f", with meta_init=True in {', '.join(sets[True])}." if sets[True] else
                  ", and in none with meta_init=True."))
    return obs


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
    date = _dt.date.today().isoformat()
    results: dict = {"date": date, "quick": args.quick, "machine": machine_info(), "load_avg_start": round(load0, 2),
                     "note": NOTE}
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
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    results["cpu_s"] = kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    results["observations"] = observations(results)
    text = report(results)
    print()
    print(text)
    if not args.quick or args.results_dir:
        out_dir = Path(args.results_dir or REPO / "benchmarks" / "results")
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = out_dir / f"parallel-{date}"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem}.json and {stem}.md")
    failed = [r for r in results.get("throughput", []) if r.get("returncode") != 0]
    failed += [r for r in results.get("memory", {}).get("rows", []) if r.get("returncode") != 0]
    failed += [r for r in results.get("init", {}).get("rows", []) if r.get("returncode") != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
