"""One GPT-2-small training step, three ways, side by side in one run: dufu, a plain PyTorch loop, transformers.

    python benchmarks/train_step.py                  # GPT-2 small, batch 4 x sequence 256, fp32 and bf16
    python benchmarks/train_step.py --batch 8 --seq 512 --steps 7
    python benchmarks/train_step.py --quick          # tiny model, smoke run (< 30 s)
    python benchmarks/train_step.py --profile        # also: where the step time goes, by category, per dtype
    python benchmarks/train_step.py --quick --profile --results-dir /tmp/r   # the same on the tiny model

The three implementations train the same architecture (GPT-2 small: 12 layers, hidden 768, 12 heads,
1024 positions, vocab 50,304, tied embeddings, dropout 0) with the same objective, optimizer and clipping:

* ``dufu``  -- the packaged ``gpt2_small`` config, overridden to the benchmark batch (dropout 0, no evaluation,
  no generation, no TensorBoard, output in a temporary directory), turned into a real
  ``dufu.engine.trainer.Trainer``; one step is ``trainer.train_step()`` (it draws its micro-batches from the
  trainer's sampler), exactly what ``Trainer.train`` calls. The model is ``instantiate(cfg.model)`` and the
  optimizer ``cfg.optim`` with ``params=get_default_optimizer_params(model)`` (fused AdamW), both built by the
  trainer itself. The
  config's BPE tokenizer is replaced by the byte tokenizer only to skip training a tokenizer: the model keeps
  its 50,304-token vocabulary, so the step does the same work.
* ``plain`` -- a single-file GPT-2 (benchmarks/train_step_models.py: fused ``c_attn``, SDPA causal attention, tanh
  GELU, tied head) and a hand-written loop: autocast forward, fp32 cross entropy, backward, ``clip_grad_norm_(1.0)``,
  ``AdamW(fused=True)``, ``zero_grad``.
* ``hf``    -- transformers' ``GPT2LMHeadModel`` from a ``GPT2Config`` (all dropouts 0,
  ``attn_implementation="sdpa"``, ``use_cache=False`` because training needs no KV cache) in the same loop.

All three losses are the mean fp32 cross entropy of next-token logits over the same T positions (the ``hf``
loop computes it from ``logits`` rather than through ``labels=``, which would drop the last position).
The plain loops use a constant learning rate where dufu's config warms it up: that changes the numbers of
the update, not its work. ``plain`` and ``hf`` start from a copy of the dufu model's weights, and the script
checks that the three first losses agree before it times anything.

Timing: per dtype phase, every implementation is built fresh, then ``--warmup`` steps each, then ``--steps``
timed steps each, interleaved round robin with the starting implementation rotating from round to round, so
slow drift of a noisy machine hits all three alike. The median step time gives tokens/s. MFU uses dufu's
formula for all three (``dufu.engine.reporting.flops``: ``6 N + 12 L H T`` FLOPs per token, N from
``count_matmul_params`` of the dufu model) and the device peak of ``device_peak_flops(device, dtype)``
(on a CPU the best large-matmul throughput measured during this run: dufu measures at every call and keeps
the best value in ``DUFU_CACHE_DIR``, which is a temporary directory here).

``--profile``: after the timed steps, ``--profile-steps`` more steps of each implementation run under
torch.profiler (CPU activities, shapes not recorded), and the self CPU time of every op is split into matmul,
attention, loss, norms/elementwise, optimizer, casts, communication and other (rules in ``PROFILE_RULES`` of
benchmarks/harness/profile.py, tested in tests/test_benchmarks_profile.py): one table per dtype, implementations
side by side, in ms/step and share.

Results go to ``benchmarks/results/train_step-<YYYY-MM-DD>.json`` and ``.md`` with the machine and its measured
matmul peaks (not for ``--quick`` unless ``--results-dir`` is given).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This checkout's dufu, whatever else is installed (`python benchmarks/x.py` puts benchmarks/ first on the path,
# not the repository).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch
from torch import nn
from torch.profiler import record_function

from dufu.config import LazyConfig, resolve_config_path
from dufu.data import collate
from dufu.data.tokenizer import BYTE_VOCAB_SIZE
from dufu.engine.reporting.flops import count_matmul_params, device_peak_flops, flops_per_token
from dufu.engine.batch import to_model_inputs
from dufu.engine.trainer import Trainer
from harness import machine, proc, results
from harness.profile import (OPTIMIZER_REGION, PROFILE_CATEGORIES, PROFILE_RULES, STEP_REGION,  # noqa: F401
                             categorize, profile_steps, profile_table, step_breakdown, top_other_lines)
from train_step_models import PlainGPT, adamw_groups, build_hf, copy_dufu_weights, lm_loss  # noqa: F401

IMPLS = ("dufu", "plain", "hf")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}

# GPT-2 small, and the tiny model of --quick.
FULL_MODEL = dict(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50304, max_position_embeddings=1024)
QUICK_MODEL = dict(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=50304, max_position_embeddings=128)


# ----------------------------------------------------------------------------- the three runners
class DufuRunner:
    """(a) dufu's own Trainer built from the packaged gpt2_small config."""

    name = "dufu"

    def __init__(self, args, model_size: dict, amp_dtype, workdir: Path):
        cfg = LazyConfig.load(resolve_config_path("gpt2_small"))
        overrides = [f"model.{k}={v}" for k, v in model_size.items()] + [
            "model.embedding_dropout=0.0",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
            "tokenization.tokenizer.kind=byte",
            f"tokenization.tokenizer.vocab_size={BYTE_VOCAB_SIZE}",
            f"dataloader.train.seq_length={args.seq}",
            f"train.train_micro_batch_size={args.batch}",
            f"train.global_batch_size={args.batch}",
            "train.evaluation.enabled=False",
            "train.generation.enabled=False",
            "train.tensorboard=False",
            f"train.output_dir={workdir / 'dufu'}",
            f"train.amp.enabled={amp_dtype is not None}",
            "train.amp.dtype=bf16",
        ]
        LazyConfig.apply_overrides(cfg, overrides)
        self.overrides = overrides
        self.trainer = Trainer(cfg, log=lambda *a, **k: None)
        self.runtime = self.trainer.runtime
        self.model = self.runtime.model
        self.device = self.runtime.device
        self.dataset = self.runtime.train_ds

    def step(self) -> float:
        loss, _grad_norm = self.trainer.train_step()
        return float(loss)  # the step's end, as the hand-written loop's loss.item()

    @torch.no_grad()
    def loss_on(self, batch: torch.Tensor) -> float:
        with self.runtime.autocast():
            return self.model(**to_model_inputs(batch.to(self.device))).loss.item()


class LoopRunner:
    """(b) and (c): a model in a hand-written loop, fed the same token samples as dufu's."""

    def __init__(self, name: str, model: nn.Module, forward_loss, amp_dtype, device, dataset, sampler):
        self.name, self.model, self.forward_loss = name, model.to(device), forward_loss
        self.amp_dtype, self.device, self.dataset, self.sampler = amp_dtype, device, dataset, sampler
        self.optimizer = torch.optim.AdamW(
            adamw_groups(self.model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True
        )

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def step(self) -> float:
        self.model.train()
        (indices,) = self.sampler.next_step()  # one micro-batch: the global batch is the micro batch
        batch = collate(self.dataset, indices).to(self.device, non_blocking=True)  # (B, T + 1)
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) inputs and next-token targets
        with self.autocast():
            loss = self.forward_loss(self.model, x, y)
        loss.backward()
        with record_function(OPTIMIZER_REGION):  # named for --profile (torch adds its own Optimizer.step# too)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    @torch.no_grad()
    def loss_on(self, batch: torch.Tensor) -> float:
        batch = batch.to(self.device)
        with self.autocast():
            return self.forward_loss(self.model, batch[:, :-1], batch[:, 1:]).item()


def plain_forward_loss(model, x, y):
    return model(x, y)


def hf_forward_loss(model, x, y):
    return lm_loss(model(input_ids=x, use_cache=False).logits, y)


# ----------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(runner) -> dict:
    """One step: wall seconds, CPU seconds of this process, and CPU seconds other processes used meanwhile.

    The last one shows whether the step shared the CPUs (this machine may run other jobs): the fraction
    ``others_cpu_s / (wall_s * cpu_count)`` is the share of the machine that was not ours.
    """
    sync(runner.device)
    b0, t0, c0 = proc.system_busy_seconds(), time.perf_counter(), time.process_time()
    loss = runner.step()
    sync(runner.device)
    wall, cpu, b1 = time.perf_counter() - t0, time.process_time() - c0, proc.system_busy_seconds()
    others = max(0.0, (b1 - b0) - cpu) if b0 is not None and b1 is not None else None
    return {"wall": wall, "cpu": cpu, "others": others, "loss": loss}


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def run_phase(args, dtype_name: str, model_size: dict, workdir: Path, log) -> dict:
    """Build the three implementations for one dtype, check they agree, then time them interleaved."""
    amp_dtype = DTYPES[dtype_name]
    dufu = DufuRunner(args, model_size, amp_dtype, workdir / dtype_name)
    device = dufu.device
    # The plain and hf loops read the same samples in the same order as dufu: a copy of its sampler.
    first_batch = collate(dufu.dataset, range(args.batch))
    runners = {"dufu": dufu}
    if "plain" in args.impls:
        plain = PlainGPT(**model_size)
        copy_dufu_weights(dufu.model, plain, "plain")
        runners["plain"] = LoopRunner("plain", plain, plain_forward_loss, amp_dtype, device, dufu.dataset,
                                     copy.deepcopy(dufu.trainer.sampler))
    if "hf" in args.impls:
        hf = build_hf(model_size)
        copy_dufu_weights(dufu.model, hf, "hf")
        runners["hf"] = LoopRunner("hf", hf, hf_forward_loss, amp_dtype, device, dufu.dataset,
                                  copy.deepcopy(dufu.trainer.sampler))
    order = [n for n in IMPLS if n in args.impls]

    # Same architecture, same weights -> the same loss on the same batch, before any update.
    check = {n: runners[n].loss_on(first_batch) for n in order}
    counts = {n: num_params(runners[n].model) for n in order}
    matmul = {n: count_matmul_params(runners[n].model) for n in order}
    log(
        f"[{dtype_name}] parameters " + ", ".join(f"{n} {counts[n]:,}" for n in order)
        + " | first loss " + ", ".join(f"{n} {check[n]:.6f}" for n in order)
    )
    if len(set(counts.values())) != 1 or len(set(matmul.values())) != 1:
        raise SystemExit(f"the implementations differ in size: parameters {counts}, matmul parameters {matmul}")
    tol = 1e-4 if amp_dtype is None else 5e-2
    if any(abs(check[n] - check["dufu"]) > tol for n in order):
        raise SystemExit(f"the implementations disagree on the first loss (tolerance {tol}): {check}")

    for r in range(args.warmup):
        for n in order[r % len(order):] + order[: r % len(order)]:
            m = timed(runners[n])
            log(f"[{dtype_name}] warm-up {r + 1}/{args.warmup} {n:5s} {m['wall']:7.3f} s  loss {m['loss']:.4f}")
    times = {n: [] for n in order}
    cpu_times = {n: [] for n in order}
    busy = {n: [] for n in order}
    ncpu = os.cpu_count() or 1
    losses = {n: [] for n in order}
    for r in range(args.steps):
        for n in order[r % len(order):] + order[: r % len(order)]:
            m = timed(runners[n])
            times[n].append(m["wall"])
            cpu_times[n].append(m["cpu"])
            busy[n].append(None if m["others"] is None else m["others"] / (m["wall"] * ncpu))
            losses[n].append(m["loss"])
            log(f"[{dtype_name}] step {r + 1}/{args.steps}    {n:5s} {m['wall']:7.3f} s  (CPU {m['cpu']:7.3f} s"
                + ("" if busy[n][-1] is None else f", others {100 * busy[n][-1]:3.0f}% of the machine")
                + f")  loss {m['loss']:.4f}")

    profiles = {}
    if args.profile:
        for n in order:
            profiles[n] = profile_steps(runners[n], args.profile_steps, device)
        log(f"\n[{dtype_name}] where a step's time goes: self CPU time of {args.profile_steps} profiled steps per "
            f"implementation, ms/step\n" + profile_table(order, profiles))
        for line in top_other_lines(order, profiles):
            log(line)

    fpt = flops_per_token(
        count_matmul_params(dufu.model), model_size["num_layers"], model_size["hidden_size"], args.seq
    )
    peak, peak_source = device_peak_flops(device, amp_dtype or torch.float32)
    tokens = args.batch * args.seq
    rows = []
    for n in order:
        med = statistics.median(times[n])
        tps = tokens / med
        rows.append({
            "impl": n, "dtype": dtype_name, "median_step_s": med, "min_step_s": min(times[n]),
            "max_step_s": max(times[n]), "tokens_per_s": tps, "mfu": fpt * tps / peak,
            "median_cpu_s": statistics.median(cpu_times[n]),
            "others_share": statistics.median(busy[n]) if None not in busy[n] else None,
            "others_share_per_step": busy[n],
            "step_times_s": times[n], "cpu_times_s": cpu_times[n], "losses": losses[n], "first_loss": check[n],
        })
    overrides = dufu.overrides
    del runners, dufu
    gc.collect()
    return {
        "dtype": dtype_name, "rows": rows, "flops_per_token": fpt, "peak_flops": peak, "peak_source": peak_source,
        "num_params": counts["dufu"], "matmul_params": matmul["dufu"], "device": str(device),
        "dufu_overrides": overrides, "profiles": profiles,
    }


def warm_up_cpu(seconds: float = 1.0) -> None:
    """A second of matmuls so the first peak measurement does not see a cold (clocked-down) core."""
    a = torch.randn(1024, 1024)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a @ a


# ----------------------------------------------------------------------------- reporting
def machine_info() -> dict:
    """The machine (with its fp32 and bf16 matmul peaks, measured now) and the transformers version."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return machine.describe(transformers=tf_version)


def table(phases: list[dict]) -> str:
    lines = [
        "| implementation | dtype | median step (s) | min-max (s) | CPU s/step | other load | tokens/s | MFU | vs plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ph in phases:
        by = {r["impl"]: r for r in ph["rows"]}
        for r in ph["rows"]:
            rel = f"{r['tokens_per_s'] / by['plain']['tokens_per_s']:.3f}x" if "plain" in by else "-"
            lines.append(
                f"| {r['impl']} | {r['dtype']} | {r['median_step_s']:.3f} | "
                f"{r['min_step_s']:.3f}-{r['max_step_s']:.3f} | {r['median_cpu_s']:.2f} | "
                f"{'-' if r['others_share'] is None else format(r['others_share'], '.0%')} | {r['tokens_per_s']:,.0f} | "
                f"{100 * r['mfu']:.1f}% | {rel} |"
            )
    return "\n".join(lines)


COLUMNS = (
    "Median step = median wall time of the timed steps; tokens/s = tokens per step / median step. CPU s/step = "
    "CPU time of the benchmark process per step, all threads. Other load = median share of the machine's CPU "
    "time that other processes used during a step (about 0% on a quiet machine; high values mean the wall "
    "times are inflated by sharing the CPUs). vs plain = tokens/s relative to the plain loop."
)


def verdicts(phases: list[dict], tolerance: float = 0.05) -> list[str]:
    out = []
    for ph in phases:
        by = {r["impl"]: r for r in ph["rows"]}
        if "dufu" in by and "plain" in by:
            ratio = by["dufu"]["tokens_per_s"] / by["plain"]["tokens_per_s"]
            # Sharing the CPUs only ever adds time, so the fastest step is the least disturbed one.
            best = by["plain"]["min_step_s"] / by["dufu"]["min_step_s"]
            ok = ratio >= 1 - tolerance
            out.append(
                f"{ph['dtype']}: dufu runs at {ratio:.3f}x the plain loop's tokens/s (median steps; fastest steps: "
                f"{best:.3f}x) -> {'within' if ok else 'NOT within'} {100 * tolerance:.0f}% of it or faster"
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; --quick: 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 256; --quick: 64)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration (default 2; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 5; --quick: 3)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (bf16 = bf16 autocast)")
    p.add_argument("--impls", default="dufu,plain,hf", help="comma-separated subset of dufu, plain, hf")
    p.add_argument("--quick", action="store_true", help="a tiny 2-layer model: a smoke run of the whole script")
    p.add_argument("--profile", action="store_true",
                   help="also profile a few steps per implementation and dtype and split the step time into "
                        "matmul / attention / loss / norms+elementwise / optimizer / casts / communication / other")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per configuration (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--results-dir", default=None,
                   help="where the dated .json/.md go (default benchmarks/results; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    # dufu's caches (tokenized corpus, measured peak FLOP/s) go to a throw-away directory (dufu reads the variable
    # when it needs a cache, so setting it here is early enough; importing this module changes nothing).
    cache = tempfile.TemporaryDirectory(prefix="dufu-bench-")
    os.environ["DUFU_CACHE_DIR"] = str(Path(cache.name) / "cache")
    q = args.quick
    args.batch = args.batch or (2 if q else 4)
    args.seq = args.seq or (64 if q else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    args.steps = args.steps or (3 if q else 5)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES] + [i for i in args.impls if i not in IMPLS]
    if bad or "dufu" not in args.impls:
        p.error(f"unknown dtype/implementation {bad} (dtypes: {list(DTYPES)}, impls: {list(IMPLS)}; dufu is required)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_size = QUICK_MODEL if q else FULL_MODEL
    if args.seq > model_size["max_position_embeddings"]:
        p.error(f"--seq {args.seq} exceeds the model's {model_size['max_position_embeddings']} positions")
    results_dir = results.results_dir(args.results_dir, q)

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = _dt.datetime.now()
    tokens = args.batch * args.seq
    size = (f"{model_size['num_layers']} layers, hidden {model_size['hidden_size']}, "
            f"{model_size['num_attention_heads']} heads, vocab {model_size['vocab_size']}")
    log(f"train_step benchmark: {'tiny model (--quick)' if q else 'GPT-2 small'} ({size}); batch {args.batch} x "
        f"sequence {args.seq} = {tokens:,} tokens/step; {args.warmup} warm-up + {args.steps} timed steps per "
        f"configuration; torch {torch.__version__}, {torch.get_num_threads()} threads")
    load_start = os.getloadavg()
    if load_start[0] > torch.get_num_threads() + 0.5:
        log(f"warning: the 1-minute load average is {load_start[0]:.1f} with {os.cpu_count()} CPUs; other processes "
            "are competing for them and the step times will be noisy")
    warm_up_cpu()
    # dufu measures the peaks (fp32 and bf16) and keeps the best value seen in DUFU_CACHE_DIR (here this run's
    # temporary directory): the MFU basis of the phases below starts from this measurement.
    info = machine_info()
    phases = []
    with tempfile.TemporaryDirectory(prefix="dufu-bench-run-") as work:
        for d in args.dtypes:
            phases.append(run_phase(args, d, model_size, Path(work), log))
    wall = (_dt.datetime.now() - started).total_seconds()

    info["load_average_at_start"] = [round(x, 2) for x in load_start]
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    tab = table(phases)
    verdict = verdicts(phases)
    if q:
        verdict = [f"{v} (--quick: a smoke run of a tiny model, not a measurement)" for v in verdict]
    peaks = [f"{ph['dtype']}: {ph['peak_source']}" for ph in phases]
    log("")
    log(f"batch {args.batch} x sequence {args.seq} = {tokens:,} tokens/step, median of {args.steps} steps after "
        f"{args.warmup} warm-up steps; {phases[0]['num_params'] / 1e6:.2f}M parameters, "
        f"{phases[0]['flops_per_token'] / 1e6:,.1f} MFLOP/token (6N + 12LHT)")
    log(tab)
    for v in verdict:
        log(v)
    log("MFU peak: " + "; ".join(peaks))
    log(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}, transformers {info['transformers']}; "
        f"{wall:.0f} s; load average (1/5/15 min) {info['load_average_at_start']} at start, "
        f"{info['load_average_at_end']} at end")

    if results_dir is not None:
        stem = results.stem(results_dir, "train_step", f"{started:%Y-%m-%d}")
        cmd = "python benchmarks/train_step.py" + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "")
        payload = {
            "benchmark": "train_step",
            "date": started.isoformat(timespec="seconds"),
            "command": cmd,
            "model": {**model_size, "tie_word_embeddings": True, "dropout": 0.0},
            "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens,
            "warmup_steps": args.warmup, "timed_steps": args.steps,
            "machine": info,
            "phases": phases,
            "profile_rules": PROFILE_RULES if args.profile else None,
            "verdicts": verdict,
            "wall_seconds": wall,
        }
        profile_md = []
        if args.profile:
            profile_md = [f"## Where a step's time goes (`--profile`, {args.profile_steps} profiled steps per "
                          "implementation, after the timed steps)", ""]
            for ph in phases:
                impls = [r["impl"] for r in ph["rows"]]
                profile_md += [f"### {ph['dtype']}", "", profile_table(impls, ph["profiles"]), "",
                               *[f"- {line}" for line in top_other_lines(impls, ph["profiles"])], ""]
            profile_md += ["How events are assigned to categories:", "", PROFILE_RULES, ""]
        md = [
            f"# train_step benchmark, {started:%Y-%m-%d}",
            "",
            f"`{cmd}`",
            "",
            f"One training step (forward, backward, clip, AdamW) of "
            f"{'a tiny GPT (--quick)' if q else 'GPT-2 small'} ({size}, tied embeddings, dropout 0, "
            f"{phases[0]['num_params'] / 1e6:.2f}M parameters): batch {args.batch} x sequence {args.seq} = "
            f"{tokens:,} tokens/step; median of {args.steps} timed steps after {args.warmup} warm-up steps, "
            "implementations interleaved round robin. `dufu` is `Trainer.train_step` on the `gpt2_small` config; "
            "`plain` a single-file PyTorch GPT-2 (fused QKV); `hf` transformers' `GPT2LMHeadModel` (SDPA). "
            "All use fused AdamW, clip 1.0, fp32 cross entropy; bf16 = bf16 autocast.",
            "",
            tab,
            "",
            COLUMNS,
            "",
            *[f"- {v}" for v in verdict],
            "",
            f"MFU = (6N + 12LHT) x tokens/s / peak, {phases[0]['flops_per_token'] / 1e6:,.1f} MFLOP/token for "
            "all three; peak: " + "; ".join(peaks) + ".",
            "",
            *profile_md,
            f"Machine: {info['cpu']} ({', '.join(info['cpu_features']) or 'no AVX-512/AMX'}), "
            f"{info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads; torch {info['torch']}, "
            f"transformers {info['transformers']}, Python {info['python']}; {info['platform']}; "
            f"{machine.peaks_text(info)}. Date {started.isoformat(timespec='seconds')}; the run took {wall:.0f} s. "
            "Load average (1/5/15 min) "
            f"{info['load_average_at_start']} at start, {info['load_average_at_end']} at end (this benchmark alone "
            f"keeps it near the thread count; more means other processes shared the CPUs).",
            "",
        ]
        results.write(stem, payload, "\n".join(md))
        log(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
