"""Mixture of experts on the CPU, side by side in one run: a MoE model against a dense model with as many active
parameters per token, and the share of a step the expert-parallel all-to-all takes at each expert-parallel size.

    python benchmarks/moe.py              # both parts (~8 minutes on 2 cores)
    python benchmarks/moe.py --quick      # a smoke run (< 1 minute), writes nothing unless --results-dir
    python benchmarks/moe.py --only dense # or --only ep

**Part 1, MoE vs dense at equal active parameters** (one process, fp32). The MoE model is ``moe_debug`` made
larger so that the matmuls dominate the fixed costs: hidden 256, 4 layers, 4 query / 2 key-value heads, 8 SwiGLU
experts of ``F`` = 384 with top-2 routing in every block (load-balancing loss 0.01), sequence 128. The dense model
is ``llama_debug`` at the same shape with a SwiGLU of ``top_k x F`` = 768, so a token multiplies the same number of
weights in both (the MoE model adds its routers: 8 x 256 per block). Both are dufu ``Trainer``s built in this
process from their recipes with the same overrides: the same byte-level corpus, batch (8 x 128 tokens), seed and
sample order (checked step by step), AdamW, gradient clipping. After ``--warmup`` steps each, ``--steps`` timed
``Trainer.train_step`` calls per model are interleaved (A B A B, the first model alternating), and the medians are
reported with the machine's load meanwhile. MFU is the start-up summary's: the trainer's model FLOPs per token
(6N + 12*L*H*T, N counting top_k / E of the experts) times tokens/s over its measured fp32 matmul peak. One more
step of each runs under ``torch.profiler`` to split the step by kind of op (matmul, attention, routing, token
permutation, optimizer, other ops, and the time between ops: Python and dispatch).

**Part 2, the all-to-all vs the expert-parallel size** (4 processes, gloo). The same MoE model is trained by
``dufu train moe_debug --nproc 4 train.dist.data_parallel_size=4 train.dist.expert_parallel_size=EP`` for EP = 1,
2, 4, everything else equal (micro-batch 4 per rank, so 16 x 128 tokens per step; ``train.log_period=1``); the
runs are interleaved (1 2 4, 4 2 1, ...) ``--repeats`` times. The step time is the median of ``step_time_s`` in
the run's ``metrics.jsonl`` after ``--warmup`` steps (the slowest rank's, see ``dufu.engine.report.StepClock``).
Every worker runs this file in ``--worker`` mode: it imports ``dufu.cli`` and calls its ``main`` as
``python -m dufu`` does, after installing timers that change nothing the run computes:

* ``Trainer.train_step``: wall and process CPU time of each step on each rank;
* ``ExpertDispatch.dispatch`` / ``combine`` (dufu/parallel/expert_parallel.py): the forward of the token
  exchange, the index bookkeeping that orders tokens around it included;
* the token all-to-all itself, in forward and in backward: the module's ``all_to_all_single_autograd`` is
  replaced by an autograd function that issues the same functional collective
  (``_c10d_functional.all_to_all_single`` + ``wait_tensor``, as torch's own backward does) with a timer
  around each direction;
* ``torch.distributed.all_to_all_single``: the exchange of the token counts before each dispatch.

The all-to-all share of a step is (token all-to-alls forward + backward + count exchanges) / step, per rank, the
mean over ranks, median over steps and repeats. A collective's time includes waiting for the slowest peer of its
group to arrive: the share says how long ranks stand in the all-to-all, transfer and waiting together. The
CPU-time share (process CPU time inside the all-to-all over the step's) is the compute the exchange itself
costs. With 4 processes on 2 cores the machine is oversubscribed, so only ratios mean something.

Results: ``benchmarks/results/moe-<date>.md``, ``.json`` and ``.png`` (step time vs EP, all-to-all vs the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import resource
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
    "full": dict(warmup=3, steps=15, ep_nproc=4, ep_sizes=(1, 2, 4), ep_steps=14, ep_warmup=4, repeats=2),
    "quick": dict(warmup=1, steps=2, ep_nproc=2, ep_sizes=(1, 2), ep_steps=4, ep_warmup=1, repeats=1),
}
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


RECIPES = {"moe": "moe_debug", "dense": "llama_debug"}


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
    "optimizer": ("aten::_fused_adamw_", "aten::_foreach_norm", "aten::_foreach_mul_", "aten::_foreach_add_",
                  "aten::_foreach_div_", "aten::_foreach_lerp_", "aten::_foreach_sqrt", "aten::_foreach_addcdiv_",
                  "aten::_foreach_addcmul_", "aten::_foreach_mul"),
}
PROFILE_KINDS = (*OP_KINDS, "other ops", "between ops (Python, dispatch)")


def op_kind(name: str) -> str:
    for kind, names in OP_KINDS.items():
        if name in names:
            return kind
    return "other ops"


def profile_step(contender: _Contender) -> dict:
    """One training step under torch.profiler: the self CPU time of its ops by kind (ms), the step's wall time,
    and the number of matmul calls. What the ops' self times leave of the wall time is the time between ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        contender.step(timed=False)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    ms = dict.fromkeys(PROFILE_KINDS, 0.0)
    matmul_calls = 0
    for ev in prof.key_averages():
        if not ev.key.startswith("aten::"):
            continue  # autograd nodes and Python-level regions: their ops are counted themselves
        ms[op_kind(ev.key)] += ev.self_cpu_time_total / 1e3
        if op_kind(ev.key) == "matmul":
            matmul_calls += ev.count
    ms["between ops (Python, dispatch)"] = max(0.0, wall_ms - sum(ms.values()))
    return {"ms": ms, "wall_ms": wall_ms, "matmul_calls": matmul_calls}


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
    profiles = {kind: profile_step(c) for kind, c in contenders.items()}
    same_data = contenders["moe"].indices == contenders["dense"].indices
    peak = max(c.trainer.peak_flops for c in contenders.values())  # the best reading: one basis for both
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
            "same_samples": same_data, "peak_flops": peak, "rows": rows,
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
        per_step.append({**mean, "a2a_share": statistics.fmean(a / r["step_s"] for a, r in zip(a2a, recs)),
                         "a2a_share_max_rank": max(a / r["step_s"] for a, r in zip(a2a, recs)),
                         "a2a_cpu_share": statistics.fmean(a / r["step_cpu_s"] for a, r in zip(a2a_cpu, recs))})

    def med(key):
        return statistics.median(p.get(key, 0.0) for p in per_step)

    other = None
    if busy0 is not None and busy1 is not None:
        other = max(0.0, (busy1 - busy0 - cpu) / (wall * (os.cpu_count() or 1)))
    return {"ep": ep, "repeat": repeat, "command": "python -m dufu " + " ".join(argv[:1] + argv[1:]),
            "wall_s": wall, "cpu_s": cpu, "other_load": other,
            "step_times_s": step_times, "median_step_s": statistics.median(step_times[warm:]),
            "losses": [m["loss"] for m in metrics], "moe_max_load": [m.get("moe_max_load") for m in metrics],
            "timed_steps": len(per_step),
            "median_rank_step_s": med("step_s"), "median_rank_step_cpu_s": med("step_cpu_s"),
            "a2a_forward_s": med("a2a_forward_s"), "a2a_backward_s": med("a2a_backward_s"),
            "a2a_counts_s": med("a2a_counts_s"), "dispatch_s": med("dispatch_s"), "combine_s": med("combine_s"),
            "a2a_share": med("a2a_share"), "a2a_share_max_rank": med("a2a_share_max_rank"),
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
            "a2a_counts_s", "dispatch_s", "combine_s", "a2a_share", "a2a_share_max_rank", "a2a_cpu_share")
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


# ============================================================================ report
def _f(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Mixture of experts on the CPU - {result['date']}", "",
             f"`{result['command']}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; {m['platform']}. The run took {result['wall_s']:.0f} s; load "
             f"average {result['load_avg_start']} at the start, {result['load_avg_end']} at the end.", ""]
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
            f"{s['top_k'] * s['expert_ffn']}. {dense['threads']} torch threads; {dense['warmup']} warm-up steps "
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
                  f"(tokens/s {mo['tokens_per_s'] / de['tokens_per_s']:.2f}x). MFU basis: "
                  f"{dense['peak_flops'] / 1e9:,.0f} GFLOP/s ({de['peak_source']}). The MoE model holds "
                  f"{mo['parameters'] / de['parameters']:.2f}x the dense model's parameters "
                  f"({mo['matmul_parameters_total']:,} in matmuls vs {de['matmul_parameters_total']:,}) and uses "
                  f"{mo['active_parameters'] / de['active_parameters']:.4f}x its parameters per token (the routers).",
                  "", "One more step of each under `torch.profiler`, ms by kind of op (self CPU time; between ops = "
                  "the profiled step's wall time minus its ops' time: Python, autograd and dispatch):", "",
                  "| kind | MoE (ms) | dense (ms) | MoE - dense (ms) |", "|---|---:|---:|---:|"]
        pm, pd = mo["profile"], de["profile"]
        for kind in PROFILE_KINDS:
            lines.append(f"| {kind} | {pm['ms'][kind]:,.1f} | {pd['ms'][kind]:,.1f} | "
                         f"{pm['ms'][kind] - pd['ms'][kind]:+,.1f} |")
        lines += [f"| **profiled step (wall)** | {pm['wall_ms']:,.1f} | {pd['wall_ms']:,.1f} | "
                  f"{pm['wall_ms'] - pd['wall_ms']:+,.1f} |",
                  f"| matmul calls per step | {pm['matmul_calls']} | {pd['matmul_calls']} | "
                  f"{pm['matmul_calls'] - pd['matmul_calls']:+} |", ""]
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
            "| EP | step (ms) | vs EP 1 | all-to-all share of the step | (busiest rank) | all-to-all (ms) | "
            "token a2a fwd / bwd (ms) | count exchange (ms) | dispatch + combine fwd (ms) | all-to-all CPU share "
            "| other load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in ep["rows"]:
            lines.append(
                f"| {row['ep']} | {_f(1e3 * row['median_step_s'])} ({_f(1e3 * row['step_min_s'])}-"
                f"{_f(1e3 * row['step_max_s'])}) | {row['step_ratio_to_ep1']:.2f}x | {100 * row['a2a_share']:.1f}% | "
                f"{100 * row['a2a_share_max_rank']:.1f}% | {_f(row['a2a_ms'])} | "
                f"{_f(1e3 * row['a2a_forward_s'], 1)} / {_f(1e3 * row['a2a_backward_s'], 1)} | "
                f"{_f(1e3 * row['a2a_counts_s'], 1)} | {_f(1e3 * (row['dispatch_s'] + row['combine_s']), 1)} | "
                f"{100 * row['a2a_cpu_share']:.1f}% | "
                f"{_f(100 * row['other_load']) + '%' if row['other_load'] is not None else '-'} |")
        lines += ["", "step = median `step_time_s` of `metrics.jsonl` (the slowest rank's step; in parentheses the "
                  "range over repeats); all-to-all share = (token all-to-alls in forward and backward + the token-count "
                  "exchanges) / the rank's own `train_step` time, mean over ranks (busiest rank: the largest), median "
                  "over steps and repeats; all-to-all (ms) = share x step; the a2a and dispatch columns are the mean "
                  "rank's per step (dispatch + combine = the forward of `ExpertDispatch`, bookkeeping included); CPU "
                  "share = process CPU time inside the all-to-alls over the step's. Losses of all runs identical: "
                  f"{'yes' if ep['losses_identical'] else 'no, largest difference ' + format(ep['max_loss_difference'], '.2e')}.",
                  ""]
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
    ax.set_title(f"MoE step time vs expert-parallel size\n(dp {ep['nproc']}, gloo, {ep['nproc']} processes on "
                 f"{os.cpu_count()} cores: ratios only)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
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
    ap.add_argument("--results-dir", default=None, help=f"where results go (default {RESULTS}; --quick: nowhere)")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    shape, runs = SHAPES[mode], dict(RUNS[mode])
    if args.steps is not None:
        runs["steps"] = args.steps
    if args.repeats is not None:
        runs["repeats"] = args.repeats
    results_dir = Path(args.results_dir) if args.results_dir else (None if args.quick else RESULTS)
    t0 = time.perf_counter()
    load0 = [round(x, 2) for x in os.getloadavg()]
    date = _dt.date.today().isoformat()
    result = {"date": date, "command": "python benchmarks/moe.py " + " ".join(argv), "quick": args.quick,
              "shape": shape, "load_avg_start": load0}
    with tempfile.TemporaryDirectory(prefix="dufu-moe-") as tmp:
        work = Path(tmp)
        if args.only in (None, "dense"):
            result["dense"] = compare_dense(shape, runs, work)
        if args.only in (None, "ep"):
            result["ep"] = compare_ep(shape, runs, work)
    import torch

    result["machine"] = _machine.machine_info(torch_threads=torch.get_num_threads())
    result["wall_s"] = time.perf_counter() - t0
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
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
