"""Building a model and loading pretrained weights, the old way and the meta-device way, side by side in one run.

    python benchmarks/model_init.py                  # GPT-2 medium size (355M parameters), 3 repeats
    python benchmarks/model_init.py --quick          # GPT-2 small size (124M), 1 repeat, smoke run

Four ways to get a model, each in a fresh process (so its peak resident memory, the kernel's ``VmHWM``, is its own), one process:

* ``construct``          -- ``GPTModel(**sizes)``: the constructor allocates and initialises every tensor (the
                           single-device build every rank did before the trainer built on the meta device).
* ``meta + materialize`` -- the trainer's way: build on ``torch.device("meta")``, then
                           ``dufu.parallel.materialize.materialize_`` allocates and fills each module from its
                           per-module seeded rule (one module's full-size copy at a time).
* ``construct + load``   -- a pretrained start the old way: construct (random init), then
                           ``dufu.engine.weights.pretrained.load_pretrained`` copies the Hugging Face weights over it.
* ``from_pretrained``    -- ``dufu.from_pretrained`` now: build on meta, read each tensor into place (nothing
                           random is generated for what the checkpoint holds).

The pretrained weights are a Hugging Face GPT-2 directory written by ``dufu.save_pretrained`` in this run
(model.safetensors, fp32). Reported per way: the median wall time over ``--repeats`` fresh processes and the peak
RSS above a baseline process that imports torch and dufu and does nothing else. With several processes on one
machine (a parallel run), every rank used to pay the ``construct`` cost for the whole model; the trainer now pays
``meta + materialize`` for its own shards only (see ``parallel.py --only init`` for that, per layout).

Results go to ``benchmarks/results/model_init-<YYYY-MM-DD>.json`` and ``.md`` with the machine (not for ``--quick``
unless ``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import launch, machine, results as results_files

SIZES = {
    "medium": dict(vocab_size=50304, hidden_size=1024, num_layers=24, num_attention_heads=16,
                   max_position_embeddings=1024),
    "small": dict(vocab_size=50304, hidden_size=768, num_layers=12, num_attention_heads=12,
                  max_position_embeddings=1024),
}

# Each way runs in its own process; it prints one JSON line: seconds and peak RSS (KiB).
WORKER = r'''
import json, sys, time
import torch
from dufu.models.gpt import GPTModel
from dufu.engine.weights import pretrained
from dufu.models import hub
from dufu.parallel.materialize import materialize_
from harness.proc import status_kib

way, sizes, hf_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
t0 = time.perf_counter()
if way == "construct":
    model = GPTModel(**sizes)
elif way == "meta + materialize":
    with torch.device("meta"):
        model = GPTModel(**sizes)
    materialize_(model, model, torch.device("cpu"), seed=0)
elif way == "construct + load":
    model = pretrained.load_pretrained(GPTModel(**sizes), hf_dir)
elif way == "from_pretrained":
    model = pretrained.from_pretrained(hf_dir)
elif way == "baseline":
    model = None
seconds = time.perf_counter() - t0
params = 0 if model is None else sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
# VmHWM: this process's own high-water mark (ru_maxrss would carry the launching process's over exec)
peak = status_kib("VmHWM")
print(json.dumps({"seconds": seconds, "peak_kib": peak, "parameters": params}))
'''

WAYS = ["construct", "meta + materialize", "construct + load", "from_pretrained"]


def run_way(way: str, sizes: dict, hf_dir: Path, threads: int) -> dict:
    env = launch.job_env(threads=threads)  # benchmarks/ on PYTHONPATH: the worker reads /proc through harness
    proc = subprocess.run([sys.executable, "-c", WORKER, way, json.dumps(sizes), str(hf_dir)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{way} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 small size, 1 repeat, no results file")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args(argv)
    size = "small" if args.quick else "medium"
    repeats = args.repeats or (1 if args.quick else 3)
    sizes = SIZES[size]
    info = machine.describe()

    with tempfile.TemporaryDirectory(prefix="dufu-bench-init-") as tmp:
        import torch

        from dufu.models.gpt import GPTModel
        from dufu.models.hub import save_pretrained

        hf_dir = Path(tmp) / "hf"
        print(f"writing a Hugging Face GPT-2 directory ({size} sizes) ...", flush=True)
        torch.manual_seed(1)
        src = GPTModel(**sizes)
        save_pretrained(src, hf_dir)
        del src
        base = [run_way("baseline", sizes, hf_dir, args.threads) for _ in range(repeats)]
        base_kib = statistics.median(b["peak_kib"] for b in base)
        rows = []
        for way in WAYS:
            runs = []
            for r in range(repeats):
                runs.append(run_way(way, sizes, hf_dir, args.threads))
                print(f"  {way:20s} run {r + 1}/{repeats}: {runs[-1]['seconds']:.2f} s, "
                      f"peak {runs[-1]['peak_kib'] / 1024:,.0f} MiB", flush=True)
            rows.append({"way": way, "parameters": runs[0]["parameters"],
                         "seconds_median": statistics.median(x["seconds"] for x in runs),
                         "peak_above_baseline_mib": statistics.median(x["peak_kib"] for x in runs) / 1024
                         - base_kib / 1024,
                         "runs": runs})

    fp32_mib = rows[0]["parameters"] * 4 / 2**20
    by = {r["way"]: r for r in rows}
    lines = [f"# Model build and pretrained load - {results_files.today()}", "",
             f"GPT-2 {size} sizes ({rows[0]['parameters']:,} parameters, {fp32_mib:,.0f} MiB in fp32), one process, "
             f"{args.threads} threads, median of {repeats} fresh processes; peak RSS above a process that only "
             f"imports torch and dufu ({base_kib / 1024:,.0f} MiB). Machine: {info['cpu']}, {info['logical_cpus']} "
             f"logical CPUs, torch {info['torch']}; {machine.peaks_text(info)}.", "",
             "| way | seconds | peak RSS above baseline (MiB) | / fp32 model size |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['seconds_median']:.2f} | {r['peak_above_baseline_mib']:,.0f} | "
                     f"{r['peak_above_baseline_mib'] / fp32_mib:.2f} |")
    c, m = by["construct"], by["meta + materialize"]
    cl, fp = by["construct + load"], by["from_pretrained"]
    lines += ["", "## Observations", "",
              f"* Random initialisation: meta + materialize takes {m['seconds_median']:.2f} s vs {c['seconds_median']:.2f} s "
              f"for the constructor ({m['seconds_median'] / c['seconds_median']:.2f}x), at {m['peak_above_baseline_mib']:,.0f} vs "
              f"{c['peak_above_baseline_mib']:,.0f} MiB peak.",
              f"* Pretrained: from_pretrained takes {fp['seconds_median']:.2f} s vs {cl['seconds_median']:.2f} s for construct + "
              f"load ({fp['seconds_median'] / cl['seconds_median']:.2f}x), at {fp['peak_above_baseline_mib']:,.0f} vs "
              f"{cl['peak_above_baseline_mib']:,.0f} MiB peak. Both pretrained peaks include the pages of the "
              "memory-mapped safetensors file that were read (file-backed and reclaimable, about one fp32 model "
              "size): resident, but not memory the process allocated."]
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    out = results_files.results_dir(args.results_dir, args.quick)
    if out is not None:
        stem = results_files.write(results_files.stem(out, "model_init"), {
            "size": size, "sizes": sizes, "repeats": repeats, "threads": args.threads, "baseline_kib": base_kib,
            "rows": rows, "machine": info}, report)
        print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
