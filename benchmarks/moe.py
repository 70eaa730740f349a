"""Mixture of experts on the CPU, side by side in one run: a MoE model against a dense model with as many active
parameters per token, and the share of a step the expert-parallel all-to-all takes at each expert-parallel size.

    python benchmarks/moe.py              # both parts (~4 minutes on 2 cores; up to ~8 when the cores are busy)
    python benchmarks/moe.py --quick      # a smoke run (< 1 minute), writes nothing unless --results-dir
    python benchmarks/moe.py --only dense # or --only ep
    python benchmarks/moe.py --before benchmarks/results/moe-DATE-before.json   # + part 1 of an earlier run

**Part 1, MoE vs dense at equal active parameters** (one process, fp32). The MoE model is ``moe_debug`` made
larger so that the matmuls dominate the fixed costs: hidden 256, 4 layers, 4 query / 2 key-value heads, 8 SwiGLU
experts of ``F`` = 384 with top-2 routing in every block (load-balancing loss 0.01), sequence 128. The dense model
is ``llama_debug`` at the same shape with a SwiGLU of ``top_k x F`` = 768, so a token multiplies the same number of
weights in both (the MoE model adds its routers: 8 x 256 per block). Both are dufu ``Trainer``s built in this
process from their recipes with the same overrides: the same byte-level corpus, batch (8 x 128 tokens), seed and
sample order (checked step by step), AdamW, gradient clipping. After 3 warm-up steps each, ``--steps`` timed
``Trainer.train_step`` calls per model are interleaved (A B A B, the first model alternating), and the medians are
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
``dufu.engine.report.StepClock``).
Every worker runs this file in ``--worker`` mode: it imports ``dufu.cli`` and calls its ``main`` as
``python -m dufu`` does, after installing timers that change nothing the run computes:

* ``Trainer.train_step``: wall and process CPU time of each step on each rank;
* ``ExpertDispatch.dispatch`` / ``combine`` (dufu/parallel/expert_parallel.py): the forward of the token
  exchange, the index bookkeeping that orders tokens around it included;
* the token all-to-all itself, in forward and in backward: the module's ``all_to_all_single_autograd`` is
  replaced by an autograd function that issues the same functional collective
  (``_c10d_functional.all_to_all_single`` + ``wait_tensor``, as torch's own backward does) with a timer
  around each direction;
* ``torch.distributed.all_to_all_single``: the exchange of the token counts before each dispatch;
* ``torch.distributed.all_reduce``: the data-parallel gradient average (blocking under ``replicate``, ZeRO off)
  and the loss, gradient-norm and target-count reductions, for comparison.

The all-to-all share of a step is (token all-to-alls forward + backward + count exchanges) / step, per rank, the
mean over ranks, median over steps and repeats. A collective's time includes waiting for the slowest peer of its
group to arrive: the share says how long ranks stand in the all-to-all, transfer and waiting together. The
CPU-time share (process CPU time inside the all-to-all over the step's) is the compute the exchange itself
costs. With 4 processes on 2 cores the machine is oversubscribed, so only ratios mean something.

Results: ``benchmarks/results/moe-<date>.md``, ``.json`` and ``.png`` (step time vs EP, all-to-all vs the rest),
with the dufu commit and the files of dufu/ changed from it (``--note`` adds a description of the code), and a
warning when a file of dufu/ changed while the benchmark ran. ``--before FILE`` puts part 1 of an earlier results
file (say, of the code before a change, run from a copy of the tree) beside this run's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # dufu, when run as `python benchmarks/moe.py` or as a torchrun worker

import _machine  # noqa: E402  (the benchmarks' shared machine description, benchmarks/_machine.py)

RECORDS_ENV = "DUFU_BENCH_MOE_DIR"  # a worker writes its per-step timings there (rank<R>.json)

# The model (part 1 and part 2) and the runs. ``expert_ffn`` is each expert's F; the dense model's SwiGLU is
# top_k x F. ``ep_micro_batch`` is part 2's micro-batch per rank.
SHAPES = {
    "full": dict(hidden_size=256, num_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                 top_k=2, expert_ffn=384, seq=128, batch=8, ep_micro_batch=4),
    "quick": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  top_k=2, expert_ffn=64, seq=32, batch=4, ep_micro_batch=2),
}
RUNS = {
    "full": dict(warmup=3, steps=30, ep_nproc=4, ep_sizes=(1, 2, 4), ep_steps=16, ep_warmup=4, repeats=3),
    "quick": dict(warmup=1, steps=2, ep_nproc=2, ep_sizes=(1, 2), ep_steps=4, ep_warmup=1, repeats=1),
}
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
    """A dufu Trainer of one recipe, stepped by hand; records wall time, CPU time and the machine's load."""

    def __init__(self, kind: str, shape: dict, workdir: Path):
        from dufu.config import LazyConfig, resolve_config_path
        from dufu.engine.trainer import Trainer

        self.kind = kind
        self.overrides = model_overrides(shape, kind) + RUN_SETTINGS + [
            f"train.train_micro_batch_size={shape['batch']}", f"train.global_batch_size={shape['batch']}",
            f"train.output_dir={workdir / kind}"]
        cfg = LazyConfig.load(resolve_config_path(RECIPES[kind]))
        LazyConfig.apply_overrides(cfg, self.overrides)
        self.trainer = Trainer(cfg, log=lambda *a, **k: None)
        self.wall, self.cpu, self.other_load, self.losses, self.indices = [], [], [], [], []

    def describe(self) -> dict:
        from dufu.engine.flops import count_matmul_params

        t = self.trainer
        inactive = t.moe.inactive_parameters if t.moe else 0
        return {"recipe": RECIPES[self.kind], "model": t.model_name, "parameters": t.num_parameters,
                "active_parameters": int(round(t.num_parameters - inactive)),
                "matmul_parameters_active": count_matmul_params(t.model),
                "matmul_parameters_total": count_matmul_params(t.model, active=False),
                "flops_per_token": t.flops_per_token, "tokens_per_step": t.tokens_per_step,
                "peak_flops": t.peak_flops, "peak_source": t.peak_source, "overrides": self.overrides}

    def step(self, timed: bool = True) -> None:
        micro_batches = self.trainer.sampler.next_step()
        busy0, cpu0, wall0 = _machine.system_busy_seconds(), time.process_time(), time.perf_counter()
        loss, _ = self.trainer.train_step(micro_batches)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        busy1 = _machine.system_busy_seconds()
        self.indices.append(micro_batches)
        self.losses.append(loss)
        if timed:
            self.wall.append(wall)
            self.cpu.append(cpu)
            if busy0 is not None and busy1 is not None:
                self.other_load.append(max(0.0, (busy1 - busy0 - cpu) / (wall * (os.cpu_count() or 1))))


# Ops by kind, for the profiled step (aten names; everything else is "other ops").
OP_KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::dot"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "routing": ("aten::topk", "aten::sort", "aten::argsort", "aten::bincount", "aten::_softmax",
                "aten::_softmax_backward_data", "aten::one_hot", "aten::cumsum", "aten::logsumexp",
                "aten::_local_scalar_dense"),
    "token permutation": ("aten::index", "aten::index_select", "aten::index_add_", "aten::index_put_",
                          "aten::_index_put_impl_", "aten::index_select_backward", "aten::cat",
                          "aten::split_with_sizes", "aten::repeat_interleave", "aten::gather", "aten::scatter_add_",
                          "aten::index_add", "aten::scatter", "aten::scatter_"),
    # zeros for gradients: a select's backward (GroupedExperts' ``gate_up[e]``) fills a zero tensor of the whole
    # weight and writes its slice into it; those are then added up (add_)
    "zero-fill, in-place add": ("aten::fill_", "aten::zero_", "aten::add_"),
    "optimizer": ("aten::_fused_adamw_", "aten::_foreach_norm", "aten::_foreach_mul_", "aten::_foreach_add_",
                  "aten::_foreach_div_", "aten::_foreach_lerp_", "aten::_foreach_sqrt", "aten::_foreach_addcdiv_",
                  "aten::_foreach_addcmul_", "aten::_foreach_mul"),
}
PROFILE_KINDS = (*OP_KINDS, "other ops", "between ops (Python, dispatch)")
PROFILE_ROUNDS = 6


def op_kind(name: str) -> str:
    for kind, names in OP_KINDS.items():
        if name in names:
            return kind
    return "other ops"


def profile_step(contender: _Contender) -> dict:
    """One training step under torch.profiler: the self CPU time of its ops by kind (ms) and their calls, the
    step's wall time. What the ops' self times leave of the wall time is the time between ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        contender.step(timed=False)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    ms, calls = dict.fromkeys(PROFILE_KINDS, 0.0), dict.fromkeys(PROFILE_KINDS, 0)
    fill_calls = select_backward_calls = 0
    for ev in prof.key_averages():
        select_backward_calls += ev.count if ev.key == "SelectBackward0" else 0
        if not ev.key.startswith("aten::"):
            continue  # autograd nodes and Python-level regions: their ops are counted themselves
        kind = op_kind(ev.key)
        ms[kind] += ev.self_cpu_time_total / 1e3
        calls[kind] += ev.count
        fill_calls += ev.count if ev.key == "aten::fill_" else 0
    ms["between ops (Python, dispatch)"] = max(0.0, wall_ms - sum(ms.values()))
    return {"ms": ms, "calls": calls, "wall_ms": wall_ms, "matmul_calls": calls["matmul"], "fill_calls": fill_calls,
            "select_backward_calls": select_backward_calls, "aten_calls": sum(calls.values())}


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
    best = max(contenders.values(), key=lambda c: c.trainer.peak_flops)  # the best reading: one basis for both
    peak, peak_source = best.trainer.peak_flops, best.trainer.peak_source
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


# ============================================================================ part 2, worker: timers in dufu train
class _Clock:
    """Wall and process CPU seconds per named region, summed over the current step."""

    def __init__(self):
        self.acc: dict = {}

    def reset(self) -> None:
        self.acc = {}

    @contextlib.contextmanager
    def timing(self, name: str):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.acc[f"{name}_s"] = self.acc.get(f"{name}_s", 0.0) + time.perf_counter() - wall0
            self.acc[f"{name}_cpu_s"] = self.acc.get(f"{name}_cpu_s", 0.0) + time.process_time() - cpu0


def install_timers(out_dir: Path) -> None:
    """Wrap the step, the dispatch/combine and the all-to-alls with timers (see the module docstring)."""
    import torch
    import torch.distributed as dist

    import dufu.parallel.expert_parallel as ep_mod
    from dufu.engine.trainer import Trainer

    clock, records = _Clock(), []

    def exchange(x, output_split_sizes, input_split_sizes, group):
        # what all_to_all_single_autograd issues (and its backward, with the splits swapped), waited for at once
        y = torch.ops._c10d_functional.all_to_all_single(x, output_split_sizes, input_split_sizes, group.group_name)
        return torch.ops._c10d_functional.wait_tensor(y)

    class TimedAllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, output_split_sizes, input_split_sizes, group):
            ctx.splits, ctx.group = (list(output_split_sizes), list(input_split_sizes)), group
            with clock.timing("a2a_forward"):
                return exchange(x, output_split_sizes, input_split_sizes, group)

        @staticmethod
        def backward(ctx, grad):
            out_splits, in_splits = ctx.splits
            with clock.timing("a2a_backward"):
                return exchange(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None

    def all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group, tag=""):
        return TimedAllToAll.apply(x, output_split_sizes, input_split_sizes, group)

    ep_mod.all_to_all_single_autograd = all_to_all_single_autograd

    counts_exchange = dist.all_to_all_single

    def all_to_all_single(*args, **kwargs):
        with clock.timing("a2a_counts"):
            return counts_exchange(*args, **kwargs)

    dist.all_to_all_single = all_to_all_single

    all_reduce = dist.all_reduce  # the data-parallel gradient average (replicate: blocking), loss, norm, counts

    def timed_all_reduce(*args, **kwargs):
        with clock.timing("all_reduce"):
            return all_reduce(*args, **kwargs)

    dist.all_reduce = timed_all_reduce

    def timed(name):
        original = getattr(ep_mod.ExpertDispatch, name)

        def method(self, module, tensors, mesh):  # distribute_module checks for exactly these 3 arguments
            with clock.timing(name):
                return original(self, module, tensors, mesh)

        return method

    for name in ("dispatch", "combine"):  # bound by apply_expert_parallel, which runs after this
        setattr(ep_mod.ExpertDispatch, name, timed(name))

    train_step, train = Trainer.train_step, Trainer.train

    def timed_train_step(self, micro_batches):
        clock.reset()
        with clock.timing("step"):
            out = train_step(self, micro_batches)
        records.append(dict(clock.acc))
        return out

    def timed_train(self):
        result = train(self)  # before finish_distributed, which leaves through os._exit
        out_dir.mkdir(parents=True, exist_ok=True)
        ep = self.dims.expert_parallel_size if self.dims.ep_enabled else 1
        (out_dir / f"rank{self.rank}.json").write_text(json.dumps({"rank": self.rank, "ep": ep, "steps": records}))
        return result

    Trainer.train_step, Trainer.train = timed_train_step, timed_train


def worker(argv: list[str]) -> int:
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = str(REPO)  # as under `python -m dufu`: dufu first, benchmarks/ not importable
    install_timers(Path(os.environ[RECORDS_ENV]))
    from dufu.cli import main as dufu_main

    return dufu_main(argv)


# ============================================================================ part 2: the runs
def ep_command(ep: int, shape: dict, runs: dict, output_dir: Path) -> tuple[list[str], list[str]]:
    """(the torchrun command that runs this file's workers, the ``dufu train`` arguments it stands for)."""
    from dufu.parallel.launch import torchrun_command

    nproc = runs["ep_nproc"]
    argv = [RECIPES["moe"], *model_overrides(shape, "moe"), *RUN_SETTINGS,
            f"train.dist.data_parallel_size={nproc}", f"train.dist.expert_parallel_size={ep}",
            f"train.train_micro_batch_size={shape['ep_micro_batch']}", f"train.train_iter={runs['ep_steps']}",
            f"train.output_dir={output_dir}"]
    cmd = torchrun_command(nproc, argv)
    i = cmd.index("-m", 3)  # `-m dufu train ...` -> this file in worker mode
    return cmd[:i] + [str(Path(__file__).resolve()), "--worker", "train"] + cmd[i + 3:], ["train", *argv]


def read_metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_ep(ep: int, shape: dict, runs: dict, workdir: Path, repeat: int) -> dict:
    run = workdir / f"ep{ep}-r{repeat}"
    records = workdir / f"ep{ep}-r{repeat}-timers"
    cmd, argv = ep_command(ep, shape, runs, run)
    env = {**os.environ, RECORDS_ENV: str(records), "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    busy0, cpu0, t0 = _machine.system_busy_seconds(), _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    busy1 = _machine.system_busy_seconds()
    if proc.returncode != 0:
        raise RuntimeError(f"ep {ep}: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    metrics = read_metrics(run)
    ranks = [json.loads((records / f"rank{r}.json").read_text()) for r in range(runs["ep_nproc"])]
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

    other = None
    if busy0 is not None and busy1 is not None:
        other = max(0.0, (busy1 - busy0 - cpu) / (wall * (os.cpu_count() or 1)))
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


# ============================================================================ the code measured
def _file_digests() -> dict:
    return {f.relative_to(REPO).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((REPO / "dufu").rglob("*.py"))}


def code_state(note: str | None) -> dict:
    """The dufu code measured: the commit, the files of dufu/ that differ from it, and ``note`` (``--note``)."""
    def git(*a) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "dufu").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD") or None, "changed": changed, "note": note}


def describe_code(code: dict) -> str:
    moe_files = [f for f in code["changed"] if "moe" in f or "expert" in f]
    if code["commit"] is None and code.get("note"):
        return code["note"]  # a copy of the tree (``--before``): the note says what it holds
    text = f"dufu {code['commit'] or '(not a git checkout)'}"
    if code["changed"]:
        text += (f" + uncommitted changes in {len(code['changed'])} files of dufu/"
                 + (f", among them {', '.join(moe_files)}" if moe_files else ", none of them MoE code"))
    return text + (f" ({code['note']})" if code.get("note") else "")


def before_summary(before: dict, path: str) -> dict:
    """Part 1 of an earlier results file of this script, for ``--before``."""
    d = before["dense"]
    mo, de = d["rows"]["moe"], d["rows"]["dense"]
    return {"path": path, "date": before["date"], "code": before.get("code"),
            "ratio": d["step_time_ratio_moe_over_dense"], "cpu_ratio": mo["median_cpu_s"] / de["median_cpu_s"],
            "profile_moe_ms": mo["profile"]["wall_ms"], "profile_dense_ms": de["profile"]["wall_ms"],
            "zero_fill_ms": mo["profile"]["ms"]["zero-fill, in-place add"]
            - de["profile"]["ms"]["zero-fill, in-place add"],
            "fill_calls": mo["profile"]["fill_calls"], "selects": mo["profile"].get("select_backward_calls")}


# ============================================================================ report
def _f(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


# Why a kind of op costs the MoE model more than the dense one (part 1's profile), shown beside its difference.
WHY = {
    "zero-fill, in-place add": "zero-filled buffers and in-place additions ({fill} fill_ calls vs {dense_fill}: "
    "the output `index_add_` fills, gradients accumulated over the k copies of a token)",
    # when the profile shows a select's backward per expert and grouped weight
    "zero-fill, in-place add (selects)": "zero-filling and adding up gradients ({fill} fill_ calls vs {dense_fill}; "
    "{selects} SelectBackward0 nodes): GroupedExperts takes each expert's weights as a slice of the grouped tensor "
    "(`gate_up[e]`, `down[e]`), and the backward of every such select allocates a zero tensor of the whole (E, 2F, "
    "H) or (E, H, F) weight to write its slice into, after which autograd adds the E of them up: per layer and step, "
    "E full-size zero-fills and additions for each grouped weight, E^2 times the expert slices' size (`unbind(0)` "
    "gives each expert's gradient its own slice of one tensor)",
    "matmul": "matmuls ({mm} calls vs {dense_mm}): the same FLOPs per token cut into two products per expert in "
    "forward and four in backward, each on about N x k / E = {rows:,} token rows instead of N = {tokens:,}, which "
    "run less efficiently, plus the routers",
    "routing": "routing: the router's softmax and top-k, the argsort that groups the assignments by expert, "
    "bincount, the `.tolist()` of the counts that the per-expert split needs, the load-balancing loss's one-hot",
    "token permutation": "moving token copies: gathering them in expert order (`x[token]`), splitting and "
    "concatenating per expert, `index_add_` back into token order, and the backward of each (the gather's is an "
    "accumulating index_put)",
    "optimizer": "the optimizer: AdamW and the gradient norm touch every expert's weights, {total:,} parameters "
    "against the dense model's {dense_total:,}",
    "other ops": "other ops (the SwiGLU and the router weighting on k copies of every token, views, copies)",
    "between ops (Python, dispatch)": "time between ops: Python and autograd for {aten:,} aten calls vs "
    "{dense_aten:,}, most of them from the loop over experts",
    "attention": "attention (the same work in both models: a measure of the profiles' noise)",
}


def observations(result: dict) -> list[str]:
    """What the numbers say, in sentences built from them."""
    out, selects_seen = [], False
    dense = result.get("dense")
    if dense:
        s, mo, de = dense["shape"], dense["rows"]["moe"], dense["rows"]["dense"]
        pm, pd = mo["profile"], de["profile"]
        tokens = s["batch"] * s["seq"]
        selects = pm.get("select_backward_calls", 0) - pd.get("select_backward_calls", 0)
        per_expert_selects = selects >= 2 * s["num_layers"] * s["num_experts"]  # one per expert and grouped weight
        selects_seen = per_expert_selects
        fill = dict(fill=pm["fill_calls"], dense_fill=pd["fill_calls"], selects=selects, mm=pm["matmul_calls"],
                    dense_mm=pd["matmul_calls"], rows=tokens * s["top_k"] // s["num_experts"], tokens=tokens,
                    total=mo["parameters"], dense_total=de["parameters"], aten=pm["aten_calls"],
                    dense_aten=pd["aten_calls"])
        diff = sorted(((pm["ms"][k] - pd["ms"][k], k) for k in PROFILE_KINDS), reverse=True)
        ratio = dense["step_time_ratio_moe_over_dense"]
        gap = 1e3 * (mo["median_step_s"] - de["median_step_s"])
        out.append(
            f"Equal active parameters do not make an equal step on a CPU: the MoE step takes {ratio:.2f}x the dense "
            f"one ({gap:+,.0f} ms at the medians; CPU time per step {mo['median_cpu_s'] / de['median_cpu_s']:.2f}x), "
            f"although a token goes through as many weights in both (the MFU basis, "
            f"{mo['flops_per_token'] / 1e6:.1f} vs {de['flops_per_token'] / 1e6:.1f} MFLOP/token, is the same up to "
            f"the routers, so MFU falls by the same ratio: {100 * mo['mfu']:.2f}% vs {100 * de['mfu']:.2f}%).")
        why = {**WHY, **({"zero-fill, in-place add": WHY["zero-fill, in-place add (selects)"]}
                         if per_expert_selects else {})}
        parts = [f"{d:+,.1f} ms {why[k].format(**fill)}" for d, k in diff if d >= 0.5]
        out.append(f"Where the difference goes, by the profiled steps (MoE {pm['wall_ms']:,.0f} ms, dense "
                   f"{pd['wall_ms']:,.0f} ms; the profiler adds a little to every op, and the MoE step has more ops): "
                   + "; ".join(parts) + ".")
        less = [f"{d:+,.1f} ms {k}" for d, k in diff if d <= -0.5]
        if less:
            out.append("Kinds where the MoE step spent less (compare the profiles' noise, attention): "
                       + ", ".join(less) + ".")
    ep = result.get("ep")
    if ep and len(ep["rows"]) > 1:
        rows, base = ep["rows"], ep["rows"][0]
        split = [r for r in rows if r["ep"] > 1]
        out.append(
            f"EP 1 exchanges no tokens: every rank holds all {result['shape']['num_experts']} experts and their "
            "gradients are averaged with the rest of the model. With expert parallelism the ranks stand in the "
            "all-to-alls for " + ", ".join(f"{100 * r['a2a_share']:.0f}% (EP {r['ep']})" for r in split)
            + " of their step, forward and backward together (busiest rank "
            + ", ".join(f"{100 * r['a2a_share_max_rank']:.0f}%" for r in split) + "; least busy "
            + ", ".join(f"{100 * r['a2a_share_min_rank']:.0f}%" for r in split) + ").")
        out.append(
            "Most of that time is waiting for peers, not moving data: the process CPU time spent inside the "
            "all-to-alls (gloo's threads included) is " + ", ".join(f"{100 * r['a2a_cpu_share']:.0f}%"
                                                                    for r in split)
            + " of the step's CPU time, and the exchange of the token counts, "
            f"{result['shape']['num_experts']} integers before each dispatch, takes "
            + ", ".join(f"{1e3 * r['a2a_counts_s']:.0f} ms" for r in split)
            + " per step: the first collective of each MoE layer absorbs how far the ranks have drifted apart."
            + (f" With {ep['nproc']} single-thread processes on {result['machine']['logical_cpus']} cores every rank "
               "is off the CPU part of the time, so at each all-to-all some rank waits for a peer that is not "
               "running; on dedicated cores the share would come closer to the CPU-time share."
               if ep["nproc"] > (result["machine"]["logical_cpus"] or 1) else ""))
        sh = result["shape"]
        experts = sh["num_layers"] * sh["num_experts"] * 3 * sh["expert_ffn"] * sh["hidden_size"]
        out.append(
            "Step time relative to EP 1 (range over repeats): " + ", ".join(
                f"EP {r['ep']} {r['step_ratio_to_ep1']:.2f}x ({r['step_min_s'] / base['median_step_s']:.2f}-"
                f"{r['step_max_s'] / base['median_step_s']:.2f}x)" for r in split)
            + f"; CPU time per rank and step {1e3 * base['median_rank_step_cpu_s']:,.0f} ms at EP 1, "
            + ", ".join(f"{1e3 * r['median_rank_step_cpu_s']:,.0f} ms at EP {r['ep']}" for r in split)
            + ". A rank computes the same number of token copies on average at every EP (its E / EP experts "
            "serve the tokens of all EP ranks of its group); against the exchange, EP saves the work that grows "
            "with the experts a rank holds: the loop over experts (E / EP iterations of larger matmuls), "
            + ("the zero-filled full-size gradients of the grouped weights (part 1), " if selects_seen else "")
            + "AdamW and the gradient norm over E / EP experts instead of E, and the data-parallel average of the "
            f"experts' gradients: at EP 1 all {experts:,} expert parameters ({4 * experts / 2**20:,.0f} MiB in fp32) "
            f"are all-reduced over the {ep['nproc']} ranks every step, at EP e a rank's 1 / e of them over "
            f"{ep['nproc']} / e ranks: time in all_reduce per step " + ", ".join(
                f"{1e3 * r['all_reduce_s']:,.0f} ms at EP {r['ep']}" for r in rows) + ".")
        same = "identical" if ep["losses_identical"] else f"within {ep['max_loss_difference']:.1e}"
        out.append(f"The losses of every run agree ({same}): the layouts train the same model on the same samples.")
    return out


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Mixture of experts on the CPU - {result['date']}", "",
             f"`{result['command']}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; {m['platform']}. Code: {describe_code(result['code'])}. The run "
             f"took {result['wall_s']:.0f} s; load average {result['load_avg_start']} at the start, "
             f"{result['load_avg_end']} at the end.", ""]
    if result.get("code_changed_during_run"):
        lines += [f"**dufu/ changed while this ran ({', '.join(result['code_changed_during_run'])}): processes "
                  "started before and after the change ran different code.**", ""]
    dense = result.get("dense")
    if dense:
        s, r = dense["shape"], dense["rows"]
        mo, de = r["moe"], r["dense"]
        lines += [
            "## MoE vs dense at equal active parameters (one process, fp32)", "",
            f"Shape: hidden {s['hidden_size']}, {s['num_layers']} layers, {s['num_attention_heads']} query / "
            f"{s['num_key_value_heads']} key-value heads, sequence {s['seq']}, byte vocabulary (384), batch "
            f"{s['batch']} x {s['seq']} = {s['batch'] * s['seq']:,} tokens per step, AdamW, gradient clipping 1.0. "
            f"MoE (`{mo['recipe']}` resized): {s['num_experts']} SwiGLU experts of {s['expert_ffn']} in every block, "
            f"top-{s['top_k']}. Dense (`{de['recipe']}` resized): SwiGLU of {s['top_k']} x {s['expert_ffn']} = "
            f"{s['top_k'] * s['expert_ffn']}. Torch threads: {dense['threads']}; {dense['warmup']} warm-up steps "
            f"each, then {dense['steps']} timed `Trainer.train_step` calls each, interleaved. The same samples in "
            f"the same order: {'yes' if dense['same_samples'] else '**no**'}.", "",
            "| model | parameters | active per token | matmul parameters per token (N) | MFLOP/token (6N + 12LHT) "
            "| median step (ms) | min-max (ms) | CPU ms/step | other load | tokens/s | MFU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for kind, label in (("moe", "MoE"), ("dense", "dense")):
            x = r[kind]
            lines.append(
                f"| {label} | {x['parameters']:,} | {x['active_parameters']:,} | {x['matmul_parameters_active']:,} "
                f"| {x['flops_per_token'] / 1e6:.1f} | {_f(1e3 * x['median_step_s'], 1)} | "
                f"{_f(1e3 * x['min_step_s'], 1)}-{_f(1e3 * x['max_step_s'], 1)} | {_f(1e3 * x['median_cpu_s'], 1)} | "
                f"{_f(100 * x['median_other_load']) + '%' if x['median_other_load'] is not None else '-'} | "
                f"{_f(x['tokens_per_s'])} | {100 * x['mfu']:.2f}% |")
        lines += ["", f"**MoE / dense step time: {dense['step_time_ratio_moe_over_dense']:.2f}x** "
                  f"(CPU time per step {mo['median_cpu_s'] / de['median_cpu_s']:.2f}x, fastest steps "
                  f"{mo['min_step_s'] / de['min_step_s']:.2f}x; tokens/s {mo['tokens_per_s'] / de['tokens_per_s']:.2f}x"
                  f"). MFU basis: {dense['peak_source']}. The MoE model holds "
                  f"{mo['parameters'] / de['parameters']:.2f}x the dense model's parameters "
                  f"({mo['matmul_parameters_total']:,} in matmuls vs {de['matmul_parameters_total']:,}) and uses "
                  f"{mo['active_parameters'] / de['active_parameters']:.4f}x its parameters per token (the routers).",
                  "", f"The shortest of {PROFILE_ROUNDS - 1} steps of each under `torch.profiler` (after one to "
                  "start it), ms by kind of op (self CPU time; between ops = the profiled step's wall time minus its "
                  "ops' time: Python, autograd and dispatch):", "",
                  "| kind | MoE (ms) | dense (ms) | MoE - dense (ms) |", "|---|---:|---:|---:|"]
        pm, pd = mo["profile"], de["profile"]
        for kind in PROFILE_KINDS:
            lines.append(f"| {kind} | {pm['ms'][kind]:,.1f} | {pd['ms'][kind]:,.1f} | "
                         f"{pm['ms'][kind] - pd['ms'][kind]:+,.1f} |")
        lines += [f"| **profiled step (wall)** | {pm['wall_ms']:,.1f} | {pd['wall_ms']:,.1f} | "
                  f"{pm['wall_ms'] - pd['wall_ms']:+,.1f} |",
                  f"| matmul calls per step | {pm['matmul_calls']} | {pd['matmul_calls']} | "
                  f"{pm['matmul_calls'] - pd['matmul_calls']:+} |",
                  f"| fill_ calls per step | {pm['fill_calls']} | {pd['fill_calls']} | "
                  f"{pm['fill_calls'] - pd['fill_calls']:+} |",
                  f"| aten calls per step | {pm['aten_calls']:,} | {pd['aten_calls']:,} | "
                  f"{pm['aten_calls'] - pd['aten_calls']:+,} |", ""]
        b = result.get("before")
        if b:
            now = before_summary(result, "")
            lines += [f"Against `{Path(b['path']).name}` (run {b['date']}, code: "
                      f"{describe_code(b['code']) if b.get('code') else 'not recorded'}), part 1 only; each run "
                      "interleaves its two models, so their ratios compare across runs:", "",
                      "| | before | this run |", "|---|---:|---:|",
                      f"| MoE / dense step time (medians) | {b['ratio']:.2f}x | {now['ratio']:.2f}x |",
                      f"| MoE / dense CPU time per step | {b['cpu_ratio']:.2f}x | {now['cpu_ratio']:.2f}x |",
                      f"| profiled step MoE - dense (ms) | {b['profile_moe_ms'] - b['profile_dense_ms']:+,.1f} | "
                      f"{now['profile_moe_ms'] - now['profile_dense_ms']:+,.1f} |",
                      f"| zero-fill, in-place add: MoE - dense (ms) | {b['zero_fill_ms']:+,.1f} | "
                      f"{now['zero_fill_ms']:+,.1f} |",
                      f"| MoE fill_ calls per step | {b['fill_calls']} | {now['fill_calls']} |",
                      f"| MoE SelectBackward0 nodes per step | {_f(b['selects'])} | {_f(now['selects'])} |", ""]
    ep = result.get("ep")
    if ep:
        lines += [
            f"## All-to-all share vs expert-parallel size ({ep['nproc']} processes, gloo)", "",
            f"`{ep['command']}` for EP = {', '.join(str(r['ep']) for r in ep['rows'])}; micro-batch "
            f"{ep['micro_batch']} per rank ({ep['nproc'] * ep['micro_batch']} x {result['shape']['seq']} tokens per "
            f"step), {ep['steps']} steps, the first {ep['warmup']} not counted, runs interleaved, {ep['repeats']} "
            f"repeat(s) each; every process runs one thread. **{ep['nproc']} processes on "
            f"{result['machine']['logical_cpus']} cores: the machine is oversubscribed, so read the ratios, not "
            "the absolute times.**", "",
            "| EP | step (ms) | vs EP 1 | all-to-all share of the step | busiest / least busy rank | all-to-all (ms) "
            "| token a2a fwd / bwd (ms) | count exchange (ms) | dispatch + combine fwd (ms) | CPU ms per rank-step | "
            "all-to-all CPU share | all_reduce (ms) | other load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in ep["rows"]:
            lines.append(
                f"| {row['ep']} | {_f(1e3 * row['median_step_s'])} ({_f(1e3 * row['step_min_s'])}-"
                f"{_f(1e3 * row['step_max_s'])}) | {row['step_ratio_to_ep1']:.2f}x | {100 * row['a2a_share']:.1f}% | "
                f"{100 * row['a2a_share_max_rank']:.1f}% / {100 * row['a2a_share_min_rank']:.1f}% | "
                f"{_f(row['a2a_ms'])} | "
                f"{_f(1e3 * row['a2a_forward_s'], 1)} / {_f(1e3 * row['a2a_backward_s'], 1)} | "
                f"{_f(1e3 * row['a2a_counts_s'], 1)} | {_f(1e3 * (row['dispatch_s'] + row['combine_s']), 1)} | "
                f"{_f(1e3 * row['median_rank_step_cpu_s'])} | "
                f"{100 * row['a2a_cpu_share']:.1f}% | {_f(1e3 * row['all_reduce_s'])} | "
                f"{_f(100 * row['other_load']) + '%' if row['other_load'] is not None else '-'} |")
        losses = ("identical" if ep["losses_identical"]
                  else f"not identical, largest difference {ep['max_loss_difference']:.2e}")
        lines += ["", "step = median `step_time_s` of `metrics.jsonl` (the slowest rank's step; in parentheses the "
                  "range over repeats); all-to-all share = (token all-to-alls in forward and backward + the "
                  "token-count exchanges) / the rank's own `train_step` time, mean over ranks (busiest / least busy "
                  "rank: the largest / smallest), median over steps and repeats; all-to-all (ms) = share x step; the "
                  "a2a, dispatch and CPU columns are the mean rank's per step (dispatch + combine = the forward of "
                  "`ExpertDispatch`, bookkeeping included); CPU share = process CPU time inside the all-to-alls over "
                  "the step's; all_reduce = time in `torch.distributed.all_reduce` (the data-parallel gradient "
                  "average, blocking under `replicate`, and the loss, norm and target-count reductions; mean rank); "
                  "other load = the share of the machine's CPU time other processes used during the run. Losses of "
                  f"all runs: {losses}.", ""]
    if result.get("observations"):
        lines += ["## Observations", "", *[f"* {o}" for o in result["observations"]], ""]
    return "\n".join(lines)


def plot(ep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ep["rows"]
    labels = [f"ep {r['ep']}" for r in rows]
    a2a = [r["a2a_ms"] for r in rows]
    rest = [1e3 * r["median_step_s"] - a for r, a in zip(rows, a2a)]
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ax.bar(labels, rest, color="tab:blue", label="rest of the step")
    ax.bar(labels, a2a, bottom=rest, color="tab:orange", label="all-to-all (forward + backward + counts)")
    for i, r in enumerate(rows):
        ax.text(i, 1e3 * r["median_step_s"], f"{100 * r['a2a_share']:.0f}%", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("median step time (ms)")
    ax.set_ylim(0, 1.35e3 * max(r["median_step_s"] for r in rows))
    ax.set_title(f"MoE step time vs expert-parallel size\n(dp {ep['nproc']}, gloo, {ep['nproc']} processes on "
                 f"{os.cpu_count()} cores: ratios only)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, 2 processes (a smoke run)")
    ap.add_argument("--only", choices=("dense", "ep"), default=None, help="run one part only")
    ap.add_argument("--steps", type=int, default=None, help="part 1: timed steps per model")
    ap.add_argument("--repeats", type=int, default=None, help="part 2: runs per expert-parallel size")
    ap.add_argument("--threads", type=int, default=1, help="part 1: torch threads (default 1, see the docstring)")
    ap.add_argument("--note", default=None, help="a note on the code measured, kept with the results")
    ap.add_argument("--before", default=None, help="an earlier results JSON of this script: its part 1 beside this "
                    "run's (e.g. measured on the code before a change)")
    ap.add_argument("--results-dir", default=None, help=f"where results go (default {RESULTS}; --quick: nowhere)")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    shape, runs = SHAPES[mode], dict(RUNS[mode])
    if args.steps is not None:
        runs["steps"] = args.steps
    if args.repeats is not None:
        runs["repeats"] = args.repeats
    results_dir = Path(args.results_dir) if args.results_dir else (None if args.quick else RESULTS)
    import torch

    torch.set_num_threads(args.threads)
    digests = _file_digests()
    t0 = time.perf_counter()
    load0 = [round(x, 2) for x in os.getloadavg()]
    date = _dt.date.today().isoformat()
    result = {"date": date, "command": shlex.join(["python", "benchmarks/moe.py", *argv]), "quick": args.quick,
              "shape": shape, "load_avg_start": load0, "code": code_state(args.note)}
    with tempfile.TemporaryDirectory(prefix="dufu-moe-") as tmp:
        work = Path(tmp)
        if args.only in (None, "dense"):
            result["dense"] = compare_dense(shape, runs, work)
        if args.only in (None, "ep"):
            result["ep"] = compare_ep(shape, runs, work)
    result["machine"] = _machine.machine_info(torch_threads=torch.get_num_threads())
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    now = _file_digests()
    changed = sorted(f for f in set(digests) | set(now) if digests.get(f) != now.get(f))
    if changed:
        result["code_changed_during_run"] = changed
    if args.before and result.get("dense"):
        result["before"] = before_summary(json.loads(Path(args.before).read_text()), args.before)
    result["observations"] = observations(result)
    text = report(result)
    print(text)
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        stem = results_dir / f"moe-{date}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        stem.with_suffix(".md").write_text(text + "\n")
        if result.get("ep"):
            plot(result["ep"], stem.with_suffix(".png"))
        log(f"wrote {stem}.md, .json{', .png' if result.get('ep') else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
