"""Packed vs padded supervised fine-tuning: useful (non-padding) tokens per second of ``llama_sft``, side by side.

    python benchmarks/packing.py                       # seq_length 512, 1024 and 2048, 12 timed steps each way
    python benchmarks/packing.py --seq-lengths 1024 --steps 20
    python benchmarks/packing.py --quick               # a smoke run (seconds), writes nothing unless --results-dir

The recipe ``llama_sft`` as it trains (its model sizes, fp32, micro-batch = global batch of 4 rows, AdamW with its
settings, the sampler order of its seed) on its data, the built-in prompt/response pairs (byte tokenizer), read
two ways from the same records:

* ``padded`` -- ``build_sft_datasets(packing=False)``: one sample per row of ``seq_length``, right-padded;
* ``packed`` -- ``build_sft_datasets(packing=True)``: several samples per row, best-fit in dataset order, with
  position ids restarting per sample, so the attention is block-causal (``dufu.layers.attention.document_mask``).

The recipe's own ``seq_length`` (32, llama_debug's positions) cuts every one of these samples to fit, so nothing
would be padded; the sequence lengths here are the ones the records need (102-642 tokens), with
``model.max_position_embeddings`` raised to match. The weights are llama_debug's initialisation (speed does not
depend on their values).

A step is what the trainer does: collate the rows, forward, loss, backward, AdamW step. Per sequence length
both variants are built, take ``--warmup`` untimed steps, then ``--steps`` timed steps each, interleaved round
robin with the starting variant alternating (a busy machine's drift hits both alike). Reported per variant: rows
and samples per epoch, the padding share of the epoch's rows and of the timed steps' rows, median step time, and
useful tokens per second = real (non-padding) input positions of the timed steps / their summed wall time;
the speed-up is packed / padded useful tokens per second. Also recorded: the share of the machine other
processes used during the timed steps (from /proc/stat), the CPU model and threads.

A second part (``--attention``, on by default) times the attention kernels a packed row can run on, the choice
``dufu.layers.attention.document_mask`` explains: SDPA with ``is_causal`` (what an unpacked row runs: the
baseline), SDPA with the boolean block-causal mask (what dufu passes), SDPA with the same mask as an additive
float bias built from it (the alternative, its construction included, as a layer would pay it), and
FlexAttention with a block mask (``torch.compile``-d; its first call, the ``create_block_mask`` and the forward
timed apart; whether its backward runs on this device is recorded). Forward + backward of q, k, v (B, nh, T, hs)
with three documents per row, variants interleaved round robin, median and minimum of ``--attention-reps``.

Results go to ``benchmarks/results/packing-<YYYY-MM-DD>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dufu.config import LazyConfig, instantiate, resolve_config_path  # noqa: E402
from dufu.data import ResumableBatchSampler, collate  # noqa: E402
from dufu.data.sft import build_sft_datasets  # noqa: E402
from dufu.engine.batch import to_model_inputs  # noqa: E402
from harness import machine, proc, results as results_files  # noqa: E402

RECIPE = "llama_sft"
VARIANTS = ("padded", "packed")


class Variant:
    """One way of reading the data, with its own model (same initial weights), optimizer and sampler."""

    def __init__(self, cfg, tokenizer, seq_length: int, packing: bool):
        data = {k: v for k, v in cfg.dataloader.train.items() if k != "_target_"}
        data.update(seq_length=seq_length, packing=packing)
        self.train_ds, _ = build_sft_datasets(tokenizer=tokenizer, **data)
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.update(max_position_embeddings=seq_length, pretrained=None)
        torch.manual_seed(cfg.train.seed)
        self.model = instantiate(model_cfg).train()
        optim_cfg = copy.deepcopy(cfg.optim)
        optim_cfg.params.model = self.model
        self.optimizer = instantiate(optim_cfg)
        micro = cfg.train.train_micro_batch_size
        self.sampler = ResumableBatchSampler(len(self.train_ds), cfg.train.global_batch_size or micro, micro,
                                             seed=cfg.train.seed)
        self.seq_length = seq_length
        # real positions of each row: a padded sample's input length, or the samples packed in a row
        if packing:
            self.real = [sum(n for _, _, n in self.train_ds.spans(r)) for r in range(len(self.train_ds))]
            self.samples = self.train_ds.num_samples
        else:
            self.real = [int(n) for n in self.train_ds.input_lengths]
            self.samples = len(self.train_ds)

    def step(self) -> dict:
        b0, t0, c0 = proc.system_busy_seconds(), time.perf_counter(), time.process_time()
        micro_batches = self.sampler.next_step()
        real = positions = 0
        loss = 0.0
        for indices in micro_batches:
            inputs = to_model_inputs(collate(self.train_ds, indices))
            out = self.model(**inputs).loss / len(micro_batches)
            out.backward()
            loss += out.item()
            real += sum(self.real[i] for i in indices)
            positions += len(indices) * self.seq_length
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        wall, cpu, b1 = time.perf_counter() - t0, time.process_time() - c0, proc.system_busy_seconds()
        others = proc.other_load(b0, b1, cpu, wall)
        return {"wall": wall, "cpu": cpu, "others": others, "real": real, "positions": positions, "loss": loss}


def measure(cfg, tokenizer, seq_length: int, warmup: int, steps: int) -> dict:
    variants = {v: Variant(cfg, tokenizer, seq_length, packing=v == "packed") for v in VARIANTS}
    for _ in range(warmup):
        for v in VARIANTS:
            variants[v].step()
    runs = {v: [] for v in VARIANTS}
    for i in range(steps):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            runs[v].append(variants[v].step())
    out = {}
    for v, var in variants.items():
        r = runs[v]
        wall = sum(x["wall"] for x in r)
        real, positions = sum(x["real"] for x in r), sum(x["positions"] for x in r)
        others = [x["others"] for x in r if x["others"] is not None]
        out[v] = {
            "rows_per_epoch": len(var.train_ds), "samples_per_epoch": var.samples,
            "epoch_padding_share": 1 - sum(var.real) / (len(var.train_ds) * seq_length),
            "timed_padding_share": 1 - real / positions,
            "median_step_s": statistics.median(x["wall"] for x in r), "step_times_s": [x["wall"] for x in r],
            "median_step_cpu_s": statistics.median(x["cpu"] for x in r),
            "useful_tokens": real, "positions": positions, "seconds": wall,
            "useful_tokens_per_s": real / wall, "tokens_per_s": positions / wall,
            "others_share": statistics.median(others) if others else None,
        }
    out["speedup"] = out["packed"]["useful_tokens_per_s"] / out["padded"]["useful_tokens_per_s"]
    return out


ATTENTION_SHAPES = [(4, 4, 1024, 16), (4, 12, 512, 64), (1, 12, 2048, 64)]  # (B, nh, T, hs): llama_sft's first


def attention_kernels(shape: tuple, reps: int, flex: bool) -> dict:
    """Median / minimum ms of forward + backward per SDPA variant on a row of three documents; FlexAttention."""
    import torch.nn.functional as F

    B, nh, T, hs = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, nh, T, hs, generator=g).requires_grad_() for _ in range(3))
    lengths = [T // 3, T // 4, T - T // 3 - T // 4]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])  # (T,)
    keep = ((doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[None, None]  # (1, 1, T, T)

    def additive():
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    cases = {"sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "sdpa_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
             "sdpa_additive_mask": additive}
    times = {c: [] for c in cases}
    for fn in cases.values():
        fn().sum().backward()
    for r in range(reps):
        for c in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            t0 = time.perf_counter()
            cases[c]().sum().backward()
            times[c].append(time.perf_counter() - t0)
    out = {c: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)} for c, t in times.items()}
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        t0 = time.perf_counter()
        block = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, T, T, device="cpu")
        made = time.perf_counter() - t0
        torch._dynamo.reset()  # a graph compiled for another shape would be recompiled with dynamic shapes: slower
        fn = torch.compile(flex_attention)
        qd, kd, vd = (x.detach() for x in (q, k, v))
        t0 = time.perf_counter()
        fn(qd, kd, vd, block_mask=block)
        first = time.perf_counter() - t0
        fwd = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(qd, kd, vd, block_mask=block)
            fwd.append(time.perf_counter() - t0)
        try:
            fn(q, k, v, block_mask=block).sum().backward()
            backward = "runs"
        except Exception as e:  # torch 2.13 on a CPU: NotImplementedError
            backward = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        sdpa_fwd = []
        with torch.no_grad():
            for _ in range(reps):
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(qd, kd, vd, attn_mask=keep)
                sdpa_fwd.append(time.perf_counter() - t0)
        out["flex"] = {"create_block_mask_ms": 1e3 * made, "first_call_ms": 1e3 * first,
                       "forward_median_ms": 1e3 * statistics.median(fwd), "backward": backward,
                       "sdpa_bool_forward_median_ms": 1e3 * statistics.median(sdpa_fwd)}
    return out


def attention_table(rows: dict) -> str:
    lines = ["| (B, nh, T, hs) | SDPA causal (unpacked) | SDPA bool mask (dufu) | SDPA additive mask, built | "
             "Flex: forward / SDPA bool forward | Flex: first call, block mask | Flex backward |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for shape, r in rows.items():
        cells = [f"{r[c]['median_ms']:,.1f} ms (min {r[c]['min_ms']:,.1f})"
                 for c in ("sdpa_causal", "sdpa_bool_mask", "sdpa_additive_mask")]
        f = r.get("flex")
        flex = ([f"{f['forward_median_ms']:,.1f} / {f['sdpa_bool_forward_median_ms']:,.1f} ms",
                 f"{f['first_call_ms']:,.0f} ms, {f['create_block_mask_ms']:,.0f} ms", f["backward"]]
                if f else ["-", "-", "-"])
        lines.append(f"| {shape} | " + " | ".join(cells + flex) + " |")
    return "\n".join(lines)


def table(results: dict) -> str:
    lines = ["| seq_length | data | rows (samples) per epoch | padding, epoch | padding, timed steps | median step "
             "| useful tokens/s | all tokens/s | other load | packed / padded |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seq, res in results.items():
        for v in VARIANTS:
            r = res[v]
            others = f"{r['others_share']:.0%}" if r["others_share"] is not None else "-"
            ratio = f"**{res['speedup']:.2f}x**" if v == "packed" else ""
            lines.append(f"| {seq} | {v} | {r['rows_per_epoch']} ({r['samples_per_epoch']}) "
                         f"| {r['epoch_padding_share']:.1%} | {r['timed_padding_share']:.1%} "
                         f"| {1e3 * r['median_step_s']:,.0f} ms | {r['useful_tokens_per_s']:,.0f} "
                         f"| {r['tokens_per_s']:,.0f} | {others} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lengths", default="512,1024,2048", help="comma-separated sequence lengths")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (default 2)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant (default 12)")
    p.add_argument("--attention", default=True, action=argparse.BooleanOptionalAction,
                   help="also time the attention kernels (default on; --no-attention skips them)")
    p.add_argument("--attention-reps", type=int, default=15, help="timed calls per attention variant (default 15)")
    p.add_argument("--quick", action="store_true",
                   help="seq_length 256, 1 + 2 steps, one small attention shape without FlexAttention: a smoke run")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--results-dir", default=None,
                   help="where the dated .json/.md go (default benchmarks/results; --quick writes nothing unless given)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seqs = [256] if args.quick else [int(s) for s in args.seq_lengths.split(",") if s.strip()]
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    results_dir = results_files.results_dir(args.results_dir, args.quick)

    cfg = LazyConfig.load(resolve_config_path(RECIPE))
    tokenizer = instantiate(cfg.tokenization.tokenizer)
    started = _dt.datetime.now()
    info = machine.describe()
    load_start = os.getloadavg()
    print(f"packing benchmark: {RECIPE}, {info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}",
          flush=True)
    results = {}
    for seq in seqs:
        results[seq] = measure(cfg, tokenizer, seq, warmup, steps)
        for v in VARIANTS:
            r = results[seq][v]
            print(f"seq {seq:5d} {v:6s}: padding {r['timed_padding_share']:6.1%}, median step "
                  f"{1e3 * r['median_step_s']:8.1f} ms, {r['useful_tokens_per_s']:9,.0f} useful tokens/s", flush=True)
        print(f"seq {seq:5d} packed / padded useful tokens/s: {results[seq]['speedup']:.2f}x", flush=True)
    kernels = {}
    if args.attention:
        for shape in ([(2, 4, 128, 16)] if args.quick else ATTENTION_SHAPES):
            kernels[str(shape)] = attention_kernels(shape, 3 if args.quick else args.attention_reps, not args.quick)
            r = kernels[str(shape)]
            print(f"attention {shape}: " + ", ".join(f"{c} {r[c]['median_ms']:.1f} ms" for c in
                                                   ("sdpa_causal", "sdpa_bool_mask", "sdpa_additive_mask")), flush=True)
    wall = (_dt.datetime.now() - started).total_seconds()
    info["load_average_at_start"] = [round(x, 2) for x in load_start]
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    tab = table(results)
    print("\n" + tab)
    if kernels:
        print("\n" + attention_table(kernels))
    if results_dir is None:
        return 0
    stem = results_files.stem(results_dir, "packing", f"{started:%Y-%m-%d}")
    cmd = "python benchmarks/packing.py" + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "")
    m = cfg.model
    shape = (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} query / "
             f"{m.num_key_value_heads} key-value heads, vocabulary {m.vocab_size}")
    micro = cfg.train.train_micro_batch_size
    payload = {"benchmark": "packing", "recipe": RECIPE, "date": started.isoformat(timespec="seconds"),
               "command": cmd, "model": shape, "micro_batch": micro, "warmup": warmup, "steps": steps,
               "machine": info, "seconds": round(wall, 1), "results": {str(k): v for k, v in results.items()},
               "attention": kernels}
    best = max(results, key=lambda s: results[s]["speedup"])
    md = [f"# packing benchmark, {started:%Y-%m-%d}", "", f"`{cmd}`", "",
          f"`{RECIPE}` ({shape}; fp32; {micro} rows per step; AdamW) on the built-in prompt/response pairs, "
          "`padded` (one sample per row) vs `packed` (`dataloader.train.packing=True`: several samples per row, "
          "best-fit in dataset order, block-causal attention from restarting position ids), the same records, "
          f"{warmup} warm-up + {steps} timed steps each, interleaved (see the docstring of benchmarks/packing.py).",
          "", tab, "",
          "useful tokens/s = real (non-padding) input positions of the timed steps / their wall time; all tokens/s "
          "counts the padding too; other load = median share of the machine's CPU time other processes used during "
          "a step.", "",
          f"- Headline: at seq_length {best}, packing trains {results[best]['speedup']:.2f}x the useful tokens per "
          f"second of padding ({results[best]['packed']['useful_tokens_per_s']:,.0f} vs "
          f"{results[best]['padded']['useful_tokens_per_s']:,.0f}); the padding share falls from "
          f"{results[best]['padded']['epoch_padding_share']:.0%} to {results[best]['packed']['epoch_padding_share']:.0%} "
          "of the epoch's rows."]
    for seq, res in results.items():
        cost = res["packed"]["tokens_per_s"] / res["padded"]["tokens_per_s"]
        md.append(f"- seq_length {seq}: {res['speedup']:.2f}x useful tokens/s; an epoch is "
                  f"{res['packed']['rows_per_epoch']} packed rows instead of {res['padded']['rows_per_epoch']}; "
                  f"all positions (padding included) run at {cost:.2f}x the padded rate (the block-causal mask's cost "
                  "against plain causal attention, plus noise)")
    if kernels:
        md += ["", "## Attention kernels on a packed row", "",
               "Forward + backward of q, k, v (B, nh, T, hs) fp32, three documents per row, variants interleaved "
               f"round robin, median (and minimum) of {3 if args.quick else args.attention_reps} calls. FlexAttention "
               "compiled (`torch.compile(flex_attention)`), forward only where its backward does not run.", "",
               attention_table(kernels)]
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
