"""Mixture of experts on the CPU, side by side in one run: a MoE model against a dense model with as many active
parameters per token, and the share of a step the expert-parallel all-to-all takes at each expert-parallel size.

    python benchmarks/moe.py              # both parts (~4 minutes on 2 cores; up to ~8 when the cores are busy)
    python benchmarks/moe.py --quick      # a smoke run (< 1 minute), writes nothing unless --results-dir
    python benchmarks/moe.py --only dense # or --only ep, --only grouped
    python benchmarks/moe.py --before benchmarks/results/moe-DATE-before.json   # + part 1 of an earlier run

**Part 1, MoE vs dense at equal active parameters** (one process, fp32). The MoE model is ``moe_debug`` made
larger so that the matmuls dominate the fixed costs: hidden 256, 4 layers, 4 query / 2 key-value heads, 8 SwiGLU
experts of ``F`` = 384 with top-2 routing in every block (load-balancing loss 0.01), sequence 128. The dense model
is ``llama_debug`` at the same shape with a SwiGLU of ``top_k x F`` = 768, so a token multiplies the same number of
weights in both (the MoE model adds its routers: 8 x 256 per block). Both are dufu ``Trainer``s built in this
process from their recipes with the same overrides: the same byte-level corpus, batch (8 x 128 tokens), seed and
sample order (checked step by step), AdamW, gradient clipping. After 3 warm-up steps each, ``--steps`` timed
``Trainer.train_step()`` calls per model are interleaved (A B A B, the first model alternating), and the medians are
reported with the machine's load meanwhile. One torch thread (``--threads``), as in every process of part 2: with
two OpenMP threads, steps became many times slower whenever other processes competed for the 2 cores (a dense
step ranged from 0.8 to 12 s in such a run), since the threads wait for each other at every parallel region.
MFU is the start-up summary's: the trainer's model FLOPs per token (6N + 12*L*H*T, N counting top_k / E of the
experts) times tokens/s over its measured fp32 matmul peak. Then each model runs six more steps under
``torch.profiler``, interleaved, which split a step by kind of op (matmul, attention, routing, token permutation,
zero-fill, optimizer, other ops, and the time between ops: Python and dispatch); the shortest profiled step of
each is kept (the first one pays for the profiler's start).

**Part 2, the all-to-all vs the expert-parallel size** (4 processes, gloo). The same MoE model is trained by
``dufu train moe_debug --nproc 4 train.dist.data_parallel_size=4 train.dist.expert_parallel_size=EP`` for EP = 1,
2, 4, everything else equal (micro-batch 4 per rank, so 16 x 128 tokens per step; ``train.log_period=1``); the
runs are interleaved (1 2 4, 4 2 1, ...) ``--repeats`` times, 16 steps each. The step time is the median of
``step_time_s`` in the run's ``metrics.jsonl`` after the first 4 steps (the slowest rank's step time, see
``dufu.engine.reporting.report.StepClock``).
Every worker's Trainer gets a hook through ``train.hooks`` (``benchmarks/moe_probe.py``) that times, per step and
rank, changing nothing the run computes: the step (``on_step_start`` to ``after_optimizer``); dispatch and combine
(the experts modules' forward pre-hooks and hooks, ``ExpertDispatch``'s among them); the token all-to-all in
forward and in backward; the token-count exchange (``torch.distributed.all_to_all_single``); and
``torch.distributed.all_reduce`` (the data-parallel gradient average and the loss, norm and count reductions).

The all-to-all share of a step is (token all-to-alls forward + backward + count exchanges) / step, per rank, the
mean over ranks, median over steps and repeats. A collective's time includes waiting for the slowest peer of its
group to arrive: the share says how long ranks stand in the all-to-all, transfer and waiting together. The
CPU-time share (process CPU time inside the all-to-all over the step's) is the compute the exchange itself
costs. With 4 processes on 2 cores the machine is oversubscribed, so only ratios mean something.

**Part 3, the experts' grouped GEMM vs their per-expert loop** (one process, fp32 and bf16 autocast). The two
paths of :class:`dufu.layers.moe.GroupedExperts` at equal shapes, the model of part 1: one ``torch._grouped_mm``
per projection with the experts' offsets computed on the device (``grouped_mm=None``, the default, where
:func:`dufu.layers.moe.grouped_mm_available`), against one pair of matmuls per expert on slices cut by
``counts.tolist()`` (``grouped_mm=False``). Measured twice: one MoE layer's forward and backward on the step's
tokens (``batch x seq`` tokens, hidden ``H``, ``E`` experts of ``F``, top-k; ``--layer-reps`` interleaved
repetitions, median), and the MoE model's ``Trainer.train_step()`` with every experts module switched between
the paths at alternate steps (one trainer per dtype, so both paths train the same model on the same data
stream; the first path alternates). The host reads of one layer's forward and backward are counted for each
path (:func:`dufu.engine.host_reads.count_host_reads`). The CPU's model and its bf16 features
(AMX, AVX512-BF16) are in the report: without them bf16 matmuls are slower than fp32 ones.

Results: ``benchmarks/results/moe-<date>.md`` (``moe-<date>-grouped.md`` for ``--only grouped``), ``.json`` and
``.png`` (step time vs EP, all-to-all vs the rest),
with the dufu commit and the files of dufu/ changed from it (``--note`` adds a description of the code), and a
warning when a file of dufu/ changed while the benchmark ran. ``--before FILE`` puts part 1 of an earlier results
file (say, of the code before a change, run from a copy of the tree) beside this run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, proc, results as results_files
from moe_report import PROFILE_KINDS, PROFILE_ROUNDS, before_summary, observations, op_kind, plot, report

# The model (part 1 and part 2) and the runs. ``expert_ffn`` is each expert's F; the dense model's SwiGLU is
# top_k x F. ``ep_micro_batch`` is part 2's micro-batch per rank.
SHAPES = {
    "full": dict(hidden_size=256, num_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 top_k=2, expert_ffn=384, seq=128, batch=8, ep_micro_batch=4),
    "quick": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  top_k=2, expert_ffn=64, seq=32, batch=4, ep_micro_batch=2),
}
RUNS = {
    "full": dict(warmup=3, steps=30, ep_nproc=4, ep_sizes=(1, 2, 4), ep_steps=16, ep_warmup=4, repeats=3,
                 layer_reps=20, grouped_steps=10),
    "quick": dict(warmup=1, steps=2, ep_nproc=2, ep_sizes=(1, 2), ep_steps=4, ep_warmup=1, repeats=1,
                  layer_reps=2, grouped_steps=2),
}
# Part 3's dtypes: the Trainer's precision overrides and the layer's autocast dtype (None: fp32).
GROUPED_DTYPES = {"fp32": (["train.amp.enabled=False"], None),
                  "bf16": (["train.amp.enabled=True", "train.amp.dtype=bf16"], "bfloat16")}
PATHS = {"loop": False, "grouped": None}  # GroupedExperts.grouped_mm of each path
RECIPES = {"moe": "moe_debug", "dense": "llama_debug"}
RUN_SETTINGS = ["train.amp.enabled=False", "train.compile.enabled=False", "train.evaluation.enabled=False",
                "train.generation.enabled=False", "train.tensorboard=False", "train.checkpointer.period=0",
                "train.log_period=1"]


def log(msg: str) -> None:
    print(f"[moe] {msg}", flush=True)


def model_overrides(shape: dict, kind: str) -> list[str]:
    """The model keys of ``moe_debug`` (kind "moe") or ``llama_debug`` ("dense") for ``shape``."""
    common = [f"model.{k}={shape[k]}" for k in ("hidden_size", "num_layers", "num_attention_heads",
                                                  "num_key_value_heads")]
    common += [f"model.max_position_embeddings={shape['seq']}", f"dataloader.train.seq_length={shape['seq']}"]
    if kind == "moe":
        return common + [f"model.num_experts={shape['num_experts']}", f"model.top_k={shape['top_k']}",
                         f"model.moe_ffn_hidden_size={shape['expert_ffn']}",
                         f"model.ffn_hidden_size={shape['expert_ffn']}"]  # no dense blocks: as Mixtral's config
    return common + [f"model.ffn_hidden_size={shape['top_k'] * shape['expert_ffn']}"]




# ============================================================================ part 1: MoE vs dense, one process
class _Contender:
    """A dufu Trainer of one recipe, stepped by hand; records wall time, CPU time, the machine's load and (a hook of
    the trainer) the samples each step drew."""

    def __init__(self, kind: str, shape: dict, workdir: Path):
        from dufu.config import LazyConfig, resolve_config_path
        from dufu.engine.trainer import Trainer
        from harness.hooks import StepTimes

        self.kind = kind
        self.overrides = model_overrides(shape, kind) + RUN_SETTINGS + [
            f"train.train_micro_batch_size={shape['batch']}", f"train.global_batch_size={shape['batch']}",
            f"train.output_dir={workdir / kind}"]
        cfg = LazyConfig.load(resolve_config_path(RECIPES[kind]))
        LazyConfig.apply_overrides(cfg, self.overrides)
        self.drawn = StepTimes()
        self.trainer = Trainer(cfg, log=lambda *a, **k: None, hooks=[self.drawn])
        self.wall, self.cpu, self.other_load, self.losses = [], [], [], []

    @property
    def indices(self) -> list:
        return self.drawn.samples

    def describe(self) -> dict:
        from dufu.engine.reporting.flops import count_matmul_params

        rt = self.trainer.runtime
        inactive = rt.moe.inactive_parameters if rt.moe else 0
        return {"recipe": RECIPES[self.kind], "model": rt.model_name, "parameters": rt.num_parameters,
                "active_parameters": int(round(rt.num_parameters - inactive)),
                "matmul_parameters_active": count_matmul_params(rt.model),
                "matmul_parameters_total": count_matmul_params(rt.model, active=False),
                "flops_per_token": rt.flops_per_token, "tokens_per_step": rt.tokens_per_step,
                "peak_flops": rt.peak_flops, "peak_source": rt.peak_source, "overrides": self.overrides}

    def step(self, timed: bool = True) -> None:
        busy0, cpu0, wall0 = proc.system_busy_seconds(), time.process_time(), time.perf_counter()
        loss, _ = self.trainer.train_step()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        busy1 = proc.system_busy_seconds()
        self.losses.append(float(loss))  # train_step returns the loss on the device
        if timed:
            self.wall.append(wall)
            self.cpu.append(cpu)
            other = proc.other_load(busy0, busy1, cpu, wall)
            if other is not None:
                self.other_load.append(other)


def profile_step(contender: _Contender) -> dict:
    """One training step under torch.profiler: the self CPU time of its ops by kind (ms) and their calls, the
    step's wall time. What the ops' self times leave of the wall time is the time between ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        contender.step(timed=False)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    ms, calls = dict.fromkeys(PROFILE_KINDS, 0.0), dict.fromkeys(PROFILE_KINDS, 0)
    fill_calls = select_backward_calls = grouped_calls = 0
    for ev in prof.key_averages():
        select_backward_calls += ev.count if ev.key == "SelectBackward0" else 0
        if not ev.key.startswith("aten::"):
            continue  # autograd nodes and Python-level regions: their ops are counted themselves
        kind = "matmul" if ev.key == "aten::_grouped_mm" else op_kind(ev.key)  # the experts' grouped GEMM
        grouped_calls += ev.count if ev.key == "aten::_grouped_mm" else 0
        ms[kind] += ev.self_cpu_time_total / 1e3
        calls[kind] += ev.count
        fill_calls += ev.count if ev.key == "aten::fill_" else 0
    ms["between ops (Python, dispatch)"] = max(0.0, wall_ms - sum(ms.values()))
    return {"ms": ms, "calls": calls, "wall_ms": wall_ms, "matmul_calls": calls["matmul"], "fill_calls": fill_calls,
            "select_backward_calls": select_backward_calls, "grouped_mm_calls": grouped_calls,
            "aten_calls": sum(calls.values())}


def compare_dense(shape: dict, runs: dict, workdir: Path) -> dict:
    import torch

    log("part 1: building the MoE and the dense trainer ...")
    contenders = {kind: _Contender(kind, shape, workdir) for kind in ("moe", "dense")}
    for c in contenders.values():
        for _ in range(runs["warmup"]):
            c.step(timed=False)
    order = list(contenders)
    log(f"part 1: {runs['steps']} timed steps each, interleaved")
    for i in range(runs["steps"]):
        for kind in (order if i % 2 == 0 else order[::-1]):
            contenders[kind].step()
    profiles = {kind: [] for kind in contenders}
    for _ in range(PROFILE_ROUNDS):  # interleaved; the least disturbed (shortest) profiled step of each is kept
        for kind, c in contenders.items():
            profiles[kind].append(profile_step(c))
    profiles = {kind: min(p[1:] or p, key=lambda x: x["wall_ms"])  # the first pays for the profiler's start
                for kind, p in profiles.items()}
    same_data = contenders["moe"].indices == contenders["dense"].indices
    best = max(contenders.values(), key=lambda c: c.trainer.runtime.peak_flops)  # the best reading: one basis for both
    peak, peak_source = best.trainer.runtime.peak_flops, best.trainer.runtime.peak_source
    rows = {}
    for kind, c in contenders.items():
        d = c.describe()
        median = statistics.median(c.wall)
        rows[kind] = {**d, "step_times_s": c.wall, "cpu_times_s": c.cpu, "other_load": c.other_load,
                      "losses": c.losses, "median_step_s": median, "min_step_s": min(c.wall),
                      "max_step_s": max(c.wall), "median_cpu_s": statistics.median(c.cpu),
                      "median_other_load": statistics.median(c.other_load) if c.other_load else None,
                      "tokens_per_s": d["tokens_per_step"] / median,
                      "mfu": d["flops_per_token"] * d["tokens_per_step"] / median / peak,
                      "profile": profiles[kind]}
    return {"shape": shape, "threads": torch.get_num_threads(), "warmup": runs["warmup"], "steps": runs["steps"],
            "same_samples": same_data, "peak_flops": peak, "peak_source": peak_source, "rows": rows,
            "step_time_ratio_moe_over_dense": rows["moe"]["median_step_s"] / rows["dense"]["median_step_s"]}



# ============================================================================ part 3: grouped GEMM vs the loop
def _set_path(model, path: str) -> None:
    from dufu.layers.moe import GroupedExperts

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.grouped_mm = PATHS[path]


def compare_layer(shape: dict, reps: int, dtype_name: str) -> dict:
    """One MoE layer's forward and backward on a step's tokens, by each path, interleaved: median ms, and the
    host reads of one pass."""
    import torch

    from dufu.engine.host_reads import count_host_reads
    from dufu.layers.moe import MoE

    torch.manual_seed(0)
    moe = MoE(shape["hidden_size"], shape["expert_ffn"], shape["num_experts"], top_k=shape["top_k"],
              aux_loss_coeff=0.01)
    x = torch.randn(shape["batch"] * shape["seq"], shape["hidden_size"], requires_grad=True)
    autocast = GROUPED_DTYPES[dtype_name][1]

    def once() -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=getattr(torch, autocast or "bfloat16"), enabled=autocast is not None):
            out = moe(x)
        out.float().square().mean().backward()
        return 1e3 * (time.perf_counter() - t0)

    times, reads, outputs = {p: [] for p in PATHS}, {}, {}
    for path in PATHS:  # warm-up (the grouped path's kernel probe runs here) and the host reads of one pass
        _set_path(moe, path)
        once()
        moe.zero_grad()
        x.grad = None
        with count_host_reads() as counter:
            once()
        reads[path] = counter.count
        outputs[path] = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
        moe.zero_grad()
        x.grad = None
    for i in range(reps):
        for path in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
            _set_path(moe, path)
            times[path].append(once())
            moe.zero_grad()
            x.grad = None
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(outputs["grouped"], outputs["loop"]))
    med = {p: statistics.median(t) for p, t in times.items()}
    return {"dtype": dtype_name, "tokens": x.shape[0], "reps": reps, "times_ms": times, "median_ms": med,
            "min_ms": {p: min(t) for p, t in times.items()},
            "grouped_over_loop": med["grouped"] / med["loop"], "host_reads": reads,
            "max_relative_grad_difference": diff}


def compare_step(shape: dict, runs: dict, workdir: Path, dtype_name: str) -> dict:
    """The MoE model's training step, its experts switched between the paths at alternate steps."""
    from dufu.config import LazyConfig, resolve_config_path
    from dufu.engine.trainer import Trainer

    overrides = model_overrides(shape, "moe") + RUN_SETTINGS + GROUPED_DTYPES[dtype_name][0] + [
        f"train.train_micro_batch_size={shape['batch']}", f"train.global_batch_size={shape['batch']}",
        f"train.output_dir={workdir / ('grouped-' + dtype_name)}"]
    overrides = [o for o in overrides if o != "train.amp.enabled=False" or dtype_name == "fp32"]
    cfg = LazyConfig.load(resolve_config_path(RECIPES["moe"]))
    LazyConfig.apply_overrides(cfg, overrides)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    model = trainer.runtime.model
    times, losses = {p: [] for p in PATHS}, {p: [] for p in PATHS}
    for path in PATHS:  # warm-up, one step each
        _set_path(model, path)
        trainer.train_step()
    for i in range(runs["grouped_steps"]):
        for path in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
            _set_path(model, path)
            t0 = time.perf_counter()
            loss, _ = trainer.train_step()
            times[path].append(time.perf_counter() - t0)
            losses[path].append(float(loss))
    med = {p: statistics.median(t) for p, t in times.items()}
    return {"dtype": dtype_name, "autocast_dtype": str(trainer.runtime.amp_dtype), "steps": runs["grouped_steps"],
            "overrides": overrides, "step_times_s": times, "losses": losses,
            "median_step_s": med, "min_step_s": {p: min(t) for p, t in times.items()},
            "grouped_over_loop": med["grouped"] / med["loop"]}


def compare_grouped(shape: dict, runs: dict, workdir: Path) -> dict:
    import torch

    from dufu.layers.moe import grouped_mm_available

    available = {name: {"eager": grouped_mm_available("cpu", getattr(torch, dt or "float32")),
                        "compiled": grouped_mm_available("cpu", getattr(torch, dt or "float32"), traced=True)}
                 for name, (_, dt) in GROUPED_DTYPES.items()}
    log(f"part 3: grouped GEMM available on the CPU: {available}")
    layer, step = {}, {}
    for name in GROUPED_DTYPES:
        log(f"part 3: one MoE layer, {name}, {runs['layer_reps']} repetitions per path ...")
        layer[name] = compare_layer(shape, runs["layer_reps"], name)
        log(f"  loop {layer[name]['median_ms']['loop']:.1f} ms, grouped {layer[name]['median_ms']['grouped']:.1f} ms")
    for name in GROUPED_DTYPES:
        log(f"part 3: the MoE training step, {name}, {runs['grouped_steps']} steps per path ...")
        step[name] = compare_step(shape, runs, workdir, name)
        log(f"  loop {1e3 * step[name]['median_step_s']['loop']:.0f} ms, "
            f"grouped {1e3 * step[name]['median_step_s']['grouped']:.0f} ms")
    return {"threads": torch.get_num_threads(), "available": available, "layer": layer, "step": step}


def grouped_report(part: dict, shape: dict, machine_info: dict) -> list[str]:
    """Part 3's Markdown section."""
    cpu = machine_info.get("cpu")
    features = ", ".join(machine_info.get("cpu_features") or []) or "none of avx2/avx512/amx"
    lines = ["## Grouped GEMM vs the per-expert loop (one process)", "",
             f"CPU: {cpu} ({features}); torch {machine_info.get('torch')}, {part['threads']} thread(s). Shape: "
             f"{shape['batch']} x {shape['seq']} = {shape['batch'] * shape['seq']:,} tokens, hidden "
             f"{shape['hidden_size']}, {shape['num_experts']} SwiGLU experts of {shape['expert_ffn']}, top-"
             f"{shape['top_k']}; the step is part 1's MoE model ({shape['num_layers']} MoE blocks). Grouped GEMM "
             "available: " + "; ".join(f"{k} eager {'yes' if v['eager'] else 'no'}, under torch.compile "
                                       f"{'yes' if v['compiled'] else 'no'}" for k, v in part["available"].items())
             + ".", "",
             "| measured | dtype | loop (ms) | grouped (ms) | grouped / loop (medians) | host reads per layer (loop / "
             "grouped) |",
             "|---|---|---:|---:|---:|---:|"]
    for name, r in part["layer"].items():
        lines.append(f"| one MoE layer, forward + backward | {name} | {r['median_ms']['loop']:.2f} "
                     f"({r['min_ms']['loop']:.2f}) | {r['median_ms']['grouped']:.2f} ({r['min_ms']['grouped']:.2f}) | "
                     f"{r['grouped_over_loop']:.2f}x | "
                     f"{r['host_reads']['loop']} / {r['host_reads']['grouped']} |")
    for name, r in part["step"].items():
        lines.append(f"| training step ({r['steps']} per path) | {name} | {1e3 * r['median_step_s']['loop']:.0f} "
                     f"({1e3 * r['min_step_s']['loop']:.0f}) | {1e3 * r['median_step_s']['grouped']:.0f} "
                     f"({1e3 * r['min_step_s']['grouped']:.0f}) | {r['grouped_over_loop']:.2f}x | |")
    lines += ["", "Medians of interleaved runs (in parentheses the fastest run; see the load average above: "
              "other processes share the cores). The layer's gradients by the two paths differ by at most "
              + ", ".join(f"{r['max_relative_grad_difference']:.1e} ({n})" for n, r in part["layer"].items())
              + " of their largest element.", ""]
    return lines



def grouped_observations(part: dict) -> list[str]:
    """Part 3's observations from its numbers."""
    out = []
    for name, r in part["layer"].items():
        s = part["step"].get(name)
        out.append(
            f"{name}: the grouped GEMM takes {r['grouped_over_loop']:.2f}x the loop's time for one MoE layer's forward "
            f"and backward" + (f", {s['grouped_over_loop']:.2f}x for the training step" if s else "")
            + f"; host reads per layer {r['host_reads']['loop']} (loop) and {r['host_reads']['grouped']} (grouped).")
    return out


# ============================================================================ part 2: the runs
def ep_command(ep: int, shape: dict, runs: dict, output_dir: Path, records: Path) -> tuple[list[str], list[str]]:
    """(the torchrun command of the workers, with the timers' hook; the ``dufu train`` arguments it stands for)."""
    nproc = runs["ep_nproc"]
    argv = [RECIPES["moe"], *model_overrides(shape, "moe"), *RUN_SETTINGS,
            f"train.dist.data_parallel_size={nproc}", f"train.dist.expert_parallel_size={ep}",
            f"train.train_micro_batch_size={shape['ep_micro_batch']}", f"train.train_iter={runs['ep_steps']}",
            f"train.output_dir={output_dir}"]
    hooks = launch.hooks_override(("moe_probe.ExpertTimers", {"out_dir": records}))
    return launch.torchrun_train(nproc, [*argv, hooks]), ["train", *argv]


def run_ep(ep: int, shape: dict, runs: dict, workdir: Path, repeat: int) -> dict:
    run = workdir / f"ep{ep}-r{repeat}"
    records = workdir / f"ep{ep}-r{repeat}-timers"
    cmd, argv = ep_command(ep, shape, runs, run, records)
    env = launch.job_env(threads=None)
    busy0, cpu0, t0 = proc.system_busy_seconds(), proc.children_cpu_seconds(), time.perf_counter()
    job = subprocess.run(cmd, cwd=launch.REPO, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, proc.children_cpu_seconds() - cpu0
    busy1 = proc.system_busy_seconds()
    if job.returncode != 0:
        raise RuntimeError(f"ep {ep}: {' '.join(cmd)} failed (exit {job.returncode}):\n{job.stderr[-4000:]}")
    metrics = launch.read_metrics(run)
    ranks = launch.read_rank_files(records, runs["ep_nproc"])
    if ranks is None:
        raise RuntimeError(f"ep {ep}: a worker wrote no timings to {records}:\n{job.stderr[-4000:]}")
    warm = runs["ep_warmup"]
    step_times = [m["step_time_s"] for m in metrics]
    # per timed step: the mean over ranks of each timer, and each rank's all-to-all share of its own step
    per_step = []
    for s in range(warm, len(ranks[0]["steps"])):
        recs = [rk["steps"][s] for rk in ranks]
        mean = {k: statistics.fmean(r.get(k, 0.0) for r in recs) for k in set().union(*recs)}
        a2a = [sum(r.get(f"a2a_{d}_s", 0.0) for d in ("forward", "backward", "counts")) for r in recs]
        a2a_cpu = [sum(r.get(f"a2a_{d}_cpu_s", 0.0) for d in ("forward", "backward", "counts")) for r in recs]
        shares = [a / r["step_s"] for a, r in zip(a2a, recs)]
        per_step.append({**mean, "a2a_share": statistics.fmean(shares), "a2a_share_max_rank": max(shares),
                         "a2a_share_min_rank": min(shares),
                         "a2a_cpu_share": statistics.fmean(a / r["step_cpu_s"] for a, r in zip(a2a_cpu, recs))})

    def med(key):
        return statistics.median(p.get(key, 0.0) for p in per_step)

    other = proc.other_load(busy0, busy1, cpu, wall)
    shown = [argv[0], argv[1], f"--nproc {runs['ep_nproc']}", *(a for a in argv[2:] if "output_dir" not in a)]
    return {"ep": ep, "repeat": repeat, "command": "python -m dufu " + " ".join(shown),
            "wall_s": wall, "cpu_s": cpu, "other_load": other,
            "step_times_s": step_times, "median_step_s": statistics.median(step_times[warm:]),
            "losses": [m["loss"] for m in metrics], "moe_max_load": [m.get("moe_max_load") for m in metrics],
            "timed_steps": len(per_step),
            "median_rank_step_s": med("step_s"), "median_rank_step_cpu_s": med("step_cpu_s"),
            "a2a_forward_s": med("a2a_forward_s"), "a2a_backward_s": med("a2a_backward_s"),
            "a2a_counts_s": med("a2a_counts_s"), "dispatch_s": med("dispatch_s"), "combine_s": med("combine_s"),
            "a2a_share": med("a2a_share"), "a2a_share_max_rank": med("a2a_share_max_rank"),
            "a2a_share_min_rank": med("a2a_share_min_rank"), "all_reduce_s": med("all_reduce_s"),
            "all_reduce_cpu_s": med("all_reduce_cpu_s"),
            "a2a_cpu_share": med("a2a_cpu_share")}


def compare_ep(shape: dict, runs: dict, workdir: Path) -> dict:
    sizes = list(runs["ep_sizes"])
    done = []
    for r in range(runs["repeats"]):
        for ep in (sizes if r % 2 == 0 else sizes[::-1]):
            log(f"part 2: ep {ep}, repeat {r + 1}/{runs['repeats']} ...")
            done.append(run_ep(ep, shape, runs, workdir, r))
            log(f"  median step {done[-1]['median_step_s']:.3f} s, all-to-all {100 * done[-1]['a2a_share']:.1f}% "
                f"of the step ({done[-1]['wall_s']:.0f} s)")
    keys = ("median_step_s", "median_rank_step_s", "median_rank_step_cpu_s", "a2a_forward_s", "a2a_backward_s",
            "a2a_counts_s", "dispatch_s", "combine_s", "a2a_share", "a2a_share_max_rank", "a2a_share_min_rank",
            "a2a_cpu_share", "all_reduce_s", "all_reduce_cpu_s")
    rows = []
    for ep in sizes:
        mine = [d for d in done if d["ep"] == ep]
        rows.append({"ep": ep, "repeats": len(mine), **{k: statistics.median(d[k] for d in mine) for k in keys},
                     "step_min_s": min(d["median_step_s"] for d in mine),
                     "step_max_s": max(d["median_step_s"] for d in mine),
                     "other_load": statistics.median(d["other_load"] for d in mine)
                     if all(d["other_load"] is not None for d in mine) else None})
    base = rows[0]["median_step_s"]
    for row in rows:
        row["step_ratio_to_ep1"] = row["median_step_s"] / base
        row["a2a_ms"] = 1e3 * row["a2a_share"] * row["median_step_s"]
    same_losses = all(d["losses"] == done[0]["losses"] for d in done)
    max_loss_diff = max(abs(a - b) for d in done for a, b in zip(d["losses"], done[0]["losses"]))
    return {"nproc": runs["ep_nproc"], "micro_batch": shape["ep_micro_batch"], "steps": runs["ep_steps"],
            "warmup": runs["ep_warmup"], "repeats": runs["repeats"], "runs": done, "rows": rows,
            "losses_identical": same_losses, "max_loss_difference": max_loss_diff,
            "command": done[0]["command"].replace(f"expert_parallel_size={done[0]['ep']}", "expert_parallel_size=EP")}



def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, 2 processes (a smoke run)")
    ap.add_argument("--only", choices=("dense", "ep", "grouped"), default=None, help="run one part only")
    ap.add_argument("--steps", type=int, default=None, help="part 1: timed steps per model")
    ap.add_argument("--repeats", type=int, default=None, help="part 2: runs per expert-parallel size")
    ap.add_argument("--threads", type=int, default=1, help="part 1: torch threads (default 1, see the docstring)")
    ap.add_argument("--note", default=None, help="a note on the code measured, kept with the results")
    ap.add_argument("--before", default=None, help="an earlier results JSON of this script: its part 1 beside this "
                    "run's (e.g. measured on the code before a change)")
    ap.add_argument("--results-dir", default=None,
                    help="where results go (default benchmarks/results; --quick: nowhere)")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    shape, runs = SHAPES[mode], dict(RUNS[mode])
    if args.steps is not None:
        runs["steps"] = args.steps
    if args.repeats is not None:
        runs["repeats"] = args.repeats
    results_dir = results_files.results_dir(args.results_dir, args.quick)
    import torch

    torch.set_num_threads(args.threads)
    digests = machine.dufu_digests()
    t0 = time.perf_counter()
    load0 = [round(x, 2) for x in os.getloadavg()]
    date = results_files.today()
    result = {"date": date, "command": shlex.join(["python", "benchmarks/moe.py", *argv]), "quick": args.quick,
              "shape": shape, "load_avg_start": load0, "code": machine.code_state(args.note),
              "machine": machine.describe()}  # peaks with part 1's threads
    with tempfile.TemporaryDirectory(prefix="dufu-moe-") as tmp:
        work = Path(tmp)
        if args.only in (None, "dense"):
            result["dense"] = compare_dense(shape, runs, work)
        if args.only in (None, "ep"):
            result["ep"] = compare_ep(shape, runs, work)
        if args.only in (None, "grouped"):
            result["grouped"] = compare_grouped(shape, runs, work)
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    changed = machine.changed_since(digests)
    if changed:
        result["code_changed_during_run"] = changed
    if args.before and result.get("dense"):
        result["before"] = before_summary(json.loads(Path(args.before).read_text()), args.before)
    result["observations"] = observations(result)
    if result.get("grouped"):
        result["observations"] += grouped_observations(result["grouped"])
    text = report(result)
    if result.get("grouped"):  # part 3's section, before the observations
        section = "\n".join(grouped_report(result["grouped"], shape, result["machine"]))
        head, sep, tail = text.partition("## Observations")
        text = head + section + "\n" + sep + tail if sep else text + "\n" + section
    print(text)
    if results_dir is not None:
        tag = "grouped" if args.only == "grouped" else ""
        stem = results_files.write(results_files.stem(results_dir, "moe", date, tag), result, text)
        if result.get("ep"):
            plot(result["ep"], stem.with_suffix(".png"))
        log(f"wrote {stem}.md, .json{', .png' if result.get('ep') else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())