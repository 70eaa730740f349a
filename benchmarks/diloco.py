"""DiLoCo (and LocalSGD) vs plain data parallelism across replica groups, at the same tokens: held-out perplexity
and the bytes each rank hands to cross-group all-reduces per step, counted.

    python benchmarks/diloco.py                          # the default recipe's run (hidden 128), over 2 replica groups
    python benchmarks/diloco.py --sync-every 10 50 --local-sgd
    python benchmarks/diloco.py --append --sync-every 10 --outer 0.7,0.5   # another outer optimizer, added to today's file
    python benchmarks/diloco.py --quick                  # a smoke run (gpt_debug, seconds), writes nothing unless --results-dir

Every variant is 2 replica groups (2 ``dufu train`` jobs of one process each, ``train.fault_tolerance``, gloo) and
one Lighthouse (min 2 replicas, so every quorum and synchronisation has both groups), on a scaled-down copy of
the default recipe (``dufu train`` with no config: GPT, 4 layers, sequence 128, 400 steps, AdamW lr 2e-3, warm-up
30; here hidden 128 instead of 256, so that the five runs of two groups take minutes, not an hour, on 2 shared
cores), each group with micro-batch 8 so that the two groups' global batch is the recipe's 16 samples: every
variant trains on the recipe's tokens, 400 x 16 x 128. Changed from the recipe, for all variants alike: fp32 and
no torch.compile (each group would measure the machine on its own and might choose differently), no samples at
the end. Variants:

* ``dp`` -- ``mode=replicate``: gradients averaged over the groups every step (data parallelism across groups);
* ``diloco-H`` -- ``mode=diloco, sync_every=H``: H local AdamW steps, then the pseudo-gradients averaged and an
  outer Nesterov SGD step (lr 0.7, momentum 0.9: the DiLoCo paper's);
* ``local_sgd-H`` (``--local-sgd``) -- the weights averaged every H steps.

Reported per variant: validation loss and perplexity of group 0 at every evaluation (every 100 steps and at the
end: the recipe's eval_iter batches), and of group 1 at the end; bytes all-reduced per step (this rank's payload:
the sum over the run of the tensors handed to the Manager's all-reduce, from each group's fault_tolerance.jsonl,
divided by the steps), the ratio to ``dp``; wall time. Results: ``benchmarks/results/diloco-<YYYY-MM-DD>.json``
and ``.md``, with the machine (CPU model from /proc/cpuinfo, the measured matmul peaks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import launch, machine, results as results_files

COMMON = ("train.amp.enabled=False", "train.compile.enabled=False", "train.generation.enabled=False",
          "train.tensorboard=False", "train.checkpointer.period=0", "train.fault_tolerance.enabled=True",
          "train.fault_tolerance.replica_parallel_size=2", "train.fault_tolerance.min_replica_size=2",
          "train.peak_tflops=1.0")
FULL = ("default", ("train.train_micro_batch_size=8", "model.hidden_size=128"))
QUICK = ("gpt_debug", ("train.train_iter=8", "train.evaluation.eval_period=4", "train.evaluation.eval_iter=2"))


def run_variant(name: str, overrides: list[str], config: str, recipe_args, root: Path, address: str) -> dict:
    """Both groups of one variant, side by side; their records."""
    env = launch.job_env(threads=1)
    procs, outs = [], []
    start = time.perf_counter()
    for gid in range(2):
        out = root / name / f"group{gid}"
        outs.append(out)
        cmd = [sys.executable, "-m", "dufu", "train", config, *recipe_args, *COMMON, *overrides,
               f"train.output_dir={out}", f"train.fault_tolerance.lighthouse={address}",
               f"train.fault_tolerance.replica_group_id={gid}"]
        log = open(root / f"{name}-group{gid}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    for proc, log in procs:
        if proc.wait() != 0:
            raise SystemExit(f"{name}: a group failed; see {log.name}:\n" + Path(log.name).read_text()[-3000:])
        log.close()
    seconds = time.perf_counter() - start
    evals = [[json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"eval_loss"' in l]
             for out in outs]
    ft = [json.loads(l) for l in (outs[0] / "fault_tolerance.jsonl").read_text().splitlines()]
    steps = max(r["step"] for r in ft)
    return {"wall_s": round(seconds, 1), "steps": steps,
            "bytes_per_step": sum(r["bytes_allreduced"] for r in ft) / steps,
            "allreduces_with_bytes": sum(1 for r in ft if r["bytes_allreduced"]),
            "participants": sorted({r["participants"] for r in ft}),
            "evals": [{"step": e["step"], "eval_loss": e["eval_loss"], "eval_ppl": e["eval_ppl"]} for e in evals[0]],
            "group1_final_eval_ppl": evals[1][-1]["eval_ppl"]}


def write_results(data: dict, results_dir: Path) -> Path:
    stem = results_files.stem(results_dir, "diloco", data["date"])
    dp = data["variants"]["dp"]
    lines = [f"# DiLoCo / LocalSGD vs data parallelism across 2 replica groups ({data['date']})", "",
             f"Recipe `{data['recipe']}` ({data['what']}); machine: {data['machine']['cpu']}, "
             f"{data['machine']['logical_cpus']} logical CPUs ({machine.peaks_text(data['machine'])}), torch "
             f"{data['machine']['torch']}, torchft "
             f"{data['torchft']}. Same tokens in every variant. Bytes: this rank's payload handed to the "
             "Manager's all-reduce, counted, averaged over the steps. Inner optimizer: the recipe's AdamW; DiLoCo's "
             "outer optimizer: Nesterov SGD, lr 0.7 and momentum 0.9 (the paper's) unless the variant says otherwise. "
             "Wall times are of a machine shared with other work: not a speed comparison.", "",
             "| variant | final val. loss | final val. ppl (group 0 / group 1) | bytes all-reduced per step | "
             "vs dp | all-reduce steps | wall s |", "|---|---|---|---|---|---|---|"]
    for name, v in data["variants"].items():
        last = v["evals"][-1]
        lines.append(f"| {name} | {last['eval_loss']:.4f} | {last['eval_ppl']:.2f} / {v['group1_final_eval_ppl']:.2f} | "
                     f"{v['bytes_per_step']:,.0f} | "
                     f"{'baseline' if v is dp else format(dp['bytes_per_step'] / v['bytes_per_step'], '.1f') + 'x fewer'} | "
                     f"{v['allreduces_with_bytes']} of {v['steps']} | {v['wall_s']} |")
    lines += ["", "Validation perplexity of group 0 during training:", "",
              "| step | " + " | ".join(data["variants"]) + " |", "|---" * (len(data["variants"]) + 1) + "|"]
    for i, e in enumerate(dp["evals"]):
        row = [f"{v['evals'][i]['eval_ppl']:.2f}" if i < len(v["evals"]) else "" for v in data["variants"].values()]
        lines.append(f"| {e['step']} | " + " | ".join(row) + " |")
    results_files.write(stem, data, "\n".join(lines))
    return stem.with_suffix(".md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync-every", type=int, nargs="+", default=[10, 50])  # 40 and 8 outer steps
    parser.add_argument("--local-sgd", action="store_true", help="also LocalSGD at each --sync-every")
    parser.add_argument("--outer", nargs="+", default=["0.7,0.9"], metavar="LR,MOMENTUM",
                        help="DiLoCo's outer Nesterov SGD settings to run (default: the paper's 0.7,0.9)")
    parser.add_argument("--append", action="store_true",
                        help="add the variants not yet in today's results file to it (the others are not run again)")
    parser.add_argument("--quick", action="store_true", help="gpt_debug, 8 steps: a smoke run")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results (none with --quick)")
    args = parser.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft starts its logger: no line per quorum
    import torchft
    from torchft.coordination import LighthouseServer

    config, recipe_args = QUICK if args.quick else FULL
    variants = {"dp": ["train.fault_tolerance.mode=replicate"]}
    for h in args.sync_every:
        for outer in args.outer:
            lr, momentum = outer.split(",")
            name = f"diloco-{h}" if outer == "0.7,0.9" else f"diloco-{h} (outer lr {lr}, momentum {momentum})"
            variants[name] = ["train.fault_tolerance.mode=diloco", f"train.fault_tolerance.sync_every={h}",
                              f"train.fault_tolerance.outer_optimizer.lr={lr}",
                              f"train.fault_tolerance.outer_optimizer.momentum={momentum}"]
        if args.local_sgd:
            variants[f"local_sgd-{h}"] = ["train.fault_tolerance.mode=local_sgd", f"train.fault_tolerance.sync_every={h}"]
    info = machine.describe()
    results_dir = Path(args.results_dir) if args.results_dir else results_files.RESULTS
    earlier = results_files.stem(results_dir, "diloco").with_suffix(".json")
    results = json.loads(earlier.read_text())["variants"] if args.append and earlier.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants.items():
            if name in results:
                continue
            # a Lighthouse per variant: quorum numbers and replica ids start over
            server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
            try:
                results[name] = run_variant(name, overrides, config, recipe_args, Path(tmp), server.address())
            finally:
                server.shutdown()
            print(f"{name}: {results[name]}", flush=True)
    data = {"date": results_files.today(), "recipe": config,
            "what": "scaled down: hidden 128 (the recipe's 256); 2 groups x micro-batch 8 = the recipe's global "
                    "batch of 16, 400 steps; fp32, no compile"
                    if not args.quick else "quick: 8 steps", "torchft": getattr(torchft, "__version__", "0.2.0"),
            "machine": info, "variants": results}
    if args.results_dir or not args.quick:
        print(f"wrote {write_results(data, results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
