"""A small DeepSeek-V3-style model on the CPU, side by side in one run: auxiliary-loss-free load balancing against
the auxiliary loss (and against neither) at equal steps, and multi-head latent attention (MLA) against standard
grouped-query attention: KV-cache bytes per token in generation and training step time.

    python benchmarks/deepseek.py                 # both parts: 13.5 minutes on 2 cores at load average 4-9
    python benchmarks/deepseek.py --steps 200     # part 1 with fewer steps
    python benchmarks/deepseek.py --quick         # a smoke run (seconds), writes nothing unless --results-dir

**The model** (:data:`SHAPES`): the ``deepseek_v3_debug`` recipe made larger: hidden 128, 4 blocks, MLA with 4
heads (query rank 64, key/value rank 64, per head 32 + 16 rotary query/key and 32 value features), block 0 dense
(SwiGLU 256), blocks 1-3 DeepSeekMoE: 16 routed experts of 64, top 4 by sigmoid score within the best 2 of 4
groups, renormalised and x 2.5, one shared expert; sequence 64, micro-batch 16, fp32, byte-level corpus. Without
multi-token prediction (``mtp_depth=0``): the validation loss is then the next-token loss alone, and the model
differs from the standard-attention model of part 2 in its attention only.

**Part 1, balancing at equal steps.** Four runs of ``--steps`` steps (default 400) from the same initial weights
on the same batches, everything equal but the balancing of the MoE layers:

* ``loss-free`` -- ``score_bias=True``, ``bias_update_rate`` = gamma = :data:`GAMMA` (0.01, see below), no loss;
* ``loss-free-paper`` -- the same with DeepSeek-V3's gamma, :data:`PAPER_GAMMA` (0.001);
* ``aux-loss`` -- ``aux_loss_coeff`` = :data:`AUX_LOSS_COEFF` (0.01, the Switch/Mixtral load-balancing loss), no bias;
* ``neither`` -- no bias, no loss.

The sequence-wise loss of the recipe (``seq_aux_loss_coeff``) is off in all, so each balances by one means only.
Each run is ``python -m dufu train deepseek_v3_debug ...`` in a fresh process of its own (one torch thread;
``--quick``: a :class:`dufu.engine.trainer.Trainer` built from the same overrides in this process), with
``train.log_period=1``: every record carries ``moe_max_load_step``, the busiest expert's tokens over the mean
expert's in that step, averaged over the MoE layers (:mod:`dufu.engine.moe_monitor`; 1.0 is perfect balance, top 4
of 16 experts would be 4.0 at worst). The validation loss (the next-token loss, no auxiliary term) is measured
every quarter of the run on the recipe's whole held-out split. A hook (:class:`BiasProbe`) keeps each layer's
final choice bias.

*Gamma.* DeepSeek-V3 moves the bias by 0.001 per step for ~14.3T tokens, about a million steps. This model starts
far from balance (its fresh routers send most tokens of a step to the same few experts: max load ~3.7 of the worst
4.0), and an expert's bias that moves 0.001 per step can have moved at most 0.4 after 400 steps. In a trial of 150 steps
(same model and batches) gamma 0.001 had brought the max load from 3.9 to 2.1 and was still falling, gamma 0.01 was
at ~1.5 after 60 steps and stayed there, with the same validation loss as no balancing (2.51 vs 2.52; 0.001: 2.57).
So 0.01 is the run's gamma (balanced early in the run, then held), and the paper's 0.001 runs beside it to show
how long it takes in the same steps (the report gives the step at which each run became balanced).

**Part 2, MLA vs standard attention.** dufu's DeepSeek model has MLA in every block (it cannot swap its attention),
so the comparison is made three ways, all in this process, fp32, one torch thread:

* *KV cache in generation*: the two models of the whole-model comparison (below), after their timed steps, each
  greedy-generating ``GEN_NEW`` tokens after a ``GEN_PROMPT``-token prompt with dufu's
  :func:`~dufu.engine.inference.generate`; a forward pre-hook keeps the KV cache generation passes the model, and
  afterwards every layer's cached tensors are measured (their bytes over their tokens). MLA keeps the normalised
  latent and the shared rotary key, ``(kv_lora_rank + qk_rope_head_dim) x bytes`` per token and layer; standard
  attention ``2 x kv_heads x head_dim x bytes``. The formulas for DeepSeek-V3's published shapes (bf16) are beside.
* *one attention layer*: :class:`dufu.layers.MLA` against :class:`dufu.layers.Attention` (4 query heads of 32,
  2 key/value heads (GQA) and 4 (MHA), rotary on the whole head, no biases) at the model's shapes, forward and
  backward of the same input (micro-batch x sequence x hidden), interleaved, ``--layer-reps`` repeats, median;
* *the whole model*: the model of part 1 (``deepseek_v3_debug``, MLA) against the ``moe`` family (``moe_debug``:
  LLaMA blocks with grouped-query attention, 4 query / 2 key-value heads of 32) built with the same DeepSeekMoE
  layers (sigmoid routing, groups, scaling, shared expert, dense block 0, the loss-free bias): the same embedding,
  norms, feed-forward and head, only the attention differs. Two Trainers in this process, same data, warm-up
  steps, then ``--model-steps`` ``train_step()`` calls interleaved (A B, B A, ...), median.

The machine's load is read before and after each part (``os.getloadavg``) and the share of the CPU other
processes took meanwhile (:func:`harness.proc.other_load`; each timed model step, the whole loop of layer
repeats): the machine is shared, so the ratios measured side by side are what to read, not the absolute times.

Results: ``benchmarks/results/deepseek-<date>.json``, ``.md`` and ``.png`` (max expert load by step, validation
loss by step, KV bytes per token), with the machine (CPU model, measured matmul peaks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dufu.engine.hooks import Hook
from harness import launch, machine, proc, results as results_files

RECIPE, STANDARD_RECIPE = "deepseek_v3_debug", "moe_debug"
GAMMA = 0.01  # the loss-free bias's step here (module docstring: why)
PAPER_GAMMA = 0.001  # DeepSeek-V3's
AUX_LOSS_COEFF = 0.01
EVAL_ITER = 64  # capped at the held-out split's whole batches: all of it
GEN_PROMPT, GEN_NEW = 16, 32
# The model of both parts; "kv_heads" is the standard-attention model's key/value heads (GQA), head_dim hidden/heads.
SHAPES = {
    "full": dict(hidden=128, layers=4, heads=4, kv_heads=2, q_lora_rank=64, kv_lora_rank=64, nope=32, rope=16,
                 v=32, dense_ffn=256, first_k_dense=1, experts=16, top_k=4, expert_ffn=64, shared=1, n_group=4,
                 topk_group=2, seq=64, batch=16),
    "quick": dict(hidden=64, layers=2, heads=4, kv_heads=2, q_lora_rank=32, kv_lora_rank=32, nope=16, rope=8,
                  v=16, dense_ffn=128, first_k_dense=1, experts=8, top_k=2, expert_ffn=32, shared=1, n_group=2,
                  topk_group=1, seq=32, batch=4),
}
RUNS = {"full": dict(steps=400, layer_reps=30, model_warmup=3, model_steps=20, eval_iter=EVAL_ITER, evals=4),
        "quick": dict(steps=2, layer_reps=2, model_warmup=1, model_steps=2, eval_iter=1, evals=1)}
VARIANTS = {  # name: (what it is, its overrides)
    "loss-free": (f"choice bias, gamma {GAMMA}", ["model.score_bias=True", f"model.bias_update_rate={GAMMA}",
                                                 "model.aux_loss_coeff=0.0"]),
    "loss-free-paper": (f"choice bias, gamma {PAPER_GAMMA} (DeepSeek-V3's)",
                        ["model.score_bias=True", f"model.bias_update_rate={PAPER_GAMMA}", "model.aux_loss_coeff=0.0"]),
    "aux-loss": (f"load-balancing loss {AUX_LOSS_COEFF}", ["model.score_bias=False", "model.bias_update_rate=0.0",
                                                          f"model.aux_loss_coeff={AUX_LOSS_COEFF}"]),
    "neither": ("no bias, no loss", ["model.score_bias=False", "model.bias_update_rate=0.0",
                                     "model.aux_loss_coeff=0.0"]),
}
RUN_SETTINGS = ["train.amp.enabled=False", "train.compile.enabled=False", "train.generation.enabled=False",
                "train.tensorboard=False", "train.checkpointer.period=0", "train.peak_tflops=1.0",
                "train.plan_memory=False", "train.log_period=1"]


def log(msg: str) -> None:
    print(f"[deepseek] {msg}", flush=True)


def deepseek_overrides(s: dict) -> list[str]:
    """``deepseek_v3_debug``'s model and sequence at shape ``s`` (MTP and the sequence-wise loss off)."""
    return [f"model.hidden_size={s['hidden']}", f"model.num_layers={s['layers']}",
            f"model.num_attention_heads={s['heads']}", f"model.q_lora_rank={s['q_lora_rank']}",
            f"model.kv_lora_rank={s['kv_lora_rank']}", f"model.qk_nope_head_dim={s['nope']}",
            f"model.qk_rope_head_dim={s['rope']}", f"model.v_head_dim={s['v']}",
            f"model.ffn_hidden_size={s['dense_ffn']}", f"model.first_k_dense={s['first_k_dense']}",
            f"model.num_experts={s['experts']}", f"model.top_k={s['top_k']}",
            f"model.moe_ffn_hidden_size={s['expert_ffn']}", f"model.num_shared_experts={s['shared']}",
            f"model.n_group={s['n_group']}", f"model.topk_group={s['topk_group']}",
            f"model.max_position_embeddings={s['seq']}", "model.mtp_depth=0", "model.seq_aux_loss_coeff=0.0",
            f"dataloader.train.seq_length={s['seq']}", f"train.train_micro_batch_size={s['batch']}",
            f"train.global_batch_size={s['batch']}"]


def standard_overrides(s: dict) -> list[str]:
    """``moe_debug`` (LLaMA blocks, grouped-query attention) with the DeepSeekMoE layers of shape ``s``."""
    return [f"model.hidden_size={s['hidden']}", f"model.num_layers={s['layers']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_key_value_heads={s['kv_heads']}",
            f"model.ffn_hidden_size={s['dense_ffn']}", f"model.mlp_only_layers={list(range(s['first_k_dense']))}",
            f"model.num_experts={s['experts']}", f"model.top_k={s['top_k']}",
            f"model.moe_ffn_hidden_size={s['expert_ffn']}",
            f"model.shared_ffn_hidden_size={s['shared'] * s['expert_ffn']}", "model.score_func=sigmoid",
            f"model.n_group={s['n_group']}", f"model.topk_group={s['topk_group']}",
            "model.routed_scaling_factor=2.5", "model.norm_topk_prob=True", "model.score_bias=True",
            f"model.bias_update_rate={GAMMA}", "model.aux_loss_coeff=0.0", "model.seq_aux_loss_coeff=0.0",
            "model.rms_norm_eps=1e-6", f"model.max_position_embeddings={s['seq']}",
            f"dataloader.train.seq_length={s['seq']}", f"train.train_micro_batch_size={s['batch']}",
            f"train.global_batch_size={s['batch']}"]


def build_config(recipe: str, overrides: list[str]):
    from dufu.config import LazyConfig, resolve_config_path

    cfg = LazyConfig.load(resolve_config_path(recipe))
    LazyConfig.apply_overrides(cfg, overrides)
    return cfg


# ============================================================================ part 1: balancing
class BiasProbe(Hook):
    """At the end of a run, writes each MoE layer's expert-choice bias (none without one) to ``out`` (JSON)."""

    def __init__(self, out: str):
        self.out = Path(out)

    def on_end(self, trainer, summary) -> None:
        from dufu.layers.moe import MoE

        biases = {n: [float(v) for v in m.score_bias] for part in trainer.model_parts
                  for n, m in part.named_modules() if isinstance(m, MoE) and m.score_bias is not None}
        self.out.write_text(json.dumps(biases))


def run_variant(name: str, shape: dict, runs: dict, root: Path, cache: Path, in_process: bool) -> dict:
    """One balancing variant trained for ``runs["steps"]`` steps; its per-step records and evaluations."""
    out, probe = root / name, root / f"{name}-bias.json"
    steps = runs["steps"]
    argv = [*deepseek_overrides(shape), *RUN_SETTINGS, *VARIANTS[name][1], f"train.train_iter={steps}",
            f"train.evaluation.eval_period={max(1, steps // runs['evals'])}",
            f"train.evaluation.eval_iter={runs['eval_iter']}",
            f"train.output_dir={out}"]
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    if in_process:
        from dufu.engine.trainer import Trainer

        Trainer(build_config(RECIPE, argv), log=lambda *a, **k: None, hooks=[BiasProbe(str(probe))]).train()
    else:
        argv.append(launch.hooks_override(("deepseek.BiasProbe", {"out": probe})))
        run = launch.execute(launch.Run(name, launch.dufu_train([RECIPE, *argv]),
                                        launch.job_env(cache=cache, threads=1), out), timeout=3600)
        if run.rc != 0:
            raise SystemExit(f"{name} failed ({run.rc}); see {out / 'run.log'}:\n{run.log_tail}")
    wall = time.perf_counter() - t0
    records = launch.read_records(out)
    train = [r for r in records if "loss" in r]
    evals = [{"step": r["step"], "eval_loss": r["eval_loss"], "eval_samples": r["eval_samples"]}
             for r in records if "eval_loss" in r]
    biases = json.loads(probe.read_text()) if probe.exists() else {}
    loads = [r["moe_max_load_step"] for r in train]
    tail = loads[-max(1, len(loads) // 4):]
    return {"what": VARIANTS[name][0], "overrides": VARIANTS[name][1], "wall_s": round(wall, 1),
            "load_before": round(load_before, 2), "eval_samples": evals[-1]["eval_samples"] if evals else None,
            "steps": [r["step"] for r in train], "max_load_step": loads,
            "losses": [r["loss"] for r in train], "aux_loss": [r.get("moe_aux_loss", 0.0) for r in train],
            "step_time_s": [r.get("step_time_s") for r in train], "evals": evals,
            "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
            "max_load_first": statistics.mean(loads[:max(1, len(loads) // 10)]),
            "max_load_last_quarter": statistics.mean(tail), "max_load_final": loads[-1],
            "bias_range": {n: round(max(b) - min(b), 4) for n, b in biases.items()}}


def compare_balancing(shape: dict, runs: dict, root: Path, in_process: bool) -> dict:
    cache = root / "cache"  # one tokenized corpus for the four runs (subprocesses)
    out = {}
    for name in VARIANTS:
        log(f"part 1: {name}, {runs['steps']} steps ...")
        out[name] = r = run_variant(name, shape, runs, root, cache, in_process)
        log(f"part 1: {name}: max load first {r['max_load_first']:.2f}, last quarter "
            f"{r['max_load_last_quarter']:.2f}, val loss {r['final_eval_loss']:.4f}, {r['wall_s']} s")
    return out


# ============================================================================ part 2: MLA vs standard attention
def _attention_modules(model):
    from dufu.layers import MLA, Attention

    return [m for m in model.modules() if isinstance(m, (MLA, Attention))]


def kv_cache_bytes(model, vocab: int, seed: int = 0) -> dict:
    """Greedy generation with dufu's ``generate``; the KV cache it used, measured tensor by tensor."""
    import torch

    from dufu.engine.inference.generate import generate

    caught = []

    def grab(module, args, kwargs):
        if kwargs.get("kv_cache") is not None and not caught:
            caught.append(kwargs["kv_cache"])

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, GEN_PROMPT), generator=g)
    try:
        out = generate(model, prompt, max_new_tokens=GEN_NEW, temperature=0)
    finally:
        handle.remove()
    (cache,) = caught
    layers = []
    for m in _attention_modules(model):
        tensors = cache.get(m)
        tokens = tensors[0].shape[2]  # (B, heads or 1, T, features)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        layers.append({"shapes": [list(t.shape) for t in tensors], "dtype": str(tensors[0].dtype),
                       "tokens": tokens, "bytes": nbytes, "bytes_per_token": nbytes / tokens / prompt.shape[0]})
    return {"generated": out.shape[1] - GEN_PROMPT, "layers": layers,
            "bytes_per_token_per_layer": layers[0]["bytes_per_token"],
            "bytes_per_token_all_layers": sum(la["bytes_per_token"] for la in layers)}


def published_formulas() -> dict:
    """Bytes per token and layer in bf16 at DeepSeek-V3's published attention shapes: MLA (the model's own
    ``cache_bytes_per_token``, built on the meta device) against multi-head attention of the same 128 heads
    (keys of 128 + 64 features, values of 128: what MLA expands its latent into) and a GQA of 8 key/value heads."""
    import torch

    from dufu.layers import MLA

    with torch.device("meta"):
        mla = MLA(7168, 128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128)
    b = torch.bfloat16.itemsize
    return {"mla": mla.cache_bytes_per_token(torch.bfloat16), "mha_128_heads": 128 * (128 + 64 + 128) * b,
            "gqa_8_kv_heads_128": 2 * 8 * 128 * b}


def build_layers(s: dict) -> dict:
    import torch

    from dufu.layers import MLA, Attention, RotaryEmbedding

    torch.manual_seed(0)
    head_dim = s["hidden"] // s["heads"]
    layers = {"MLA": MLA(s["hidden"], s["heads"], q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
                         qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"], v_head_dim=s["v"],
                         max_position_embeddings=s["seq"])}
    for label, kv in ((f"GQA ({s['heads']}/{s['kv_heads']})", s["kv_heads"]), (f"MHA ({s['heads']})", s["heads"])):
        layers[label] = Attention(s["hidden"], s["heads"], kv, qkv_bias=False, out_bias=False)
    rotary = RotaryEmbedding(head_dim, s["seq"])
    return {"layers": layers, "rotary": rotary, "head_dim": head_dim}


def compare_layers(s: dict, reps: int) -> dict:
    """Forward + backward of each attention layer on the same input, interleaved; median ms."""
    import torch

    from dufu.layers import MLA

    built = build_layers(s)
    layers, rotary = built["layers"], built["rotary"]
    torch.manual_seed(1)
    x0 = torch.randn(s["batch"], s["seq"], s["hidden"])
    dy = torch.randn(s["batch"], s["seq"], s["hidden"])
    times = {k: [] for k in layers}

    def once(name):
        layer = layers[name]
        x = x0.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y = layer(x) if isinstance(layer, MLA) else layer(x, rotary=rotary)
        y.backward(dy)
        return time.perf_counter() - t0

    names = list(layers)
    for name in names:  # warm-up
        once(name)
    # the others' share of the CPU over the whole loop (one call is too short for /proc/stat's 10 ms ticks)
    b0, c0, t0 = proc.system_busy_seconds(), time.process_time(), time.perf_counter()
    for i in range(reps):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(once(name) * 1e3)
    other = proc.other_load(b0, proc.system_busy_seconds(), time.process_time() - c0, time.perf_counter() - t0)
    out = {}
    for name, layer in layers.items():
        out[name] = {"parameters": sum(p.numel() for p in layer.parameters()), "ms": times[name],
                     "median_ms": statistics.median(times[name]), "min_ms": min(times[name])}
    base = out["MLA"]["median_ms"]
    for r in out.values():
        r["ratio_to_mla"] = r["median_ms"] / base
    return {"input": [s["batch"], s["seq"], s["hidden"]], "head_dim": built["head_dim"], "layers": out,
            "other_load": other}


class _Contender:
    """A dufu Trainer of one recipe, stepped by hand; wall time, CPU time, others' load, losses, samples drawn."""

    def __init__(self, recipe: str, overrides: list[str], workdir: Path):
        from dufu.engine.trainer import Trainer
        from harness.hooks import StepTimes

        self.recipe, self.overrides = recipe, overrides + RUN_SETTINGS + [
            "train.evaluation.enabled=False", f"train.output_dir={workdir}"]
        self.drawn = StepTimes()
        self.trainer = Trainer(build_config(recipe, self.overrides), log=lambda *a, **k: None, hooks=[self.drawn])
        self.wall, self.other_load, self.losses = [], [], []

    def step(self, timed: bool = True) -> None:
        b0, c0, t0 = proc.system_busy_seconds(), time.process_time(), time.perf_counter()
        loss, _ = self.trainer.train_step()
        loss = float(loss)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.losses.append(loss)
        if timed:
            self.wall.append(wall)
            other = proc.other_load(b0, proc.system_busy_seconds(), cpu, wall)
            if other is not None:
                self.other_load.append(other)


def compare_models(s: dict, runs: dict, root: Path) -> dict:
    contenders = {"MLA (deepseek_v3_debug)": _Contender(RECIPE, deepseek_overrides(s) + VARIANTS["loss-free"][1],
                                                           root / "mla"),
                  f"GQA {s['heads']}/{s['kv_heads']} (moe_debug)": _Contender(STANDARD_RECIPE, standard_overrides(s),
                                                                             root / "gqa")}
    for c in contenders.values():
        for _ in range(runs["model_warmup"]):
            c.step(timed=False)
    names = list(contenders)
    for i in range(runs["model_steps"]):
        for name in (names if i % 2 == 0 else names[::-1]):
            contenders[name].step()
    out = {}
    for name, c in contenders.items():
        rt = c.trainer.runtime
        attn = _attention_modules(rt.model)
        out[name] = {"recipe": c.recipe, "model": rt.model_name, "parameters": rt.num_parameters,
                     "attention_parameters": sum(p.numel() for m in attn for p in m.parameters()),
                     "step_times_s": c.wall, "median_step_s": statistics.median(c.wall), "min_step_s": min(c.wall),
                     "median_other_load": statistics.median(c.other_load) if c.other_load else None,
                     "losses": c.losses, "overrides": c.overrides}
    a, b = (contenders[n] for n in names)
    base = out[names[0]]["median_step_s"]
    for r in out.values():
        r["ratio_to_mla"] = r["median_step_s"] / base
    return {"warmup": runs["model_warmup"], "steps": runs["model_steps"],
            "same_samples": a.drawn.samples == b.drawn.samples, "models": out,
            "trainers": {n: c.trainer for n, c in contenders.items()}}


def compare_attention(shape: dict, runs: dict, root: Path) -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log("part 2: training steps, MLA model vs GQA model, interleaved ...")
        models = compare_models(shape, runs, root)
        trainers = models.pop("trainers")
        log("part 2: KV cache in generation ...")
        vocab = min(t.runtime.model.vocab_size for t in trainers.values())
        kv = {name: kv_cache_bytes(t.runtime.model, vocab) for name, t in trainers.items()}
        del trainers
        log(f"part 2: one attention layer, forward + backward, {runs['layer_reps']} interleaved repeats ...")
        layers = compare_layers(shape, runs["layer_reps"])
    finally:
        torch.set_num_threads(threads)
    return {"threads": 1, "kv_cache": kv, "published_bf16": published_formulas(), "layer": layers, "model": models}


# ============================================================================ report
BALANCE_AT, BALANCE_WINDOW = 1.5, 10  # "balanced": a running mean of the per-step max load at or below 1.5


def steps_to_balance(steps: list[int], loads: list[float]):
    """The first step whose :data:`BALANCE_WINDOW`-step running mean of the max load is <= :data:`BALANCE_AT`
    (None if none is)."""
    for i in range(BALANCE_WINDOW - 1, len(loads)):
        if statistics.mean(loads[i - BALANCE_WINDOW + 1:i + 1]) <= BALANCE_AT:
            return steps[i]
    return None


def _balanced_text(bal: dict, name: str) -> str:
    at = steps_to_balance(bal[name]["steps"], bal[name]["max_load_step"])
    return f"at step {at}" if at else "not within the run"


def kv_formulas(s: dict) -> dict:
    """The bytes per token and layer the formulas give here (fp32), by the names :func:`compare_models` uses."""
    names = ["MLA (deepseek_v3_debug)", f"GQA {s['heads']}/{s['kv_heads']} (moe_debug)"]
    head_dim = s["hidden"] // s["heads"]
    return {names[0]: (f"(kv_lora_rank + qk_rope_head_dim) x 4 = ({s['kv_lora_rank']} + {s['rope']}) x 4",
                       (s["kv_lora_rank"] + s["rope"]) * 4),
            names[1]: (f"2 x kv_heads x head_dim x 4 = 2 x {s['kv_heads']} x {head_dim} x 4",
                       2 * s["kv_heads"] * head_dim * 4)}


def report(data: dict, stem: Path) -> str:
    s, bal, att, m = data["shape"], data["balancing"], data["attention"], data["machine"]
    lines = [f"# DeepSeek-style model: loss-free balancing vs auxiliary loss, MLA vs standard attention "
             f"({data['date']})", "",
             f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs ({machine.peaks_text(m) or 'peaks not measured'}"
             f"), torch {m['torch']}, dufu {m['dufu_commit']}. Load average (1 min) at the start "
             f"{data['load_start'][0]:.2f}, after part 1 {data['load_after_balancing'][0]:.2f}, at the end "
             f"{data['load_end'][0]:.2f}: the machine is shared, so compare the ratios measured side by side, not "
             "the absolute times.", "",
             f"Model (`{RECIPE}` made larger): hidden {s['hidden']}, {s['layers']} blocks, MLA {s['heads']} heads "
             f"(query rank {s['q_lora_rank']}, key/value rank {s['kv_lora_rank']}, {s['nope']} + {s['rope']} "
             f"rotary query/key and {s['v']} value features per head), block 0 dense (SwiGLU {s['dense_ffn']}), "
             f"the others DeepSeekMoE with {s['experts']} routed experts of {s['expert_ffn']}, top {s['top_k']} "
             f"within the best {s['topk_group']} of {s['n_group']} groups, {s['shared']} shared expert; no MTP, "
             f"sequence {s['seq']}, micro-batch {s['batch']}, fp32, byte-level corpus.", "",
             f"## Load balancing at equal steps ({data['steps']} steps, same weights and batches)", "",
             f"Every step logged (`train.log_period=1`); max load = the busiest expert's tokens over the mean "
             f"expert's in a step, mean over the {s['layers'] - s['first_k_dense']} MoE layers (1.0 is perfect "
             f"balance, {s['experts'] // s['top_k']}.0 the worst); *balanced at* = the first step whose "
             f"{BALANCE_WINDOW}-step running mean is <= {BALANCE_AT}. Gamma (the bias's step) {GAMMA} in "
             f"`loss-free`, chosen for a short run: the paper's {PAPER_GAMMA} (`loss-free-paper`) can move the bias "
             f"at most {PAPER_GAMMA} x steps and became balanced {_balanced_text(bal, 'loss-free-paper')}, {GAMMA} "
             f"{_balanced_text(bal, 'loss-free')} (the bias range each reached is in the table); aux-loss "
             f"coefficient {AUX_LOSS_COEFF}; the sequence-wise loss off in all four. "
             + ("Each run a fresh `dufu train` process, one torch thread." if data["mode"] == "full" else
                "Each run a Trainer in this process (quick mode)."), ""]
    rows = []
    for name, r in bal.items():
        br = r["bias_range"]
        at = steps_to_balance(r["steps"], r["max_load_step"])
        rows.append([name, r["what"], f"{r['max_load_first']:.2f}", str(at) if at else "not within the run",
                     f"{r['max_load_last_quarter']:.2f}", f"{r['max_load_final']:.2f}", f"{r['final_eval_loss']:.4f}",
                     f"{statistics.mean(r['losses'][-max(1, len(r['losses']) // 10):]):.4f}",
                     f"{max(br.values()):.3f}" if br else "(no bias)", f"{r['wall_s']:.0f}", f"{r['load_before']:.1f}"])
    first = max(1, len(next(iter(bal.values()))["max_load_step"]) // 10)
    lines += results_files.table(
        ["run", "balancing", f"max load, first {first} steps", "balanced at step", "max load, last quarter",
         "max load, last step", "final val. loss", "train loss, last tenth", "bias range (max - min)", "wall s",
         "load before"], rows)
    evals = [e["step"] for e in next(iter(bal.values()))["evals"]]
    ev = next(iter(bal.values()))["eval_samples"]
    lines += ["", f"Validation loss by step (the next-token loss on {ev} held-out sequences of {s['seq']} tokens, "
              f"{ev * s['seq']:,} tokens; one seed, so differences of a few hundredths may be noise):", ""]
    lines += results_files.table(["step", *bal], [[str(st), *(f"{r['evals'][i]['eval_loss']:.4f}" for r in
                                                              bal.values())] for i, st in enumerate(evals)])
    kv, forms = att["kv_cache"], kv_formulas(s)
    lines += ["", "## MLA vs standard attention", "",
              "dufu's DeepSeek model has MLA in every block; the standard-attention side is the `moe` family "
              f"(`{STANDARD_RECIPE}`: LLaMA blocks with grouped-query attention, {s['heads']} query / "
              f"{s['kv_heads']} key-value heads of {s['hidden'] // s['heads']}) built with the same DeepSeekMoE "
              "layers, dense block, embedding and head: the two models differ in their attention only. One torch "
              "thread.", "",
              f"### KV cache in generation (greedy, {GEN_PROMPT}-token prompt, {GEN_NEW} new tokens, fp32)", "",
              "Measured from the cache tensors dufu's `generate` kept (bytes over cached tokens), the formula "
              "beside:", ""]
    rows = []
    for name, r in kv.items():
        formula, value = forms[name]
        rows.append([name, " + ".join(str(tuple(sh)) for sh in r["layers"][0]["shapes"]),
                     str(r["layers"][0]["tokens"]), f"{r['bytes_per_token_per_layer']:,.0f}", f"{formula} = {value:,}",
                     f"{r['bytes_per_token_all_layers']:,.0f}"])
    lines += results_files.table(["model", "cache per layer (shapes)", "tokens cached", "bytes / token / layer",
                                  "formula", f"bytes / token, all {s['layers']} layers"], rows)
    names = list(kv)
    pub = att["published_bf16"]
    mla_b, gqa_b = (kv[n]["bytes_per_token_per_layer"] for n in names)
    mha_b = 2 * s["hidden"] * 4
    lines += ["", f"Here MLA keeps {gqa_b / mla_b:.2f}x fewer bytes per token than GQA {s['heads']}/{s['kv_heads']} "
              f"and {mha_b / mla_b:.2f}x fewer than multi-head attention of the same heads (2 x {s['heads']} x "
              f"{s['hidden'] // s['heads']} x 4 = {mha_b:,}, formula): at this size the latent "
              f"({s['kv_lora_rank']} + {s['rope']}) is not much smaller than the heads. At DeepSeek-V3's published "
              f"shapes (bf16, formulas): MLA (512 + 64) x 2 = {pub['mla']:,} bytes per token and layer, against "
              f"{pub['mha_128_heads']:,} for multi-head attention of its 128 heads (keys 128 + 64, values 128: "
              f"{pub['mha_128_heads'] / pub['mla']:.0f}x) and {pub['gqa_8_kv_heads_128']:,} for a GQA of 8 "
              f"key/value heads of 128 ({pub['gqa_8_kv_heads_128'] / pub['mla']:.1f}x).", ""]
    la = att["layer"]
    lines += [f"### One attention layer, forward + backward (input {tuple(la['input'])}, "
              f"{data['runs']['layer_reps']} interleaved repeats; others' share of the CPU meanwhile "
              f"{results_files.fmt(la['other_load'], '.2f')})", ""]
    base = la["layers"]["MLA"]["min_ms"]
    rows = [[name, f"{r['parameters']:,}", f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['ratio_to_mla']:.2f}",
             f"{r['min_ms'] / base:.2f}"] for name, r in la["layers"].items()]
    lines += results_files.table(["layer", "parameters", "median ms", "min ms", "time / MLA's (medians)",
                                  "(minimums)"], rows)
    mo = att["model"]
    lines += ["", f"### The whole model, training step ({mo['steps']} interleaved steps after {mo['warmup']} "
              f"warm-up; same samples: {mo['same_samples']})", ""]
    base = next(iter(mo["models"].values()))["min_step_s"]
    rows = [[name, f"{r['parameters']:,}", f"{r['attention_parameters']:,}", f"{r['median_step_s'] * 1e3:.1f}",
             f"{r['min_step_s'] * 1e3:.1f}", f"{r['ratio_to_mla']:.2f}", f"{r['min_step_s'] / base:.2f}",
             results_files.fmt(r["median_other_load"], ".2f")] for name, r in mo["models"].items()]
    lines += results_files.table(["model", "parameters", "of which attention", "median step ms", "min step ms",
                                  "time / MLA model's (medians)", "(minimums)", "others' CPU share (median)"], rows)
    lines += ["", f"![max expert load by step, validation loss, KV bytes per token]({stem.name}.png)"]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.8), gridspec_kw={"width_ratios": [2, 1.2, 1]})
    for name, r in data["balancing"].items():
        line, = ax1.plot(r["steps"], r["max_load_step"], linewidth=0.5, alpha=0.35)
        k = max(1, len(r["steps"]) // 40)  # a running mean over k steps, for the eye
        smooth = [statistics.mean(r["max_load_step"][max(0, i - k + 1):i + 1]) for i in range(len(r["steps"]))]
        ax1.plot(r["steps"], smooth, color=line.get_color(), label=f"{name} ({k}-step mean)")
        evals = [e for e in r["evals"] if e["step"] > 0] or r["evals"]  # without step 0, the curves part
        ax2.plot([e["step"] for e in evals], [e["eval_loss"] for e in evals], marker="o", label=name)
    ax1.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax1.set(xlabel="step", ylabel="busiest / mean expert (tokens, per step)", title="max expert load")
    ax2.set(xlabel="step", ylabel="validation loss", title="validation loss")
    kv = data["attention"]["kv_cache"]
    names = list(kv)
    ax3.bar(range(len(names)), [kv[n]["bytes_per_token_per_layer"] for n in names], color=["C3", "C7"])
    ax3.set_xticks(range(len(names)), [n.split(" (")[0] for n in names])
    ax3.set(ylabel="bytes / token / layer (fp32)", title="KV cache (measured)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"DeepSeek-style model, {data['steps']} steps ({data['machine']['cpu']}, load "
                 f"{data['load_start'][0]:.1f} at start)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps of each balancing run (default 400)")
    parser.add_argument("--layer-reps", type=int, default=None, help="repeats of the one-layer timing (30)")
    parser.add_argument("--model-steps", type=int, default=None, help="timed steps of each whole model (20)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2 steps, every run in this process: a smoke run")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results (none with --quick)")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    shape, runs = SHAPES[mode], dict(RUNS[mode])
    for key, value in (("steps", args.steps), ("layer_reps", args.layer_reps), ("model_steps", args.model_steps)):
        if value is not None:
            runs[key] = value
    info = machine.describe(peaks=not args.quick)
    load_start = os.getloadavg()
    log(f"{info['cpu']}, load {load_start[0]:.2f}; {mode} mode")
    with tempfile.TemporaryDirectory() as tmp:
        balancing = compare_balancing(shape, runs, Path(tmp) / "balancing", in_process=args.quick)
        load_mid = os.getloadavg()
        attention = compare_attention(shape, runs, Path(tmp) / "attention")
    data = {"date": results_files.today(), "mode": mode, "recipe": RECIPE, "standard_recipe": STANDARD_RECIPE,
            "shape": shape, "runs": runs, "steps": runs["steps"], "gamma": GAMMA, "aux_loss_coeff": AUX_LOSS_COEFF,
            "machine": info, "load_start": list(load_start), "load_after_balancing": list(load_mid),
            "load_end": list(os.getloadavg()), "balancing": balancing, "attention": attention}
    folder = results_files.results_dir(args.results_dir, args.quick)
    if folder is None:
        print(json.dumps({k: data[k] for k in ("steps", "load_start", "load_end")}))
        return 0
    stem = results_files.stem(folder, "deepseek", data["date"])
    results_files.write(stem, data, report(data, stem))
    plot(data, stem.with_suffix(".png"))
    log(f"wrote {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
