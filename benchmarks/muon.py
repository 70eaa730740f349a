"""Muon vs AdamW on the default recipe at equal steps: validation perplexity, step time and optimizer state memory,
measured side by side in one run.

    python benchmarks/muon.py                 # 200 steps of the default recipe with each optimizer
    python benchmarks/muon.py --steps 400     # the recipe's full 400 steps
    python benchmarks/muon.py --quick         # 20 steps each, a smoke run (writes nothing unless --results-dir)

Each variant is ``python -m dufu train`` on the default recipe (GPT, hidden 256, 4 layers, sequence 128, micro-batch
16, AdamW lr 2e-3, weight decay 0.1, warm-up 30), one process, with the same data and initial weights:

* ``adamw`` -- the recipe as it is;
* ``muon``  -- ``optim`` = :class:`dufu.optim.Muon` with :func:`dufu.optim.muon_param_groups`: the blocks'
  weight matrices with Muon (Nesterov momentum 0.95, 5 Newton-Schulz steps, Moonlight's 0.2 sqrt(max(A, B))
  update scaling), embeddings, the tied head, norms and biases with AdamW; the recipe's lr, weight decay, betas
  and eps for both (Moonlight reuses AdamW's hyper-parameters thanks to the scaling).

Changed from the recipe, for both alike: ``--steps`` steps (default 200, half the recipe's 400, so that both runs
take minutes on 2 shared cores; the LR schedule spans them), evaluation every quarter of the run (the recipe's
eval_iter batches of the held-out split), fp32 and no torch.compile (``auto`` measures the machine in each run and
might decide differently under load), no checkpoints and no samples at the end.

Read from each run: validation loss and perplexity at every evaluation; the training loop's mean step time after
the first 10 steps (``step_time_s`` of metrics.jsonl) and the optimizer step's own time (a hook times
``before_optimizer`` to ``after_optimizer``: the optimizer and LR-schedule step); the optimizer's state at the end,
by kind, in bytes (``momentum_buffer``: Muon's one buffer per matrix; ``exp_avg``/``exp_avg_sq``: AdamW's moments).
The muon run's Newton-Schulz dtype is ``ns_dtype="auto"``'s (bf16 on a CPU with AMX-BF16 or AVX512-BF16); also
measured, in this process, one step's orthogonalisations of the recipe's matrices in fp32 and in bf16, one thread.

Results: ``benchmarks/results/muon-<YYYY-MM-DD>.json``, ``.md`` and ``.png`` (validation perplexity and training
loss by step), with the machine (CPU model, measured matmul peaks) and the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from dufu.engine.hooks import Hook
from harness import launch, machine, results as results_files

RECIPE = "default"
COMMON = ("train.amp.enabled=False", "train.compile.enabled=False", "train.generation.enabled=False",
          "train.tensorboard=False", "train.checkpointer.period=0", "train.peak_tflops=1.0", "train.plan_memory=False",
          "train.log_period=10")
WARMUP_STEPS = 10  # left out of the mean step time (first steps allocate, warm caches)


class OptimizerProbe(Hook):
    """Times every optimizer step (``before_optimizer`` to ``after_optimizer``) and, at the end, counts the
    optimizer state's bytes by kind (local shards); writes ``out`` (JSON)."""

    def __init__(self, out: str):
        self.out, self.step_s, self._t0 = Path(out), [], 0.0

    def before_optimizer(self, trainer, grad_norm) -> None:
        self._t0 = time.perf_counter()

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        self.step_s.append(time.perf_counter() - self._t0)  # the CPU computes synchronously: the whole step

    def on_end(self, trainer, summary) -> None:
        import torch

        by_kind: dict = {}
        params = 0
        for opt in trainer.optimizers:
            for p, state in opt.state.items():
                params += p.numel() * p.element_size()
                for kind, value in state.items():
                    if isinstance(value, torch.Tensor):
                        local = value.to_local() if hasattr(value, "to_local") else value
                        by_kind[kind] = by_kind.get(kind, 0) + local.numel() * local.element_size()
        self.out.write_text(json.dumps({"state_bytes": by_kind, "param_bytes_with_state": params,
                                        "optimizer_step_s": self.step_s}))


def muon_override(cfg) -> str:
    """The ``optim`` override that trains the recipe with Muon at its own AdamW hyper-parameters."""
    o = cfg.optim
    return "optim=" + repr({
        "_target_": "dufu.optim.Muon", "lr": o.lr, "weight_decay": o.weight_decay, "betas": list(o.betas),
        "eps": o.eps, "fused": True, "momentum": 0.95, "nesterov": True, "ns_steps": 5, "ns_dtype": "auto",
        "params": {"_target_": "dufu.optim.muon_param_groups", "weight_decay_norm": 0.0, "weight_decay_bias": 0.0}})


def run_variant(name: str, overrides: list[str], steps: int, root: Path, cache: Path) -> dict:
    out = root / name
    probe = root / f"{name}-optimizer.json"
    evals = max(1, steps // 4)
    argv = [RECIPE, *COMMON, f"train.train_iter={steps}", f"train.evaluation.eval_period={evals}",
            f"train.output_dir={out}", launch.hooks_override(("muon.OptimizerProbe", {"out": probe})), *overrides]
    run = launch.execute(launch.Run(name, launch.dufu_train(argv), launch.job_env(cache=cache, threads=1), out),
                         timeout=3600)
    if run.rc != 0:
        raise SystemExit(f"{name} failed ({run.rc}); see {out / 'run.log'}:\n{run.log_tail}")
    records = launch.read_records(out)
    train = [r for r in records if "loss" in r]
    timed, prev, loop_s = 0, 0, 0.0
    for r in train:  # step_time_s: the mean over the steps since the previous record
        if prev >= WARMUP_STEPS:
            loop_s += r["step_time_s"] * (r["step"] - prev)
            timed += r["step"] - prev
        prev = r["step"]
    opt = json.loads(probe.read_text())
    opt_steps = opt.pop("optimizer_step_s")[WARMUP_STEPS:]
    return {"wall_s": round(run.seconds, 1), "load_before": round(run.load_before, 2),
            "step_s": loop_s / timed if timed else None,
            "optimizer_step_s": sum(opt_steps) / len(opt_steps) if opt_steps else None,
            "optimizer_state_bytes": opt["state_bytes"], "param_bytes_with_state": opt["param_bytes_with_state"],
            "losses": [[r["step"], r["loss"]] for r in train],
            "evals": [{"step": r["step"], "eval_loss": r["eval_loss"], "eval_ppl": r["eval_ppl"]}
                      for r in records if "eval_loss" in r]}


def newton_schulz_times(cfg, repeats: int = 3) -> dict:
    """Milliseconds of one step's orthogonalisations of the recipe's Muon matrices, fp32 and bf16, one thread."""
    import torch

    from dufu.config import instantiate
    from dufu.optim import muon_param_groups, zeropower_via_newtonschulz

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    shapes = [tuple(p.shape) for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]]
    grads = [torch.randn(*s) for s in shapes]
    out = {"matrices": [list(s) for s in shapes]}
    for dtype in (torch.float32, torch.bfloat16):
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            t0 = time.perf_counter()
            for g in grads:
                zeropower_via_newtonschulz(g, dtype=dtype)
            best = min(best, time.perf_counter() - t0)
        out[str(dtype).removeprefix("torch.")] = round(best * 1e3, 2)
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def write_results(data: dict, folder: Path) -> Path:
    stem = results_files.stem(folder, "muon", data["date"])
    v = data["variants"]
    m = data["machine"]
    lines = [f"# Muon vs AdamW, default recipe, {data['steps']} steps ({data['date']})", "",
             f"Recipe `{RECIPE}` ({data['what']}); machine: {m['cpu']}, {m['logical_cpus']} logical CPUs "
             f"({machine.peaks_text(m)}), torch {m['torch']}. The two runs train one after the other in fresh "
             "processes, same data and initial weights. The machine is shared: the load average before each run "
             "is in the table; compare the ratios, not the absolute times.", ""]
    evals = [e["step"] for e in v["adamw"]["evals"]]
    rows = []
    for name, r in v.items():
        state = r["optimizer_state_bytes"]
        rows.append([name, f"{r['evals'][-1]['eval_loss']:.4f}", f"{r['evals'][-1]['eval_ppl']:.2f}",
                     results_files.fmt(r["step_s"], ".3f"), results_files.fmt(r["optimizer_step_s"] and
                                                                            r["optimizer_step_s"] * 1e3, ".1f"),
                     mib(sum(state.values())),
                     ", ".join(f"{k} {mib(b)}" for k, b in sorted(state.items()) if k != "step") or "-",
                     f"{r['load_before']:.1f}"])
    lines += results_files.table(["optimizer", "final val. loss", "final val. ppl", "step s (mean)",
                                  "optimizer step ms", "optimizer state MiB", "of which (MiB)", "load before"], rows)
    lines += ["", "Validation perplexity by step:", ""]
    lines += results_files.table(["step", *v], [[str(s), *(f"{r['evals'][i]['eval_ppl']:.2f}" for r in v.values())]
                                                for i, s in enumerate(evals)])
    ns = data["newton_schulz_ms"]
    a, m_ = v["adamw"]["optimizer_state_bytes"], v["muon"]["optimizer_state_bytes"]
    lines += ["", f"Optimizer state: AdamW keeps two moments per parameter ({mib(sum(a.values()))} MiB); Muon one "
              f"momentum buffer per matrix it orthogonalises, AdamW's two moments for the rest "
              f"({mib(sum(m_.values()))} MiB, {sum(m_.values()) / sum(a.values()):.2f}x).",
              "", f"Newton-Schulz, one step's {len(ns['matrices'])} matrices of this recipe (5 iterations, one "
              "thread): "
              f"fp32 {ns['float32']} ms, bf16 {ns['bfloat16']} ms ({ns['float32'] / ns['bfloat16']:.1f}x). "
              f"The muon run used ns_dtype=\"auto\": {data['ns_dtype_auto']} on this CPU (bf16 where the device has "
              "bf16 matrix hardware: AMX-BF16 or AVX512-BF16 on a CPU, Ampere or newer GPUs).", "",
              f"![validation perplexity and training loss]({stem.name}.png)"]
    results_files.write(stem, data, "\n".join(lines))
    plot(data, stem.with_suffix(".png"))
    return stem.with_suffix(".md")


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in data["variants"].items():
        ax1.plot([e["step"] for e in r["evals"]], [e["eval_ppl"] for e in r["evals"]], marker="o", label=name)
        ax2.plot([s for s, _ in r["losses"]], [loss for _, loss in r["losses"]], label=name)
    ax1.set(xlabel="step", ylabel="validation perplexity", yscale="log", title="held-out perplexity")
    ax2.set(xlabel="step", ylabel="training loss", title="training loss (logged every 10 steps)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Muon vs AdamW, default recipe, {data['steps']} steps ({data['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of each run (the recipe: 400)")
    parser.add_argument("--quick", action="store_true", help="20 steps each: a smoke run")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results (none with --quick)")
    args = parser.parse_args(argv)
    import torch

    from dufu.config import LazyConfig, resolve_config_path
    from dufu.optim.muon import ns_dtype_for

    cfg = LazyConfig.load(resolve_config_path(RECIPE))
    steps = 20 if args.quick else args.steps
    variants = {"adamw": [], "muon": [muon_override(cfg)]}
    info = machine.describe()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"  # shared by both runs: the corpus is tokenized once, by the first
        for name, overrides in variants.items():
            results[name] = run_variant(name, overrides, steps, Path(tmp), cache)
            print(f"{name}: final {results[name]['evals'][-1]}, step {results[name]['step_s']:.3f} s, "
                  f"state {results[name]['optimizer_state_bytes']}", flush=True)
    data = {"date": results_files.today(), "recipe": RECIPE, "steps": steps,
            "what": f"{steps} of its 400 steps, LR schedule over them; fp32, no compile" if steps != 400
            else "its 400 steps; fp32, no compile",
            "machine": info, "ns_dtype_auto": str(ns_dtype_for("auto", torch.device("cpu"))).removeprefix("torch."),
            "newton_schulz_ms": newton_schulz_times(cfg), "variants": results,
            "load_average_end": os.getloadavg()[0]}
    folder = results_files.results_dir(args.results_dir, args.quick)
    if folder is not None:
        print(f"wrote {write_results(data, folder)}")
    else:
        print(json.dumps({k: v for k, v in data.items() if k != "machine"}, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
