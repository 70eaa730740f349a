"""The output head + cross entropy, plain vs fused, side by side in one run: time and memory.

    python benchmarks/fused_loss.py              # both shapes, fp32 and bf16 autocast, head+loss and whole model
    python benchmarks/fused_loss.py --quick      # a smoke run (< 1 min), writes nothing unless --results-dir

Two ways to get the loss of hidden states h (N, C) under an output head W (V, C):

* ``plain`` -- what dufu's models do without ``fused_loss``: logits = h @ W^T (N, V) in the compute dtype, then
  ``dufu.layers.loss.cross_entropy_loss`` (fp32 cross entropy), backward through both.
* ``fused`` -- ``dufu.layers.loss.fused_linear_cross_entropy``: the same loss chunk by chunk (its default rows
  per chunk, ``fused_chunk_size(V)``), gradients computed in forward. A sweep over the rows per chunk times the
  fused head alone (``--sweep``), which is how the default was chosen.

Shapes: the default recipe's (dufu/configs/default.py: hidden 256, vocab 2048, micro-batch 16 x 128 tokens) and
GPT-2 small's (hidden 768, vocab 50257, 4 x 256). Two measurements per shape and dtype:

* ``head``  -- forward + backward of the head and the loss alone (h and W require gradients, as the final norm's
  output and the head's weight do in a model);
* ``model`` -- forward + backward of the whole GPTModel of that shape (the default recipe's 4 layers / GPT-2
  small's 12, tied embeddings, dropout 0) with ``fused_loss`` False / True and the same weights: the end-to-end
  effect on a training step (the optimizer step, the same for both, is left out).

Timing: per (shape, dtype, kind), both variants are built, then ``--warmup`` steps each, then ``--steps`` timed
steps interleaved round robin with the starting variant alternating, so a noisy machine's drift hits both alike;
the median is reported, with the share of the machine other processes used meanwhile (from /proc/stat).

Memory, each variant measured in a fresh subprocess (``--probe``) after one warm-up step:

* ``saved``  -- bytes of the tensors autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``,
  each storage counted once, storages of the inputs h and W themselves not counted: they exist anyway);
* ``peak``   -- the rise of the process's peak resident memory (Linux VmHWM, reset through /proc/self/clear_refs)
  over one forward + backward, above the resident memory before it. glibc's malloc is told to map every block
  over 64 KiB separately (``MALLOC_MMAP_THRESHOLD_``) so a freed tensor leaves the resident set at once.

Results go to ``benchmarks/results/fused_loss-<YYYY-MM-DD>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dufu.layers.loss import cross_entropy_loss, fused_chunk_size, fused_linear_cross_entropy  # noqa: E402
from dufu.models.gpt import GPTModel  # noqa: E402
from harness import launch, machine, proc, results as results_files  # noqa: E402

SHAPES = {
    "default": dict(hidden=256, vocab=2048, batch=16, seq=128, layers=4, heads=4),
    "gpt2": dict(hidden=768, vocab=50257, batch=4, seq=256, layers=12, heads=12),
}
QUICK_SHAPES = {
    "default": dict(hidden=64, vocab=512, batch=4, seq=32, layers=2, heads=4),
    "gpt2": dict(hidden=128, vocab=8192, batch=2, seq=64, layers=2, heads=4),
}
VARIANTS = ("plain", "fused")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
KINDS = ("head", "model")


# ----------------------------------------------------------------------------- what is measured
class Case:
    """One (shape, dtype, kind, variant): ``step()`` runs forward + backward and returns the loss."""

    def __init__(self, shape: dict, dtype: str, kind: str, variant: str, seed: int = 0,
                 chunk_size: int | None = None):
        self.amp = DTYPES[dtype]
        self.kind, self.variant = kind, variant
        self.chunk_size = chunk_size  # rows per chunk of the fused head; None: the function's default
        g = torch.Generator().manual_seed(seed)
        N, C, V = shape["batch"] * shape["seq"], shape["hidden"], shape["vocab"]
        if kind == "head":
            self.h = torch.randn(N, C, generator=g).requires_grad_()  # a final norm's output: ~unit scale
            self.w = (0.02 * torch.randn(V, C, generator=g)).requires_grad_()  # GPT-2's init
            self.y = torch.randint(0, V, (N,), generator=g)
            self.inputs = (self.h, self.w)
        else:
            torch.manual_seed(seed)  # the same weights for both variants
            self.model = GPTModel(vocab_size=V, hidden_size=C, num_layers=shape["layers"],
                                  num_attention_heads=shape["heads"], max_position_embeddings=shape["seq"],
                                  fused_loss=variant == "fused")
            tokens = torch.randint(0, V, (shape["batch"], shape["seq"] + 1), generator=g)
            self.x, self.y = tokens[:, :-1], tokens[:, 1:]
            self.inputs = tuple(self.model.parameters())

    def loss(self) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
            if self.kind == "model":
                return self.model(self.x, shift_labels=self.y).loss
            if self.variant == "fused":
                return fused_linear_cross_entropy(self.h, self.w, self.y, chunk_size=self.chunk_size)
            return cross_entropy_loss(self.h @ self.w.t(), self.y)  # (N, V) logits

    def step(self) -> float:
        for t in self.inputs:
            t.grad = None
        loss = self.loss()
        loss.backward()
        return loss.item()




def timed(case: Case) -> dict:
    b0, t0, c0 = proc.system_busy_seconds(), time.perf_counter(), time.process_time()
    loss = case.step()
    wall, cpu, b1 = time.perf_counter() - t0, time.process_time() - c0, proc.system_busy_seconds()
    others = max(0.0, (b1 - b0) - cpu) / (wall * os.cpu_count()) if b0 is not None and b1 is not None else None
    return {"wall": wall, "cpu": cpu, "others": others, "loss": loss}


def time_pair(shape: dict, dtype: str, kind: str, warmup: int, steps: int) -> dict:
    """Median step of both variants, interleaved round robin."""
    cases = {v: Case(shape, dtype, kind, v) for v in VARIANTS}
    first = {v: cases[v].step() for v in VARIANTS}
    # the same loss, or the comparison is void (bf16 model: the blocks' activations are computed anew)
    tol = 1e-5 if (kind == "head" or dtype == "fp32") else 2e-3
    if abs(first["fused"] - first["plain"]) > tol * abs(first["plain"]):
        raise SystemExit(f"{kind} {dtype}: fused loss {first['fused']} != plain {first['plain']}")
    for _ in range(warmup - 1):
        for v in VARIANTS:
            cases[v].step()
    runs = {v: [] for v in VARIANTS}
    for i in range(steps):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        for v in order:
            runs[v].append(timed(cases[v]))
    out = {}
    for v in VARIANTS:
        walls = [r["wall"] for r in runs[v]]
        cpus = [r["cpu"] for r in runs[v]]
        others = [r["others"] for r in runs[v] if r["others"] is not None]
        out[v] = {"median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls),
                  "median_cpu_s": statistics.median(cpus),
                  "step_times_s": walls, "others_share": statistics.median(others) if others else None,
                  "loss": first[v]}
    return out


def chunk_sweep(shape: dict, dtype: str, sizes: list[int], warmup: int, steps: int) -> list[dict]:
    """The fused head+loss with each number of rows per chunk, interleaved round robin."""
    N = shape["batch"] * shape["seq"]
    budgets = sorted({min(N, n) for n in sizes})
    cases = {b: Case(shape, dtype, "head", "fused", chunk_size=b) for b in budgets}
    for _ in range(warmup):
        for c in cases.values():
            c.step()
    runs = {b: [] for b in budgets}
    for i in range(steps):
        for b in (budgets if i % 2 == 0 else budgets[::-1]):
            runs[b].append(timed(cases[b])["wall"])
    return [{"chunk_rows": b, "chunk_mib_fp32": b * shape["vocab"] * 4 / 2**20, "median_s": statistics.median(runs[b]),
             "min_s": min(runs[b]), "max_s": max(runs[b])} for b in budgets]


# ----------------------------------------------------------------------------- memory, in a fresh process
def probe(shape_name: str, dtype: str, kind: str, variant: str, quick: bool) -> dict:
    """Bytes saved for backward and the peak resident-memory rise of one forward + backward (this process)."""
    shape = (QUICK_SHAPES if quick else SHAPES)[shape_name]
    case = Case(shape, dtype, kind, variant)
    case.step()  # warm-up: one-time allocations (thread pools, kernels' scratch) are not the variant's
    for t in case.inputs:
        t.grad = None
    gc.collect()
    inputs = {t.untyped_storage().data_ptr() for t in case.inputs}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            saved[s.data_ptr()] = s.nbytes()
        return t

    if not proc.reset_high_water_mark():  # VmHWM := VmRSS
        raise SystemExit("the kernel refused to reset VmHWM (/proc/self/clear_refs): no memory probe here")
    before = proc.status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = case.loss()
    loss.backward()
    peak = proc.status_kib("VmHWM")
    return {"saved_bytes": sum(saved.values()), "peak_rise_bytes": (peak - before) * 1024}


def probe_in_subprocess(shape_name: str, dtype: str, kind: str, variant: str, quick: bool) -> dict:
    env = launch.job_env(threads=None, extra={"MALLOC_MMAP_THRESHOLD_": "65536"})
    cmd = [sys.executable, __file__, "--probe", shape_name, dtype, kind, variant] + (["--quick"] if quick else [])
    job = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if job.returncode != 0:
        raise SystemExit(f"memory probe {' '.join(cmd[2:])} failed:\n{job.stderr[-3000:]}")
    return json.loads(job.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- reporting


def mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def table(rows: list[dict]) -> str:
    lines = ["| shape | dtype | measured | variant | median (ms) | min-max (ms) | CPU ms/step | other load "
             "| fused speed-up | saved for backward (MiB) | peak rise (MiB) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        oth = "-" if r["others_share"] is None else f"{100 * r['others_share']:.0f}%"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['kind']} | {r['variant']} | {1e3 * r['median_s']:,.1f} | "
            f"{1e3 * r['min_s']:,.1f}-{1e3 * r['max_s']:,.1f} | {1e3 * r['median_cpu_s']:,.1f} | {oth} | "
            f"{r['speedup']:.2f}x | {mib(r['saved_bytes'])} | {mib(r['peak_rise_bytes'])} |")
    return "\n".join(lines)


def sweep_table(sweeps: list[dict]) -> str:
    if not sweeps:
        return ""
    lines = ["| shape | dtype | rows per chunk | a chunk's fp32 logits (MiB) | median (ms) | min-max (ms) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in sweeps:
        lines.append(f"| {r['shape']} | {r['dtype']} | {r['chunk_rows']:,} | {r['chunk_mib_fp32']:,.1f} | "
                     f"{1e3 * r['median_s']:,.1f} | {1e3 * r['min_s']:,.1f}-{1e3 * r['max_s']:,.1f} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    by = {(r["shape"], r["dtype"], r["kind"], r["variant"]): r for r in rows}
    for shape, dtype, kind in sorted({(r["shape"], r["dtype"], r["kind"]) for r in rows}):
        p, f = by[(shape, dtype, kind, "plain")], by[(shape, dtype, kind, "fused")]
        faster = "faster" if f["median_s"] < p["median_s"] else "slower"
        out.append(f"{shape} {dtype} {kind}: fused {f['speedup']:.2f}x the plain speed ({faster}); peak rise "
                   f"{mib(f['peak_rise_bytes'])} vs {mib(p['peak_rise_bytes'])} MiB, saved for backward "
                   f"{mib(f['saved_bytes'])} vs {mib(p['saved_bytes'])} MiB")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="default,gpt2", help="comma-separated: default, gpt2")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (bf16 = bf16 autocast)")
    p.add_argument("--kinds", default="head,model", help="comma-separated: head (head+loss alone), model (GPTModel)")
    p.add_argument("--model-shapes", default="default",
                   help="shapes the whole-model measurement runs at (default: the default recipe's only; GPT-2 small's "
                        "12 layers take minutes per variant on a CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default: head 15, model 5)")
    p.add_argument("--sweep", default="256,512,1024,2048",
                   help="rows per chunk to time the fused head+loss at (comma-separated; '' for none)")
    p.add_argument("--sweep-shapes", default="default", help="shapes the chunk sweep runs at")
    p.add_argument("--tag", default="", help="suffix of the result files: fused_loss-<date>[-TAG].json/.md")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the whole script")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--results-dir", default=None,
                   help="where the dated .json/.md go (default benchmarks/results; --quick writes nothing unless given)")
    p.add_argument("--probe", nargs=4, metavar=("SHAPE", "DTYPE", "KIND", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(probe(*args.probe, quick=args.quick)))
        return 0
    shapes = QUICK_SHAPES if args.quick else SHAPES
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [n for n in names if n not in shapes] + [d for d in dtypes if d not in DTYPES] + \
          [k for k in kinds if k not in KINDS]
    if bad:
        p.error(f"unknown {bad} (shapes: {list(shapes)}, dtypes: {list(DTYPES)}, kinds: {list(KINDS)})")
    results_dir = results_files.results_dir(args.results_dir, args.quick)

    started = _dt.datetime.now()
    info = machine.describe()
    load_start = os.getloadavg()
    print(f"fused_loss benchmark: {info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}", flush=True)
    if load_start[0] > torch.get_num_threads() + 0.5:
        print(f"warning: the 1-minute load average is {load_start[0]:.1f} with {os.cpu_count()} CPUs; other "
              "processes are competing for them and the times will be noisy", flush=True)
    rows = []
    for name in names:
        shape = shapes[name]
        for kind in kinds:
            if kind == "model" and name not in args.model_shapes.split(","):
                continue
            for dtype in dtypes:
                steps = args.steps or (15 if kind == "head" else 5)
                times = time_pair(shape, dtype, kind, args.warmup, steps)
                for v in VARIANTS:
                    mem = probe_in_subprocess(name, dtype, kind, v, args.quick)
                    rows.append({"shape": name, **shape, "tokens": shape["batch"] * shape["seq"], "dtype": dtype,
                                 "kind": kind, "variant": v, **times[v], **mem,
                                 "speedup": times["plain"]["median_s"] / times[v]["median_s"],
                                 "steps": steps, "warmup": args.warmup})
                    r = rows[-1]
                    print(f"{name:8s} {dtype} {kind:5s} {v:5s} median {1e3 * r['median_s']:9.1f} ms  "
                          f"saved {mib(r['saved_bytes']):>8s} MiB  peak rise {mib(r['peak_rise_bytes']):>8s} MiB",
                          flush=True)
    budgets = [int(k) for k in args.sweep.split(",") if k.strip()]
    sweeps = []
    for name in [n for n in names if n in args.sweep_shapes.split(",")]:
        for dtype in dtypes:
            for r in chunk_sweep(shapes[name], dtype, budgets, args.warmup, args.steps or 9) if budgets else []:
                sweeps.append({"shape": name, "dtype": dtype, **r})
                print(f"{name:8s} {dtype} fused head, chunks of {r['chunk_rows']:5d} rows: median "
                      f"{1e3 * r['median_s']:9.1f} ms", flush=True)
    wall = (_dt.datetime.now() - started).total_seconds()
    info["load_average_at_start"] = [round(x, 2) for x in load_start]
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    tab, verdict = table(rows), verdicts(rows)
    sweep_tab = sweep_table(sweeps)
    print("\n" + tab + "\n\n" + sweep_tab)
    for v in verdict:
        print(v)
    if results_dir is None:
        return 0
    stem = results_files.stem(results_dir, "fused_loss", f"{started:%Y-%m-%d}", args.tag or "")
    cmd = "python benchmarks/fused_loss.py" + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "")
    payload = {"benchmark": "fused_loss", "date": started.isoformat(timespec="seconds"), "command": cmd,
               "shapes": {n: shapes[n] for n in names},
               "fused_chunk_rows": {n: fused_chunk_size(shapes[n]["vocab"]) for n in names},
               "machine": info, "seconds": round(wall, 1), "rows": rows, "chunk_sweep": sweeps, "verdicts": verdict}
    shape_text = "; ".join(f"{n}: hidden {s['hidden']}, vocab {s['vocab']:,}, {s['batch']} x {s['seq']} = "
                           f"{s['batch'] * s['seq']:,} tokens, model {s['layers']} layers" for n, s in
                           ((n, shapes[n]) for n in names))
    md = [f"# fused_loss benchmark, {started:%Y-%m-%d}", "", f"`{cmd}`", "",
          "Output head + cross entropy: `plain` (logits h @ W^T, then fp32 cross entropy) vs `fused` "
          "(`fused_linear_cross_entropy`, default chunks: "
          + ", ".join(f"{n} {fused_chunk_size(shapes[n]['vocab']):,} rows" for n in names) + "). `head`: forward + backward of the head and loss alone; `model`: "
          "forward + backward of the whole GPTModel with `fused_loss` False / True. bf16 = bf16 autocast. "
          f"Shapes: {shape_text}.", "", tab, "",
          "median = median wall time of the timed steps (variants interleaved round robin); CPU ms/step = median "
          "CPU time of this process per step, all threads; other load = median "
          "share of the machine's CPU time other processes used during a step; fused speed-up = plain median / "
          "this median. saved for backward = bytes autograd keeps (saved_tensors_hooks; storages of h and W "
          "themselves not counted); peak rise = rise of the peak resident memory over one forward + backward in a "
          "fresh process (VmHWM, malloc mapping blocks over 64 KiB separately), gradients of W included.", ""]
    md += [f"- {v}" for v in verdict]
    if sweeps:
        md += ["", "Rows per chunk of the fused head+loss (`chunk_size`), timed alone, interleaved round robin:", "",
               sweep_tab]
    md += ["", f"Machine: {info['cpu']} ({', '.join(info['cpu_features'])}), {info['logical_cpus']} logical CPUs, "
           f"{info['torch_threads']} torch threads; torch {info['torch']}, Python {info['python']}; "
           f"{info['platform']}; {machine.peaks_text(info)}. Date {started.isoformat(timespec='seconds')}; the run "
           f"took {wall:.0f} s. Load "
           f"average (1/5/15 min) {info['load_average_at_start']} at start, {info['load_average_at_end']} at end."]
    results_files.write(stem, payload, "\n".join(md))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
