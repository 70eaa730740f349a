"""Delta tuning side by side in one run: full fine-tuning, LoRA and BitFit of the same GPT, on one process and
dp2 ZeRO-3, and a LoRA step of dufu against transformers + PEFT on the same tiny LLaMA.

    python benchmarks/delta.py            # full run: ~5 minutes on 2 idle cores
    python benchmarks/delta.py --quick    # smoke run: a smaller GPT, 4 steps, 1 round of the PEFT timing
    python benchmarks/delta.py --no-peft  # without the transformers + PEFT part

**Runs.** One GPT (benchmarks/parallel.py's memory model: 8 layers, hidden 512, 8 heads, vocabulary 8,192,
sequence 64; 29.4M parameters; fp32, no dropout) trained three ways from the same seeded initialisation:

* ``full``   -- every parameter trains (``gpt_debug`` as it is);
* ``lora``   -- ``delta = L(LoRA)(targets=["q_proj", "k_proj", "v_proj", "out_proj"], rank=8, alpha=16)``;
* ``bitfit`` -- ``delta = L(BitFit)()``: every bias trains.

Each in two layouts: one process, and dp2 with ZeRO-3 (FSDP2; the frozen base is sharded too). Micro-batch 4
per rank (so the global batch is 4 and 8), ``--steps`` steps (the trainer saves a checkpoint after the last),
one thread per process. Each run is started as ``python -m torch.distributed.run --standalone --nproc-per-node N
-m dufu train CONFIG ...`` with a small config file written by this script (gpt_debug plus the ``delta`` line)
and a hook of the trainer (``train.hooks``, ``benchmarks/harness/memory.py``, as in benchmarks/parallel.py) that
records every rank's peak resident set size in the build, train and checkpoint phases, with glibc's
``MALLOC_MMAP_THRESHOLD_=65536`` so RSS follows the live tensors (see benchmarks/parallel.py).

**Columns.** Trainable parameters: counted on the meta-device model with the delta applied (and checked against
the trainer's ``delta`` summary line). Checkpoint: bytes on disk of the checkpoint the run wrote (model and
AdamW state; a delta run saves only what trains, with its base's fingerprint). Peak memory: the larger rank's
peak RSS minus that of a baseline run of the same layout with a tiny model (1 layer, hidden 64: Python, torch,
gloo and the data, ~300 MiB), in the training steps and over the whole run (build and checkpoint included),
next to the model states a rank should hold: fp32 weights 4 B per parameter, plus 12 B (gradient and AdamW's
two moments) per trainable parameter, divided by 2 under dp2 ZeRO-3. Activations come on top and are the same
for the three (the backward still runs through every frozen layer). Step time: the median ``step_time_s`` of
the steps after ``--warmup`` in the run's ``metrics.jsonl``.

**transformers + PEFT** (skipped with a message when ``peft`` is not installed; ``--no-peft`` skips it too): a
LLaMA of the same size (8 layers, hidden 512, 8 heads, SwiGLU 1,408, vocabulary 8,192), built and initialised by
dufu, written with ``dufu.save_pretrained`` and loaded by ``transformers.AutoModelForCausalLM`` (SDPA attention),
then rank-8 LoRA (alpha 16) on q, k, v and o: ``dufu.delta.LoRA`` on one side, ``peft.get_peft_model`` with the
same ``target_modules`` on the other, dufu's initial A factors copied into PEFT's (B starts at zero on both).
Both run the same plain loop in this process on the same batch (4 x 64 tokens): forward with the loss, backward,
fused AdamW over the trainable parameters, in ``--rounds`` rounds of ``--peft-steps`` steps each, the order
alternating; reported are the median step times and the losses of both, which agree when the two compute the same
thing.

Results go to ``benchmarks/results/delta-<YYYY-MM-DD>.json`` and ``.md`` with the CPU model (not for ``--quick``
unless ``--results-dir`` is given). Run directories and ``DUFU_CACHE_DIR`` live in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import machine, results as results_files
from harness.launch import read_metrics
from harness.memory import memory_job
from harness.results import fmt, table
from parallel_memory import (  # the memory model and settings of benchmarks/parallel.py
    BASELINE_MODEL, COMMON, MEMORY_MODEL, MEMORY_SEQ, QUICK_MEMORY_MODEL, model_overrides, prepare_data_cache,
)

MiB = 1024 * 1024
MICRO_BATCH = 4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
LORA_RANK, LORA_ALPHA = 8, 16
METHODS = {
    "full": None,
    "lora": f"L(LoRA)(targets={LORA_TARGETS!r}, rank={LORA_RANK}, alpha={LORA_ALPHA})",
    "bitfit": "L(BitFit)()",
}
LAYOUTS = {
    "1proc": ("1 process", 1, []),
    "dp2z3": ("dp2 ZeRO-3", 2, ["train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True",
                                "train.zero_optimization.stage=3"]),
}
CONFIG = '''# Written by benchmarks/delta.py: gpt_debug{what}.
from dufu.config import LazyCall as L
from dufu.config import LazyConfig
from dufu.config.packaged import resolve_config_path
from dufu.delta import BitFit, LoRA

dataloader, model, optim, tokenization, train = LazyConfig.load(
    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))
'''

# transformers + PEFT: a LLaMA of the GPT's size (hidden, layers, heads, vocabulary), SwiGLU 8/3 x hidden rounded
PEFT_LLAMA = dict(vocab_size=8192, hidden_size=512, num_layers=8, num_attention_heads=8, num_key_value_heads=8,
                  ffn_hidden_size=1408, max_position_embeddings=64)
QUICK_PEFT_LLAMA = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_attention_heads=4, num_key_value_heads=4,
                        ffn_hidden_size=704, max_position_embeddings=64)
PEFT_BATCH = (4, 64)
HF_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}


# ----------------------------------------------------------------------------- the runs
def write_configs(work: Path) -> dict[str, Path]:
    folder = work / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for method, delta in METHODS.items():
        text = CONFIG.format(what=", every parameter trains" if delta is None else f" with {method}")
        if delta is not None:
            text += f"delta = {delta}\n"
        paths[method] = folder / f"gpt_{method}.py"
        paths[method].write_text(text)
    return paths


def trainable_counts(config: Path, model: dict) -> dict:
    """(trainable, total) of the meta-device model the config builds with ``model``'s sizes and its delta."""
    import torch

    from dufu.config import LazyConfig, instantiate
    from dufu.delta import apply_delta

    cfg = LazyConfig.load(str(config))
    LazyConfig.apply_overrides(cfg, [f"model.{k}={v}" for k, v in model.items()])
    with torch.device("meta"):
        m = instantiate(cfg.model)
        info = apply_delta(m, instantiate(cfg.delta)) if cfg.get("delta") is not None else None
    total = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    return {"trainable": info.trainable_count if info else total, "total": total}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def delta_job(label: str, config: Path, nproc: int, layout_overrides: list[str], model: dict, steps: int,
              work: Path, cache: Path, timeout: float) -> dict:
    """One memory-recording run (:func:`harness.memory.memory_job`); its checkpoint's size, step times and every
    rank's peak RSS."""
    out = work / "runs" / label
    argv = [str(config), *COMMON, f"train.train_iter={steps}", f"train.train_micro_batch_size={MICRO_BATCH}",
            f"train.global_batch_size={MICRO_BATCH * nproc}",
            "train.peak_tflops=1.0",  # skip the peak-FLOP/s matmul measurement
            *model_overrides(model, MEMORY_SEQ), *layout_overrides]
    run, ranks = memory_job(label, nproc, argv, out, cache, timeout)
    row = {"label": label, "nproc": nproc, "returncode": run.rc, "wall_s": round(run.seconds, 1),
           "load_avg_before": round(run.load_before, 2), "command": " ".join(run.cmd[3:])}
    if run.rc != 0:
        row["error"] = run.log_tail
        return row
    ckpts = sorted((out / "run" / "checkpoints").glob("step_*"))
    row["checkpoint_bytes"] = directory_bytes(ckpts[-1]) if ckpts else None
    row["checkpoint_files"] = sorted(f.name for f in ckpts[-1].iterdir()) if ckpts else []
    log = (out / "run.log").read_text(errors="replace")
    found = re.search(r"delta\s+.*?: ([\d,]+) of ([\d,]+) parameters train", log)
    row["trainer_trainable"] = int(found.group(1).replace(",", "")) if found else None
    records = read_metrics(out / "run")
    row["losses"] = [r["loss"] for r in records]
    row["step_times_s"] = [r["step_time_s"] for r in records]
    if ranks:
        row["ranks"] = ranks
        row["peak_mib"] = max(r["peak_kb"] for r in ranks) / 1024
        row["train_mib"] = max(r["phases_kb"].get("train", 0) for r in ranks) / 1024
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)  # the size is what was wanted
    return row


def median_step_ms(row: dict, warmup: int) -> float | None:
    timed = row.get("step_times_s", [])[warmup:]
    return 1000 * statistics.median(timed) if timed else None


def model_state_mib(trainable: int, total: int, shards: int) -> float:
    """fp32 weights (4 B each) + gradient and AdamW's two moments (12 B) per trainable parameter, per rank."""
    return (4 * total + 12 * trainable) / shards / MiB


def delta_runs(model: dict, steps: int, warmup: int, work: Path, cache: Path, timeout: float, progress) -> dict:
    configs = write_configs(work)
    counts = {m: trainable_counts(configs[m], model) for m in METHODS}
    rows, baselines = [], {}
    jobs = [(layout, "baseline") for layout in LAYOUTS] + [(layout, m) for layout in LAYOUTS for m in METHODS]
    for i, (layout, method) in enumerate(jobs, 1):
        title, nproc, overrides = LAYOUTS[layout]
        baseline = method == "baseline"
        label = f"{layout}-{method}"
        row = delta_job(label, configs["full" if baseline else method], nproc, overrides,
                        BASELINE_MODEL if baseline else model, 2 if baseline else steps, work, cache, timeout)
        row.update(layout=layout, layout_title=title, method=method)
        if baseline:
            baselines[layout] = row
            msg = f"peak {fmt(row.get('peak_mib'))} MiB"
        else:
            c = counts[method]
            row.update(trainable=c["trainable"], total=c["total"],
                       model_state_mib=model_state_mib(c["trainable"], c["total"], nproc),
                       median_step_ms=median_step_ms(row, warmup))
            base = baselines.get(layout, {})
            for key in ("peak_mib", "train_mib"):
                if row.get(key) is not None and base.get(key) is not None:
                    row[key.replace("_mib", "_above_baseline_mib")] = row[key] - base[key]
            rows.append(row)
            msg = (f"{fmt(row.get('median_step_ms'))} ms/step, checkpoint {fmt((row.get('checkpoint_bytes') or 0) / MiB, ',.1f')} MiB, "
                   f"train peak {fmt(row.get('train_above_baseline_mib'))} MiB above baseline")
        if row["returncode"] != 0:
            msg = f"FAILED (exit {row['returncode']}): {(row.get('error') or '').strip().splitlines()[-1:]}"
        progress(f"[{i}/{len(jobs)}] {title:<11} {method:<8} {msg}  [{row['wall_s']:.0f} s]")
    return {"model": model, "seq_length": MEMORY_SEQ, "micro_batch_size": MICRO_BATCH, "steps": steps,
            "warmup": warmup, "counts": counts, "rows": rows, "baselines": list(baselines.values()),
            "configs": {m: p.read_text() for m, p in configs.items()}}


# ----------------------------------------------------------------------------- transformers + PEFT
def peft_comparison(sizes: dict, steps: int, rounds: int, work: Path, progress) -> dict:
    """The same LoRA step, dufu against transformers + PEFT, on one LLaMA (see the module docstring)."""
    try:
        import peft
        import transformers
    except ImportError as e:
        msg = (f"skipped: {e.name} is not installed (pip install peft transformers torch==<this torch>); the rest "
               "of the benchmark does not need it")
        progress(f"[peft] {msg}")
        return {"skipped": msg}
    import torch

    import dufu
    from dufu.delta import LoRA, LoraLinear, apply_delta
    from dufu.models.llama import LlamaModel

    torch.manual_seed(0)
    ours = LlamaModel(**sizes, hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0)
    ours.init_weights()
    base_dir = work / "peft-base"
    dufu.save_pretrained(ours, base_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa",
                                                               dtype=torch.float32)
    info = apply_delta(ours, LoRA(targets=list(HF_TARGETS), rank=LORA_RANK, alpha=LORA_ALPHA))
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none", target_modules=list(HF_TARGETS.values())))
    # the same starting point: dufu's A factors into PEFT's (both B are zero)
    named = dict(theirs.named_modules())
    with torch.no_grad():
        for name, m in ours.named_modules():
            if isinstance(m, LoraLinear):
                _, i, _, proj = name.split(".")
                other = named[f"base_model.model.model.layers.{i}.self_attn.{HF_TARGETS[proj]}"]
                other.lora_A["default"].weight.copy_(m.lora_A.weight)
    their_trainable = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, sizes["vocab_size"], PEFT_BATCH, generator=g)

    def stepper(model):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
        model.train()

        def step() -> tuple[float, float]:
            t0 = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0, loss.item()

        return step

    def saved_for_backward(model) -> int:
        """Bytes autograd keeps from one forward for its backward: the distinct storages packed by
        saved_tensors_hooks, the model's own parameters left out (they exist anyway)."""
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in own:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        model.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=batch, labels=batch).loss
        del loss
        return sum(seen.values())

    saved = {"dufu": saved_for_backward(ours), "transformers + PEFT": saved_for_backward(theirs)}
    sides = {"dufu": stepper(ours), "transformers + PEFT": stepper(theirs)}
    times = {k: [] for k in sides}
    losses = {k: [] for k in sides}
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            for _ in range(steps):
                dt, loss = sides[name]()
                times[name].append(dt)
                losses[name].append(loss)
    warm = 1  # the first step of each side allocates AdamW's state
    result = {
        "model": sizes, "batch": list(PEFT_BATCH), "rank": LORA_RANK, "alpha": LORA_ALPHA,
        "targets": {"dufu": list(HF_TARGETS), "peft": list(HF_TARGETS.values())},
        "versions": {"transformers": transformers.__version__, "peft": peft.__version__},
        "trainable": {"dufu": info.trainable_count, "transformers + PEFT": their_trainable},
        "total": info.total_count,
        "step_ms": {k: 1000 * statistics.median(v[warm:]) for k, v in times.items()},
        "step_times_s": times, "losses": losses, "saved_for_backward_bytes": saved,
        "max_loss_difference": max(abs(a - b) for a, b in zip(*losses.values())),
    }
    progress("[peft] " + ", ".join(f"{k} {v:,.1f} ms/step" for k, v in result["step_ms"].items())
             + f"; largest loss difference {result['max_loss_difference']:.2e}")
    return result


# ----------------------------------------------------------------------------- report
def mib(x, spec=",.0f") -> str:
    return fmt(None if x is None else x / MiB, spec)


def summary_lines(by: dict) -> list[str]:
    """One sentence per delta against full fine-tuning, from the one-process runs."""
    full, out = by.get(("full", "1proc")), []
    if not full or full["returncode"] != 0:
        return out
    for method in [m for m in METHODS if m != "full"]:
        r = by.get((method, "1proc"))
        if not r or r["returncode"] != 0 or None in (r.get("train_above_baseline_mib"), r.get("median_step_ms")):
            continue
        out.append(f"{method}: {full['checkpoint_bytes'] / r['checkpoint_bytes']:,.0f}x smaller checkpoint; "
                   f"training peak {r['train_above_baseline_mib']:,.0f} vs {full['train_above_baseline_mib']:,.0f} "
                   f"MiB above baseline; step {r['median_step_ms'] / full['median_step_ms']:.2f}x full fine-tuning's "
                   "(one process).")
    return [""] + [f"* {line}" for line in out] if out else out


def report(results: dict) -> str:
    info, runs = results["machine"], results["runs"]
    lines = [f"# Delta tuning: full fine-tuning vs LoRA vs BitFit - {results['date']}", ""]
    lines.append(f"Machine: {info['cpu']}, {info['logical_cpus']} logical CPUs; torch {info['torch']}, Python "
                 f"{info['python']}; {machine.peaks_text(info) or 'peaks not measured'}; load average "
                 f"{results['load_avg_start']} at the start, "
                 f"{results['load_avg_end']} at the end. {'Quick smoke run. ' if results['quick'] else ''}"
                 f"Total {results['total_s']:.0f} s.")
    m = runs["model"]
    lines += ["", f"GPT: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
              f"vocabulary {m['vocab_size']:,}, sequence {runs['seq_length']}; fp32; micro-batch {runs['micro_batch_size']}"
              f" per rank; {runs['steps']} steps, step time = median after {runs['warmup']}; one thread per process. "
              f"LoRA: rank {LORA_RANK}, alpha {LORA_ALPHA} on {', '.join(LORA_TARGETS)}; BitFit: every bias.", ""]
    rows = runs["rows"]
    by = {(r["method"], r["layout"]): r for r in rows}
    full_ckpt = by.get(("full", "1proc"), {}).get("checkpoint_bytes")
    body = []
    for method in METHODS:
        c = runs["counts"][method]
        one, two = by.get((method, "1proc"), {}), by.get((method, "dp2z3"), {})
        size = one.get("checkpoint_bytes")
        body.append([method, f"{c['trainable']:,}", f"{100 * c['trainable'] / c['total']:.2f}%",
                     mib(size, ",.2f"), mib(two.get("checkpoint_bytes"), ",.2f"),
                     f"{full_ckpt / size:,.0f}x" if size and full_ckpt else "-"])
    lines += ["## Trainable parameters and checkpoint size", ""]
    lines += table(["method", "trainable", "share", "checkpoint, 1 process (MiB)", "checkpoint, dp2 ZeRO-3 (MiB)",
                    "smaller than full"], body)
    body = []
    for layout, (title, nproc, _) in LAYOUTS.items():
        for method in METHODS:
            r = by.get((method, layout))
            if r is None:
                continue
            if r["returncode"] != 0:
                body.append([title, method] + ["failed"] * 5)
                continue
            body.append([title, method, fmt(r.get("model_state_mib")), fmt(r.get("train_above_baseline_mib")),
                         fmt(r.get("peak_above_baseline_mib")), fmt(r.get("median_step_ms")),
                         fmt(r.get("trainer_trainable"), ",")])
    base = ", ".join(f"{LAYOUTS[b['layout']][0]} {fmt(b.get('peak_mib'))} MiB" for b in runs["baselines"])
    lines += ["", "## Per-rank peak memory and step time", "",
              f"Peak RSS of the larger rank minus the baseline of its layout ({base}); model states = 4 B per "
              "parameter + 12 B per trainable parameter, / 2 under ZeRO-3.", ""]
    lines += table(["layout", "method", "model states (MiB)", "peak in training (MiB)",
                    "peak incl. build and checkpoint (MiB)", "step (ms)", "trainable (trainer's summary)"], body)
    lines += summary_lines(by)
    p = results.get("peft")
    lines += ["", "## The same LoRA step: dufu vs transformers + PEFT", ""]
    if p is None:
        lines.append("Not run (--no-peft).")
    elif "skipped" in p:
        lines.append(p["skipped"] + ".")
    else:
        s = p["model"]
        lines.append(f"LLaMA: {s['num_layers']} layers, hidden {s['hidden_size']}, {s['num_attention_heads']} heads, "
                     f"SwiGLU {s['ffn_hidden_size']}, vocabulary {s['vocab_size']:,}; batch {p['batch'][0]} x "
                     f"{p['batch'][1]}; LoRA rank {p['rank']}, alpha {p['alpha']} on q, k, v, o; fp32, one thread; "
                     f"forward + backward + fused AdamW; transformers {p['versions']['transformers']}, peft "
                     f"{p['versions']['peft']}. Median of {len(next(iter(p['step_times_s'].values()))) - 1} steps "
                     f"each, in alternating rounds.")
        lines.append("")
        ms = p["step_ms"]
        saved = p.get("saved_for_backward_bytes", {})
        body = [[k, f"{p['trainable'][k]:,}", f"{ms[k]:,.1f}", f"{ms[k] / ms['dufu']:.2f}", mib(saved.get(k), ",.1f")]
                for k in ms]
        lines += table(["implementation", "trainable", "step (ms)", "relative to dufu",
                        "saved for backward (MiB)"], body)
        lines += ["", "Saved for backward: the distinct storages autograd keeps from one forward (saved_tensors_hooks), "
                      "parameters excluded; parameters, gradients and AdamW state are the same on both sides (the "
                      "same base in fp32, the same trainable factors)."]
        lines += ["", f"Losses of the two over the same steps differ by at most {p['max_loss_difference']:.1e} "
                      f"(first {p['losses']['dufu'][0]:.4f})."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: a smaller GPT and LLaMA, 4 steps, 1 round")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 10; quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the step-time median (default 3; quick 1)")
    ap.add_argument("--no-peft", action="store_true", help="skip the transformers + PEFT comparison")
    ap.add_argument("--peft-steps", type=int, default=None, help="steps per side and round (default 5; quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the PEFT timing (default 4; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the PEFT timing (default 1, as the runs)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before one run is stopped")
    ap.add_argument("--results-dir", default=None, help="where to write the results (default benchmarks/results)")
    args = ap.parse_args(argv)
    steps = args.steps or (4 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if warmup >= steps:
        ap.error(f"--warmup {warmup} leaves no timed steps out of --steps {steps}")
    tmp = tempfile.TemporaryDirectory(prefix="dufu-delta-")
    work = Path(tmp.name)
    cache = work / "cache"
    os.environ["DUFU_CACHE_DIR"] = str(cache)  # nothing of this run lands in the user's cache

    def progress(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    results: dict = {"date": results_files.today(), "quick": args.quick, "machine": machine.describe(),
                     "load_avg_start": round(os.getloadavg()[0], 2)}
    try:
        prepare_data_cache()
        results["runs"] = delta_runs(QUICK_MEMORY_MODEL if args.quick else MEMORY_MODEL, steps, warmup, work, cache,
                                     args.timeout, progress)
        if not args.no_peft:
            import torch

            torch.set_num_threads(args.threads)
            results["peft"] = peft_comparison(QUICK_PEFT_LLAMA if args.quick else PEFT_LLAMA,
                                              args.peft_steps or (3 if args.quick else 5),
                                              args.rounds or (1 if args.quick else 4), work, progress)
    finally:
        tmp.cleanup()
    results["total_s"] = time.perf_counter() - t0
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    text = report(results)
    print()
    print(text)
    out = results_files.results_dir(args.results_dir, args.quick)
    if out is not None:
        stem = results_files.write(results_files.stem(out, "delta", results["date"]), results, text)
        print(f"wrote {stem}.json and {stem}.md")
    return 1 if any(r["returncode"] != 0 for r in results["runs"]["rows"] + results["runs"]["baselines"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
