"""Activation checkpointing: memory kept for backward and fwd+bwd time, none / selective / full, side by side.

    python benchmarks/activation_checkpoint.py             # default recipe's model + GPT-2-small block stack
    python benchmarks/activation_checkpoint.py --quick     # tiny shapes, smoke run (~15 s)

Two models, each in fp32 and under bf16 autocast, each with the three modes of
``dufu.parallel.activation_checkpoint.apply_activation_checkpointing`` (none = no checkpointing):

* ``default``    -- the model of ``dufu/configs/default.py`` (GPT, 4 layers, hidden 256, vocab 2048) on its training
  batch (micro batch 16 x sequence 128), forward with the loss, then backward;
* ``gpt2_small`` -- a stack of 12 GPT-2-small blocks (hidden 768, 12 heads, MLP 3072; no embeddings or head) on a
  (4, 256, 768) input (benchmarks/train_step.py's batch), loss = mean of squares of the output.

Memory: the bytes the forward pass leaves alive for backward, counted as unique storages created by the forward's
ops that are still referenced once it returns (``LiveActivations``; parameters, inputs and the output itself
excluded). The column ``outer saved_tensors_hooks`` is what an autograd ``saved_tensors_hooks`` around the whole
forward sees (unique storages, same exclusions): equal for none, but for checkpointed blocks it only sees their
inputs - the recomputed region installs hooks of its own and selective checkpointing keeps its saved outputs in
its own cache - which is why the first column is the measurement.

Time: the median wall time of fwd+bwd over ``--reps`` repetitions after one warm-up, the modes interleaved round
robin (so drift of a shared machine hits all alike), ``--threads`` torch threads (default 1); gradients of every
mode are checked against none's.

Results go to ``benchmarks/results/activation_checkpoint-<YYYY-MM-DD>.{md,json}`` (``--quick``: only with
``--results-dir``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dufu.layers import TransformerLayer  # noqa: E402
from dufu.parallel.activation_checkpoint import LiveActivations, apply_activation_checkpointing  # noqa: E402
from harness import machine, results as results_files  # noqa: E402

MODES = ("none", "selective", "full")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- models
class BlockStack(nn.Module):
    """GPT-2-shaped transformer blocks only (``blocks`` keyed by str(i), as dufu models keep them)."""

    def __init__(self, num_layers: int, hidden: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): TransformerLayer(hidden, heads, 4 * hidden, layer_idx=i)
                                     for i in range(num_layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def default_recipe_case(quick: bool):
    """(model, inputs, loss_fn, description) for the default recipe's model on its micro-batch."""
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(str(resolve_config_path("default")))
    if quick:
        cfg.model.update(num_layers=2, hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    batch, seq = cfg.train.train_micro_batch_size, cfg.dataloader.train.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    m = cfg.model
    desc = (f"default recipe model: GPT, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads, vocab {m.vocab_size}; batch {batch} x sequence {seq}, forward with the LM loss")

    def loss_fn(model):
        return model(tokens[:, :-1], shift_labels=tokens[:, 1:]).loss

    return model, loss_fn, [], desc, batch * seq, m.hidden_size, m.num_layers


def gpt2_stack_case(quick: bool):
    layers, hidden, heads, batch, seq = (2, 128, 4, 2, 128) if quick else (12, 768, 12, 4, 256)
    torch.manual_seed(0)
    model = BlockStack(layers, hidden, heads)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
    desc = (f"GPT-2-small-shaped block stack: {layers} blocks, hidden {hidden}, {heads} heads, MLP {4 * hidden}; "
            f"input ({batch}, {seq}, {hidden}), loss = mean of squares")

    def loss_fn(model):
        return model(x).float().square().mean()

    return model, loss_fn, [x], desc, batch * seq, hidden, layers


CASES = {"default": default_recipe_case, "gpt2_small": gpt2_stack_case}


# ----------------------------------------------------------------------------- measuring
def outer_hook_bytes(fn, exclude) -> int:
    """Unique storages an autograd saved_tensors_hooks around ``fn`` sees being saved."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def measure_memory(model, loss_fn, inputs, dtype) -> dict:
    exclude = [*model.parameters(), *model.buffers(), *inputs]
    with autocast(dtype), LiveActivations(exclude=exclude) as live:
        loss = loss_fn(model)
    alive = live.alive_bytes(exclude=[loss])
    loss.backward()
    model.zero_grad(set_to_none=True)
    with autocast(dtype):
        loss, outer = outer_hook_bytes(lambda: loss_fn(model), exclude + [])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"alive_bytes": alive, "outer_hook_bytes": outer}


def fwd_bwd(model, loss_fn, inputs, dtype) -> float:
    for t in inputs:
        t.grad = None
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with autocast(dtype):
        loss = loss_fn(model)
    loss.backward()
    return time.perf_counter() - t0


def grads(model, inputs) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()] + [t.grad.detach().clone() for t in inputs]


def run_case(name: str, args, log) -> list[dict]:
    base, loss_fn, inputs, desc, tokens, hidden, layers = CASES[name](args.quick)
    log(f"== {name}: {desc}")
    models = {}
    for mode in MODES:
        models[mode] = copy.deepcopy(base)
        if mode != "none":
            apply_activation_checkpointing(models[mode], mode)
    rows = []
    for dtype_name, dtype in DTYPES.items():
        mem, ref_grads, max_diff = {}, None, {}
        for mode in MODES:
            mem[mode] = measure_memory(models[mode], loss_fn, inputs, dtype)
            fwd_bwd(models[mode], loss_fn, inputs, dtype)  # warm-up, and the gradients to compare
            g = grads(models[mode], inputs)
            ref_grads = g if mode == "none" else ref_grads
            max_diff[mode] = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, ref_grads))
        times = {mode: [] for mode in MODES}
        for r in range(args.reps):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                times[mode].append(fwd_bwd(models[mode], loss_fn, inputs, dtype))
        none_t = statistics.median(times["none"])
        for mode in MODES:
            med = statistics.median(times[mode])
            alive = mem[mode]["alive_bytes"]
            row = {"model": name, "dtype": dtype_name, "mode": mode, "alive_bytes": alive,
                   "outer_hook_bytes": mem[mode]["outer_hook_bytes"],
                   "alive_vs_none": alive / mem["none"]["alive_bytes"],
                   "values_per_token_per_layer_over_hidden":
                       alive / (tokens * layers * hidden * (2 if dtype is not None else 4)),
                   "median_s": med, "min_s": min(times[mode]), "max_s": max(times[mode]),
                   "time_vs_none": med / none_t, "max_grad_diff_vs_none": max_diff[mode], "description": desc}
            rows.append(row)
            log(f"  {dtype_name:4s} {mode:9s} kept {alive / 2**20:8.2f} MiB ({row['alive_vs_none']:.2f}x none), "
                f"outer hooks {row['outer_hook_bytes'] / 2**20:8.2f} MiB, fwd+bwd {med:.3f} s "
                f"({row['time_vs_none']:.2f}x), grad diff {max_diff[mode]:.1e}")
    return rows


# ----------------------------------------------------------------------------- reporting


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# activation_checkpoint benchmark, {result['date']}", "",
             f"`python benchmarks/activation_checkpoint.py{' --quick' if result['quick'] else ''}`", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs, "
             f"{m['torch_threads']} torch threads; torch {m['torch']}, Python {m['python']}; {machine.peaks_text(m)}. "
             "Load average "
             f"{result['loadavg_start']} at start, {result['loadavg_end']} at end; the run took "
             f"{result['seconds']:.0f} s. Median of {result['reps']} fwd+bwd after one warm-up, modes interleaved.", ""]
    for name in dict.fromkeys(r["model"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["model"] == name]
        lines += [f"## {name}", "", rows[0]["description"] + ".", "",
                  "| dtype | mode | kept for backward (MiB) | vs none | values/token/layer (x hidden) | "
                  "outer saved_tensors_hooks (MiB) | fwd+bwd median (s) | min-max (s) | vs none | max grad diff |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['dtype']} | {r['mode']} | {r['alive_bytes'] / 2**20:.2f} | {r['alive_vs_none']:.2f}x | "
                         f"{r['values_per_token_per_layer_over_hidden']:.1f} | {r['outer_hook_bytes'] / 2**20:.2f} | "
                         f"{r['median_s']:.3f} | {r['min_s']:.3f}-{r['max_s']:.3f} | {r['time_vs_none']:.2f}x | "
                         f"{r['max_grad_diff_vs_none']:.1e} |")
        lines.append("")
    lines += ["Kept for backward = unique storages made by the forward's ops that are still referenced after it "
              "(parameters, inputs and the output excluded): autograd's saved tensors, checkpoint inputs and "
              "selective checkpointing's cache alike. values/token/layer = kept bytes / (tokens x layers x hidden x "
              "element size): for the default model it includes the logits and loss, which are not per layer. "
              "Outer saved_tensors_hooks = what an autograd hook around the forward sees; it misses what checkpointed "
              "regions keep themselves. Grad diff = largest absolute difference of any parameter (and input) gradient "
              "from the run without checkpointing, same dtype.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, smoke run")
    parser.add_argument("--reps", type=int, default=None, help="timed fwd+bwd per mode (default 3, quick 2)")
    parser.add_argument("--models", default="default,gpt2_small", help="comma-separated: default, gpt2_small")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine, more threads wait on each other)")
    parser.add_argument("--results-dir", default=None, help="where to write results (default benchmarks/results)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.reps = args.reps or (2 if args.quick else 3)
    start, load0 = time.time(), [round(x, 2) for x in os.getloadavg()]
    info = machine.describe()
    rows = []
    for name in args.models.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(CASES)}")
        rows += run_case(name, args, print)
    result = {"date": results_files.today(), "quick": args.quick, "reps": args.reps, "machine": info,
              "loadavg_start": load0, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
              "seconds": time.time() - start, "rows": rows}
    text = markdown(result)
    print("\n" + text)
    out = results_files.results_dir(args.results_dir, args.quick)
    if out is None:
        return
    stem = results_files.write(results_files.stem(out, "activation_checkpoint", result["date"]), result, text)
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
