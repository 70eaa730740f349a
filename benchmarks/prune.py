"""Structured pruning of a trained GPT, side by side in one run: held-out perplexity, parameters and forward speed
at kept fractions 1.0, 0.75, 0.5 and 0.25 of heads and feed-forward neurons, by magnitude and by first-order
importance, before and after a short fine-tune.

    python benchmarks/prune.py             # full run: ~6 minutes on 2 idle cores
    python benchmarks/prune.py --quick     # smoke run: 20 training steps, 5 fine-tuning steps, 1 timing round
    python benchmarks/prune.py --speed-only  # only the forward throughput of the pruned shapes (~1 minute)

**Model.** The default recipe (``dufu train``: GPT, 4 layers, hidden 256, 4 heads, FFN 1,024, BPE vocabulary
2,048, sequence 128, 400 steps, the machine's fast dtype) trained in this process by dufu's ``Trainer`` into a
temporary ``output_dir``; generation and TensorBoard off, nothing else changed.

**Pruning.** For each importance kind and fraction, ``dufu.cli.prune.prune_run`` (what ``dufu prune RUN
OUT --heads-keep F --ffn-keep F --importance K`` runs) prunes the run's last checkpoint and writes a model
directory; the pruned model is read back from it with ``dufu.engine.weights.pretrained.pretrained_model`` (so every row
also checks the directory loads). Heads and FFN neurons are kept at the same fraction: 4/3/2/1 heads, 1024/768/
512/256 neurons per layer. ``first-order`` takes its gradients on the first 4 x 8 validation samples (the CLI's
default).

**Columns.** Perplexity: exp of the token-mean cross entropy over the validation split *minus* those 32 samples
(so no number is measured on data that chose the units), fp32, batches of 16. Parameters: counted, tied head
once. Forward tokens/s: one forward pass of 16 x 128 tokens without labels (logits only), eval mode, no grad,
in fp32 and under bf16 autocast, median over ``--rounds`` rounds of 5 timed passes (after one warm-up), the
fractions interleaved in every round; the same sizes at a fraction for both importance kinds, so speed is
measured once per fraction. Fine-tuned: ``--finetune-steps`` steps of the Trainer on the pruned directory's own
``config.yaml`` (``model = L(pretrained_model)(path=OUT)``, the run's data and optimizer, lr ``--finetune-lr``
with 5 warm-up steps and cosine decay), then the same perplexity; the unpruned model (fraction 1.0) gets the same
fine-tune as the control for what the extra steps alone do.

``--speed-only`` measures just the forward columns, on the default recipe's GPT with its seeded initial weights
pruned by magnitude (a model's speed depends on its shapes, not its values), with 7 rounds by default: a quick way to
measure them again when the full run's timing phase met a busy machine. It writes ``prune-<date>-speed.md`` and
``.json``.

Results: ``benchmarks/results/prune-<YYYY-MM-DD>.md``, ``.json`` and ``.png`` (perplexity against kept fraction)
with the CPU model; not for ``--quick`` unless ``--results-dir`` is given. Runs and ``DUFU_CACHE_DIR`` live in a
temporary directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness import results as results_files  # noqa: E402
from harness.machine import describe, peaks_text  # noqa: E402

FRACTIONS = (1.0, 0.75, 0.5, 0.25)
KINDS = ("magnitude", "first-order")
IMPORTANCE_SAMPLES = (4, 8)  # batches x samples: dufu prune's defaults
EVAL_BATCH = 16
SPEED_BATCH = 16


def log(msg: str) -> None:
    print(msg, flush=True)


def train_base(work: Path, steps: int) -> tuple[Path, dict, float]:
    from dufu.config import LazyConfig, resolve_config_path
    from dufu.engine.trainer import Trainer

    out = work / "run"
    cfg = LazyConfig.load(str(resolve_config_path("default")))
    LazyConfig.apply_overrides(cfg, [f"train.output_dir={out}", f"train.train_iter={steps}",
                                     "train.generation.enabled=False", "train.tensorboard=False"]
                               + (["train.evaluation.eval_period=10", "train.checkpointer.period=0"]
                                  if steps < 100 else []))
    lines: list[str] = []
    t0 = time.perf_counter()
    summary = Trainer(cfg, log=lines.append).train()
    log(f"trained the default recipe for {steps} steps in {time.perf_counter() - t0:.0f} s")
    return out, summary, time.perf_counter() - t0


def validation_set(run: Path):
    from dufu.config import LazyConfig, instantiate
    from dufu.data import build_tokenizer
    from dufu.engine.preflight import with_kwargs

    cfg = LazyConfig.load(str(run / "config.yaml"))
    tokenizer = build_tokenizer("pretrained", path=run / "tokenizer.json")
    return instantiate(with_kwargs(cfg.dataloader.train, tokenizer=tokenizer))[1]


@torch.no_grad()
def perplexity(model, valid, start: int) -> float:
    """exp(token-mean cross entropy) over validation samples ``start ..`` in fp32."""
    from dufu.data import collate
    from dufu.engine.batch import to_model_inputs

    model.eval()
    total, tokens = 0.0, 0
    for s in range(start, len(valid), EVAL_BATCH):
        inputs = to_model_inputs(collate(valid, list(range(s, min(s + EVAL_BATCH, len(valid))))))
        n = int((inputs["shift_labels"] != -100).sum())
        total += model(**inputs).loss.item() * n
        tokens += n
    return math.exp(total / tokens)


@torch.no_grad()
def forward_speeds(models: dict, ids: torch.Tensor, rounds: int, passes: int = 5) -> dict:
    """{name: {"fp32": tokens/s, "bf16": tokens/s}}: medians of single forward passes, models interleaved."""
    times = {name: {"fp32": [], "bf16": []} for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            model.eval()
            for dtype in ("fp32", "bf16"):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                    model(input_ids=ids)  # warm-up
                    for _ in range(passes):
                        t0 = time.perf_counter()
                        model(input_ids=ids)
                        times[name][dtype].append(time.perf_counter() - t0)
    return {name: {d: ids.numel() / statistics.median(ts) for d, ts in by.items()} for name, by in times.items()}


def finetune(pruned_dir: Path, out: Path, steps: int, lr: float) -> float:
    from dufu.config import LazyConfig
    from dufu.engine.trainer import Trainer

    cfg = LazyConfig.load(str(pruned_dir / "config.yaml"))
    LazyConfig.apply_overrides(cfg, [f"train.output_dir={out}", f"train.train_iter={steps}",
                                     "train.scheduler.warmup_iter=5", f"optim.lr={lr}",
                                     "train.evaluation.enabled=False", "train.checkpointer.period=0",
                                     "train.generation.enabled=False", "train.tensorboard=False"])
    t0 = time.perf_counter()
    Trainer(cfg, log=lambda *a: None).train()
    return time.perf_counter() - t0


def speed_only(rounds: int, results_dir) -> None:
    from dufu.compress.prune import count_parameters, prune_model
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path("default")))
    torch.manual_seed(cfg.train.seed)
    base = instantiate(cfg.model).eval()
    models = {f: prune_model(base, f, f)[0] for f in FRACTIONS}
    ids = torch.randint(0, cfg.model.vocab_size, (SPEED_BATCH, cfg.dataloader.train.seq_length),
                        generator=torch.Generator().manual_seed(0))
    load_start = os.getloadavg()[0]
    info = describe()
    speeds = forward_speeds(models, ids, rounds)
    machine = {**info, "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0]}
    date = results_files.today()
    rows = [{"fraction": f, "params": count_parameters(m), "heads": m.num_attention_heads,
             "ffn": m.blocks["0"].mlp.fc1.out_features, "tokens_per_s": speeds[f]} for f, m in models.items()]
    first = rows[0]["tokens_per_s"]
    lines = [f"# Forward throughput of the pruned default GPT - {date}", "",
             f"Machine: {machine['cpu']}, {machine['torch_threads']} threads, torch {machine['torch']}; "
             f"{peaks_text(machine)}; load average {machine['load_avg_start']:.2f} at the start, "
             f"{machine['load_avg_end']:.2f} at the end. Command: "
             f"`python benchmarks/prune.py --speed-only --rounds {rounds}`. One forward pass of "
             f"{SPEED_BATCH} x {ids.shape[1]} tokens, logits only, median of {rounds} x 5 passes, fractions "
             "interleaved.", "",
             "| kept | heads | FFN | parameters | forward tok/s fp32 | bf16 | speed-up fp32 | bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["tokens_per_s"]
        lines.append(f"| {r['fraction']:.2f} | {r['heads']} | {r['ffn']} | {r['params']:,} | {s['fp32']:,.0f} | "
                     f"{s['bf16']:,.0f} | {s['fp32'] / first['fp32']:.2f}x | {s['bf16'] / first['bf16']:.2f}x |")
    log("\n".join(lines))
    if results_dir is not None:
        stem = results_files.write(results_files.stem(results_dir, "prune", date, "speed"),
                                   {"date": date, "machine": machine, "rows": rows}, "\n".join(lines))
        log(f"wrote {stem}.md and .json")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"magnitude": ("tab:blue", "o"), "first-order": ("tab:red", "s")}
    for kind in KINDS:
        color, marker = styles[kind]
        mine = sorted((r for r in rows if r["importance"] == kind), key=lambda r: -r["fraction"])
        xs = [r["fraction"] for r in mine]
        ax.plot(xs, [r["ppl"] for r in mine], marker=marker, color=color, label=f"{kind}, pruned")
        if all(r.get("ppl_finetuned") for r in mine):
            ax.plot(xs, [r["ppl_finetuned"] for r in mine], marker=marker, color=color, linestyle="--",
                    label=f"{kind}, + fine-tune")
    ax.set_xlabel("kept fraction of heads and FFN neurons")
    ax.set_ylabel("validation perplexity (log scale)")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xticks(FRACTIONS)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 training steps, 5 fine-tuning steps, 1 timing round")
    ap.add_argument("--steps", type=int, default=400, help="training steps of the base model (the recipe's 400)")
    ap.add_argument("--finetune-steps", type=int, default=50)
    ap.add_argument("--finetune-lr", type=float, default=1e-3)
    ap.add_argument("--rounds", type=int, default=None,
                    help="timing rounds of the forward passes (default 3; --speed-only: 7)")
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--speed-only", action="store_true", help="only the forward throughput of the pruned shapes")
    args = ap.parse_args()
    if args.speed_only:
        return speed_only(args.rounds or 7, args.results_dir or results_files.RESULTS)
    args.rounds = args.rounds or 3
    if args.quick:
        args.steps, args.finetune_steps, args.rounds = 20, 5, 1
    results_dir = results_files.results_dir(args.results_dir, args.quick)

    from dufu.compress.prune import count_parameters
    from dufu.engine.weights.pretrained import pretrained_model
    from dufu.cli.prune import prune_run

    load_start = os.getloadavg()[0]
    info = describe()
    with tempfile.TemporaryDirectory(prefix="dufu-prune-bench-") as tmp:
        work = Path(tmp)
        os.environ["DUFU_CACHE_DIR"] = str(work / "cache")
        run, summary, train_s = train_base(work, args.steps)
        valid = validation_set(run)
        held_out = IMPORTANCE_SAMPLES[0] * IMPORTANCE_SAMPLES[1]  # the samples first-order importance reads
        rows, models = [], {}
        for kind in KINDS:
            for f in FRACTIONS:
                out = work / f"pruned-{kind}-{f}"
                t0 = time.perf_counter()
                prune_run(run, out, f, f, kind, num_batches=IMPORTANCE_SAMPLES[0], batch_size=IMPORTANCE_SAMPLES[1])
                prune_s = time.perf_counter() - t0
                model = pretrained_model(out).eval()
                record = json.loads((out / "prune.json").read_text())
                row = {"importance": kind, "fraction": f, "dir": out, "prune_s": prune_s,
                       "heads": record["after"]["num_attention_heads"], "ffn": record["after"]["ffn_hidden_size"],
                       "params": count_parameters(model), "ppl": perplexity(model, valid, held_out)}
                assert row["params"] == record["after"]["parameters"]
                models.setdefault(f, model)
                rows.append(row)
                log(f"{kind:11s} keep {f:4.2f}: heads {row['heads']}, ffn {row['ffn']:4d}, {row['params']:,} "
                    f"parameters, perplexity {row['ppl']:8.1f}  (pruned in {prune_s:.2f} s)")
        ids = torch.stack([torch.as_tensor(valid[held_out + i][:-1], dtype=torch.long) for i in range(SPEED_BATCH)])
        speeds = forward_speeds(models, ids, args.rounds)
        for r in rows:
            r["tokens_per_s"] = speeds[r["fraction"]]
        finetuned = {}
        if args.finetune_steps:
            for r in rows:
                key = "unpruned" if r["fraction"] == 1.0 else (r["importance"], r["fraction"])
                if key not in finetuned:
                    out = work / f"ft-{r['importance']}-{r['fraction']}"
                    seconds = finetune(r["dir"], out, args.finetune_steps, args.finetune_lr)
                    finetuned[key] = (perplexity(pretrained_model(out).eval(), valid, held_out), seconds)
                    log(f"{r['importance']:11s} keep {r['fraction']:4.2f}: after {args.finetune_steps} fine-tuning "
                        f"steps ({seconds:.0f} s) perplexity {finetuned[key][0]:8.1f}")
                r["ppl_finetuned"], r["finetune_s"] = finetuned[key]
        for r in rows:
            r["dir"] = str(r["dir"].name)
    load_end = os.getloadavg()[0]

    date = results_files.today()
    machine = {**info, "load_avg_start": load_start, "load_avg_end": load_end}
    base = next(r for r in rows if r["fraction"] == 1.0)
    speed1 = base["tokens_per_s"]
    data = {"date": date, "machine": machine, "quick": args.quick, "train_steps": args.steps,
            "train_seconds": train_s, "run_eval_ppl_end": summary.get("eval_ppl_end") if isinstance(summary, dict)
            else None, "finetune_steps": args.finetune_steps, "finetune_lr": args.finetune_lr,
            "importance_samples": held_out, "eval_samples": len(valid) - held_out, "rows": rows}
    lines = [
        f"# Structured pruning of the default GPT - {date}", "",
        f"Machine: {machine['cpu']}, {machine['torch_threads']} threads, torch {machine['torch']}; "
        f"{peaks_text(machine)}; load average {load_start:.2f} at the start, {load_end:.2f} at the end. Command: "
        "`python benchmarks/prune.py"
        f"{' --quick' if args.quick else ''}`.", "",
        f"Base model: the default recipe (GPT, 4 layers, hidden 256, 4 heads of 64, FFN 1,024, vocabulary 2,048) "
        f"trained {args.steps} steps by the Trainer ({train_s:.0f} s). Each row: `prune_run` (= `dufu prune`) with "
        f"heads and FFN neurons kept at the same fraction, read back from its directory. Perplexity on "
        f"{len(valid) - held_out} validation samples of 128 tokens (the first {held_out}, which first-order "
        f"importance reads, left out), fp32. Forward: 16 x 128 tokens, logits only, median of "
        f"{args.rounds} x 5 passes. Fine-tune: {args.finetune_steps} Trainer steps from the pruned directory's "
        f"config.yaml at lr {args.finetune_lr:g}.", "",
        "| importance | kept | heads | FFN | parameters | perplexity | + fine-tune | forward tok/s fp32 | bf16 | "
        "speed-up fp32 | bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ft = f"{r['ppl_finetuned']:.1f}" if r.get("ppl_finetuned") else "-"
        s = r["tokens_per_s"]
        lines.append(f"| {r['importance']} | {r['fraction']:.2f} | {r['heads']} | {r['ffn']} | {r['params']:,} | "
                     f"{r['ppl']:.1f} | {ft} | {s['fp32']:,.0f} | {s['bf16']:,.0f} | "
                     f"{s['fp32'] / speed1['fp32']:.2f}x | {s['bf16'] / speed1['bf16']:.2f}x |")
    log("\n".join(lines))
    if results_dir is not None:
        stem = results_files.write(results_files.stem(results_dir, "prune", date), data, "\n".join(lines) + (
            f"\n\n![perplexity against kept fraction](prune-{date}.png)"))
        plot(rows, stem.with_suffix(".png"), f"default GPT, {args.steps} steps; fine-tune {args.finetune_steps} steps")
        log(f"wrote {stem}.md, .json and .png")


if __name__ == "__main__":
    main()
