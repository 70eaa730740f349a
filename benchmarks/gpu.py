"""One GPU, built to take under ten minutes: dufu beside a plain PyTorch loop and beside `dufu plan`'s prediction,
for GPT-2 small and a ~1B LLaMA in bf16, with torch.compile off and on.

    python benchmarks/gpu.py                        # a CUDA machine: both models, compile off and on, 50 steps each
    python benchmarks/gpu.py --models llama_1b --steps 30 --compile on
    python benchmarks/gpu.py --smoke --out /tmp/r   # this code path on the CPU: tiny models, 3 steps, compile off

Made for a borrowed GPU machine (torch 2.11 or newer, CUDA, no network, nothing installed): it runs from the source
tree unchanged (it puts the repository first on ``sys.path`` itself), trains on the built-in corpus with the byte
tokenizer (nothing to download or to train first) and writes ``benchmarks/results/gpu-<date>-<gpu>.md`` and
``.json`` (``--out`` chooses the folder) with the GPU model, torch, CUDA and driver versions.

The models (``MODELS``):

* ``gpt2_small`` -- the packaged ``gpt2_small`` recipe (12 layers, hidden 768, 12 heads, vocab 50,304, tied head),
  dropout 0, sequence 1024, micro-batch 16;
* ``llama_1b`` -- the ``llama2_7b`` recipe resized to Llama 3.2 1B's body (16 layers, hidden 2048, 32 query / 8
  key-value heads, SwiGLU 8192) with Llama 2's 32,000-token vocabulary and an untied head: 1.10B parameters;
  sequence 2048, micro-batch 8, no activation checkpointing: fp32 weights, gradients and AdamW states take 16
  bytes a parameter (17.7 GB), and `dufu plan` predicts 52 GiB per GPU in all at micro-batch 8, 90 GiB at 16 (an
  H100 80GB leaves 77 GiB for tensors); on a smaller GPU the micro-batch is halved until `dufu plan` says the run
  fits (the results say which it ran).

Per model and compile setting, three rows:

* ``dufu``  -- ``Trainer(cfg).train()`` on the recipe, exactly the loop ``dufu train`` runs (one process, no
  evaluation, no samples, a log record every 10 steps; the run's last step is saved, as every dufu run's is,
  outside the timed steps); the step times come from a hook (:class:`CountedSteps`, whose read of each step's loss
  makes the step time whole on a GPU), peak memory from the run's ``metrics.jsonl`` keys that start with ``mem_``,
  and host reads per step are counted by :mod:`dufu.engine.host_reads` (the timer's own read left out);
* ``plain`` -- a plain PyTorch model of the same shapes written the way its reference is (nanoGPT's GPT-2 with its
  initialisation; Meta's LLaMA with ``nn.RMSNorm``, rotary embeddings and grouped-query SDPA), trained on the same
  token batches in the same order: bf16 autocast, fp32 cross entropy, ``clip_grad_norm_(1.0)``, fused AdamW,
  ``torch.compile(model)`` when compile is on (nanoGPT compiles the whole model), one host read (``loss.item()``)
  per step;
* ``plan``  -- ``dufu.plan.estimate`` of the same config on this GPU (catalog entry by name: A100 40/80 GB, H100
  SXM, H200; another GPU is described from its properties, dufu's peak and a measured copy bandwidth).

tokens/s = tokens per step / median step time of the steps after ``--warmup`` (compile happens in those);
MFU = dufu's FLOPs per token (6N + 12 L H T) x tokens/s / the device's peak in the run's dtype
(``dufu.engine.reporting.flops.device_peak_flops``: the data sheet for known GPUs), the same for both loops.
Peak allocated memory is ``torch.cuda.max_memory_allocated`` of each run (CUDA only). TF32 stays off in both
loops (dufu does not turn it on); under bf16 autocast no large matmul runs in fp32 anyway.

``--smoke``: the same code path on the CPU in well under a minute -- the two recipes at the sizes of ``gpt_debug``
and ``llama_debug`` (2 layers, hidden 64, vocab 384, sequence 32, micro-batch 4), 3 steps (the first one is
warm-up), compile off, fp32 (bf16 matmuls on a CPU without AMX or AVX512-BF16 are slower than fp32), planned on
this CPU as measured by ``dufu plan``. tests/test_benchmarks_gpu.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# This checkout's dufu and the shared harness, whatever is installed (a borrowed machine has no dufu installed).
REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (str(BENCH), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dufu.config import LazyConfig, resolve_config_path  # noqa: E402
from dufu.data import collate  # noqa: E402
from dufu.data.tokenizer import BYTE_VOCAB_SIZE  # noqa: E402
from dufu.engine.reporting.flops import count_matmul_params  # noqa: E402
from dufu.engine.schema import validate_train  # noqa: E402
from dufu.engine.trainer import Trainer  # noqa: E402
from harness import launch, machine, results  # noqa: E402
from harness.hooks import StepTimes  # noqa: E402
from dufu.engine.host_reads import count_host_reads  # noqa: E402
from train_step_models import PlainGPT, adamw_groups, lm_loss  # noqa: E402

GiB = 2**30
# recipe, model sizes, sequence, micro-batch on an 80 GB GPU; --smoke sizes (gpt_debug's / llama_debug's)
MODELS = {
    "gpt2_small": dict(
        recipe="gpt2_small", family="gpt", seq=1024, micro_batch=16,
        model=dict(embedding_dropout=0.0, hidden_dropout=0.0, attention_dropout=0.0),
        smoke=dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=384)),
    "llama_1b": dict(
        recipe="llama2_7b", family="llama", seq=2048, micro_batch=8,
        model=dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                   ffn_hidden_size=8192, vocab_size=32000),
        smoke=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   ffn_hidden_size=176, vocab_size=384)),
}
SMOKE_SEQ, SMOKE_MICRO_BATCH = 32, 4
LR, BETAS, EPS, WEIGHT_DECAY = 6e-4, (0.9, 0.95), 1e-8, 0.1  # the recipes' optimizer, for the plain loops


# ----------------------------------------------------------------------------- the plain PyTorch models
def init_gpt2_(model: PlainGPT, num_layers: int) -> PlainGPT:
    """nanoGPT's GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, zero biases, and the residual
    projections (``c_proj``) at 0.02 / sqrt(2 x layers) (GPT-2 paper, section 2.3)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * num_layers))
    return model


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves convention (Su et al. 2021; Hugging Face's Llama): x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class PlainLlamaBlock(nn.Module):
    """Meta's Llama block: RMSNorm, grouped-query attention with rotary embeddings (SDPA), RMSNorm, SwiGLU."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 under autocast: SDPA wants one dtype
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)  # (B, nh, T, hs)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class PlainLlama(nn.Module):
    """Meta's Llama (untied head), initialised as dufu's and Llama's reference: N(0, 0.02), norms 1."""

    def __init__(self, num_layers, hidden_size, num_attention_heads, num_key_value_heads, ffn_hidden_size,
                 vocab_size, max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(PlainLlamaBlock(hidden_size, num_attention_heads, num_key_value_heads,
                                                    ffn_hidden_size, rms_norm_eps) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)
        hd = hidden_size // num_attention_heads
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # (hs / 2,)
        angles = torch.outer(torch.arange(max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        return lm_loss(self.output(self.norm(x)), targets)


def build_plain(spec: dict, sizes: dict, seq: int) -> nn.Module:
    if spec["family"] == "gpt":
        keys = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
        model = PlainGPT(**{k: sizes[k] for k in keys}, max_position_embeddings=seq)
        return init_gpt2_(model, sizes["num_layers"])
    keys = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "ffn_hidden_size",
            "vocab_size", "rms_norm_eps", "rope_theta")
    return PlainLlama(**{k: sizes[k] for k in keys}, max_position_embeddings=seq)


# ----------------------------------------------------------------------------- the runs
def dufu_config(spec: dict, sizes: dict, seq: int, micro: int, steps: int, amp: bool, compiled: bool, out: Path,
                device: str = "auto"):
    """The recipe with this benchmark's sizes and settings: the config ``dufu plan`` and the dufu row share."""
    cfg = LazyConfig.load(resolve_config_path(spec["recipe"]))
    overrides = [f"model.{k}={v}" for k, v in sizes.items()] + [
        f"model.max_position_embeddings={seq}", f"dataloader.train.seq_length={seq}",
        "tokenization.tokenizer.kind=byte", f"tokenization.tokenizer.vocab_size={BYTE_VOCAB_SIZE}",
        f"train.train_micro_batch_size={micro}", f"train.global_batch_size={micro}", f"train.train_iter={steps}",
        f"train.scheduler.warmup_iter={max(1, steps // 10)}", "train.log_period=10", "train.checkpointer.period=0",
        "train.evaluation.enabled=False", "train.generation.enabled=False", "train.tensorboard=False",
        f"train.amp.enabled={amp}", "train.amp.dtype=bf16", f"train.compile.enabled={compiled}",
        "train.activation_checkpoint.enabled=False", f"train.output_dir={out}", f"train.device={device}",
    ]
    cfg = LazyConfig.apply_overrides(cfg, overrides)
    validate_train(cfg, source=f"the {spec['recipe']} recipe with benchmarks/gpu.py's overrides")
    return cfg, overrides


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    torch.compiler.reset()  # a compiled run's graphs and guards go with it
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device):
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def allocated(device: torch.device):
    """GiB still allocated before a run starts: above zero, an earlier run's tensors are alive (a leak)."""
    return torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else None


def timing(step_s: list[float], warmup: int, tokens: int, flops_per_token: float, peak: float) -> dict:
    timed = step_s[warmup:] or step_s[-1:]
    median = statistics.median(timed)
    tps = tokens / median
    return {"median_step_s": median, "tokens_per_s": tps, "mfu": flops_per_token * tps / peak,
            "first_step_s": step_s[0], "warmup_s": sum(step_s[:warmup]), "step_times_s": step_s}


class CountedSteps(StepTimes):
    """:class:`StepTimes`, and the host reads of each step from its start to the next one's (the loop's read of
    its numbers at a log step included), counted by :func:`dufu.engine.host_reads.count_host_reads`; the timer's
    own read of the loss at the step's end (which makes a GPU's step time whole) is not counted."""

    def __init__(self):
        super().__init__()
        self.reads_at_start: list[int] = []
        self._counter = self._reads = None

    def on_start(self, trainer) -> None:
        self._counter = count_host_reads()
        self._reads = self._counter.__enter__()

    def on_step_start(self, trainer) -> None:
        if self._reads is not None:
            self.reads_at_start.append(self._reads.count)
        super().on_step_start(trainer)

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        with self._reads.paused() if self._reads is not None else contextlib.nullcontext():
            super().after_optimizer(trainer, loss, grad_norm)

    def on_end(self, trainer, summary) -> None:  # (the end summary's reads come after the last step's read)
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None

    def per_step(self, warmup: int):
        """Host reads per step after ``warmup`` steps (the mean over whole log periods where it can), or None."""
        starts = self.reads_at_start
        if len(starts) < warmup + 2:
            return None
        return (starts[-1] - starts[warmup]) / (len(starts) - 1 - warmup)


def memory_records(records: list[dict]) -> dict:
    """Every ``mem_*`` key of the run's records, its largest value."""
    out: dict = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("mem_") and isinstance(v, (int, float)):
                out[k] = max(v, out.get(k, v))
    return out


def run_dufu(cfg, args, device, log) -> dict:
    """dufu's own loop on ``cfg``; also returns the token batches it trained on, for the plain loop."""
    times, before = CountedSteps(), allocated(device)
    trainer = Trainer(cfg, log=lambda *a, **k: log("    " + " ".join(str(x) for x in a)), hooks=[times])
    rt = trainer.runtime
    trainer.train()
    records = launch.read_metrics(rt.output_dir)
    batches = [collate(rt.train_ds, [i for mb in step for i in mb]) for step in times.samples]  # (B, T + 1)
    row = {**timing([s["wall_s"] for s in times.steps], args.warmup, rt.tokens_per_step, rt.flops_per_token,
                    rt.peak_flops),
           "losses": [s["loss"] for s in times.steps], "peak_allocated_gib": peak_allocated(device),
           "allocated_before_gib": before,
           "mem": memory_records(records), "host_reads_per_step": times.per_step(args.warmup),
           "host_reads_source": "dufu.engine.host_reads, between step starts, the timer's own read left out",
           "compile_decision": {"enabled": rt.compile.enabled, "reason": rt.compile.reason}}
    model_info = {"parameters": rt.num_parameters, "matmul_parameters": count_matmul_params(rt.model),
                  "flops_per_token": rt.flops_per_token, "peak_flops": rt.peak_flops, "peak_source": rt.peak_source,
                  "tokens_per_step": rt.tokens_per_step, "dtype": "bf16" if rt.amp_dtype else "fp32"}
    del trainer, rt, times
    return {"row": row, "batches": batches, "model": model_info}


def run_plain(spec, sizes, seq, batches, compiled: bool, amp: bool, device, args, info: dict) -> dict:
    """The plain loop on the dufu run's batches: forward under autocast, backward, clip, fused AdamW."""
    torch.manual_seed(1234)
    before = allocated(device)
    model = build_plain(spec, sizes, seq).to(device)
    matmul = count_matmul_params(model)
    if matmul != info["matmul_parameters"]:
        raise RuntimeError(f"the plain model has {matmul:,} matmul parameters, dufu's {info['matmul_parameters']:,}: "
                           "the two are not the same shapes")
    optimizer = torch.optim.AdamW(adamw_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS, fused=True)
    forward = torch.compile(model) if compiled else model
    step_s, losses = [], []
    pin = device.type == "cuda"
    for batch in batches:
        batch = batch.pin_memory() if pin else batch
        sync(device)
        t0 = time.perf_counter()
        batch = batch.to(device, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) inputs and next-token targets
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the one host read of a step: the logged loss
        step_s.append(time.perf_counter() - t0)
    row = {**timing(step_s, args.warmup, info["tokens_per_step"], info["flops_per_token"], info["peak_flops"]),
           "losses": losses, "peak_allocated_gib": peak_allocated(device), "allocated_before_gib": before,
           "mem": {}, "host_reads_per_step": 1,
           "host_reads_source": "loss.item() once a step (by construction)"}
    del model, optimizer, forward
    return row


# ----------------------------------------------------------------------------- dufu plan
def plan_hardware(device: torch.device):
    """The device `dufu plan` predicts for: the catalog entry of this GPU, else its figures (CUDA, unverified
    here), or this machine's CPU (measured)."""
    from dufu.engine.reporting.flops import device_peak_flops
    from dufu.plan import get_hardware

    if device.type != "cuda":
        return get_hardware("cpu")
    props = torch.cuda.get_device_properties(device)
    name, gb = props.name.upper(), props.total_memory / 1e9
    if "H200" in name:
        return get_hardware("h200")
    if "H100" in name and "PCIE" not in name:
        return get_hardware("h100-80gb")
    if "A100" in name:
        return get_hardware("a100-80gb" if gb > 50 else "a100-40gb")
    # Not in the catalog: dufu's peaks (data sheet or measured), the memory it has, a measured copy bandwidth.
    x = torch.empty(GiB // 2, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    bandwidth = 2 * 10 * x.numel() / (time.perf_counter() - t0)
    del x, y
    return get_hardware({
        "name": props.name, "description": f"{props.name} (described by benchmarks/gpu.py: not in dufu's catalog)",
        "bf16_tflops": device_peak_flops(device, torch.bfloat16)[0] / 1e12,
        "fp32_tflops": device_peak_flops(device, torch.float32)[0] / 1e12,
        "memory_gb": gb, "memory_bandwidth_gbs": bandwidth / 1e9, "intra_node_bandwidth_gbs": 1.0,
        "inter_node_bandwidth_gbs": 1.0, "devices_per_node": 1})


def predict(cfg, hw) -> dict:
    from dufu.plan import estimate

    est = estimate(cfg, 1, hw)
    return {"tokens_per_s": est.tokens_per_s, "mfu": est.mfu, "median_step_s": est.step_time_s,
            "memory_gib": est.memory_per_gpu_bytes / GiB, "fits": est.fits, "hardware": hw.name,
            "memory_limit_gib": est.memory_limit_bytes / GiB, "notes": est.notes}


def fitted_micro_batch(spec, sizes, seq, micro, hw, amp, workdir, log) -> tuple[int, str]:
    """The model's micro-batch, halved until `dufu plan` says the eager run fits on ``hw``."""
    while True:
        cfg, _ = dufu_config(spec, sizes, seq, micro, 10, amp, False, workdir / "plan")
        est = predict(cfg, hw)
        if est["fits"] or micro == 1:
            note = "" if est["fits"] else " (dufu plan says even this does not fit)"
            return micro, f"dufu plan predicts {est['memory_gib']:.1f} GiB of {est['memory_limit_gib']:.1f}{note}"
        log(f"  micro-batch {micro}: dufu plan predicts {est['memory_gib']:.1f} GiB, over "
            f"{est['memory_limit_gib']:.1f} GiB on {hw.name}: halving it")
        micro //= 2


# ----------------------------------------------------------------------------- the machine
def gpu_info(device: torch.device) -> dict:
    info = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}
    if device.type != "cuda":
        return {**info, "gpu": "cpu"}
    props = torch.cuda.get_device_properties(device)
    info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1),
                compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                gpus_visible=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    try:  # the driver version is only in nvidia-smi (optional)
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "gpu"


# ----------------------------------------------------------------------------- reporting
def fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def md_rows(rows: list[dict]) -> list[str]:
    header = ["model", "compile", "implementation", "micro-batch x seq", "tokens/s", "MFU", "vs plain",
              "peak allocated (GiB)", "dufu mem_* (metrics.jsonl)", "host reads/step", "first step (s)"]
    out = []
    for r in rows:
        plain = next((p for p in rows if p["model"] == r["model"] and p["compile"] == r["compile"]
                      and p["impl"] == "plain" and p.get("tokens_per_s")), None)
        if r.get("error"):
            out.append([r["model"], r["compile"], r["impl"], r["shape"], f"failed: {r['error'][:80]}", *["-"] * 6])
            continue
        mem = r.get("peak_allocated_gib") if r["impl"] != "plan" else r.get("memory_gib")
        mem_txt = fmt(mem, ".3g") + (" (predicted)" if r["impl"] == "plan" else "")
        dufu_mem = ", ".join(f"{k} {v:,.3g}" for k, v in r.get("mem", {}).items()) or "n/a"
        out.append([r["model"], r["compile"], r["impl"], r["shape"], f"{r['tokens_per_s']:,.0f}",
                    f"{100 * r['mfu']:.1f}%",
                    f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if plain else "-",
                    mem_txt, dufu_mem if r["impl"] == "dufu" else "-",
                    fmt(r.get("host_reads_per_step"), ",.3g") if r["impl"] != "plan" else "-",
                    fmt(r.get("first_step_s"), ".2f") if r["impl"] != "plan" else "-"])
    return results.table(header, out)


def markdown(payload: dict) -> str:
    m, g = payload["machine"], payload["gpu"]
    lines = [f"# GPU benchmark, {payload['date'][:10]}, {g['gpu']}", "", f"`{payload['command']}`", "",
             f"{g['gpu']}" + (f" ({g['gpu_memory_gib']} GiB, compute capability {g['compute_capability']}, driver "
                              f"{g.get('driver') or 'n/a'})" if g["device"] == "cuda" else "")
             + f"; torch {g['torch']}, CUDA {g['cuda'] or 'n/a'}, Python {g['python']}; host {m['cpu']}.", ""]
    if payload["smoke"]:
        lines += ["`--smoke`: tiny models on the CPU, a check of the script, not a measurement.", ""]
    for name, mi in payload["models"].items():
        lines.append(f"- {name}: {mi.get('parameters', 0):,} parameters, {mi.get('tokens_per_step', 0):,} tokens/step "
                     f"({mi.get('micro_batch')} x {mi.get('seq')}), {mi.get('dtype')}, "
                     f"{fmt(mi.get('flops_per_token'), ',.3g')} FLOPs/token; MFU peak: {mi.get('peak_source')}; "
                     f"micro-batch: {mi.get('micro_batch_note')}")
    lines += ["", *md_rows(payload["rows"]), "",
              f"tokens/s: median step of {payload['steps']} steps after {payload['warmup']} warm-up steps (first "
              "step: compile and allocator warm-up). plan: `dufu plan`'s prediction for the same config on "
              f"{payload['plan_hardware']}. n/a: the run does not record it. The script's docstring says how each "
              f"column is measured. The run took {payload['wall_seconds']:.0f} s.", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU, 3 steps, compile off, fp32")
    p.add_argument("--out", default=None, help="folder for the results (default benchmarks/results; --smoke: none)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--compile", default=None, choices=("off", "on", "both"), help="default both (--smoke: off)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default bf16 (--smoke: fp32)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 50; --smoke: 3)")
    p.add_argument("--warmup", type=int, default=None, help="first steps left out of the median (10; --smoke: 1)")
    p.add_argument("--micro-batch", type=int, default=None, help="one micro-batch for every model (default: fitted)")
    p.add_argument("--budget-minutes", type=float, default=10.0, help="runs left when this is spent are skipped")
    p.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    args = p.parse_args(argv)
    s = args.smoke
    args.compile = args.compile or ("off" if s else "both")
    args.dtype = args.dtype or ("fp32" if s else "bf16")
    args.steps = args.steps or (3 if s else 50)
    args.warmup = args.warmup if args.warmup is not None else (1 if s else 10)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    device = torch.device("cuda") if torch.cuda.is_available() and not s else torch.device("cpu")
    if device.type != "cuda" and not s:
        p.error("no CUDA device: this benchmark is for a GPU machine (--smoke runs its code path on the CPU)")
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    amp = args.dtype == "bf16"
    out_dir = results.results_dir(args.out, s)
    # dufu's caches (tokenized corpus, measured peaks, compiled code) in a throw-away folder: a cold start each time.
    # --smoke checks the code path, not the cold start: it keeps a cache directory the caller set (a test session's).
    scratch = Path(tempfile.mkdtemp(prefix="dufu-gpu-", dir=args.workdir))
    if not (s and os.environ.get("DUFU_CACHE_DIR")):
        os.environ["DUFU_CACHE_DIR"] = str(scratch / "cache")

    def log(msg: str) -> None:
        print(msg, flush=True)

    started, t0 = _dt.datetime.now(), time.perf_counter()
    g = gpu_info(device)
    log(f"gpu benchmark on {g['gpu']}: torch {g['torch']}, CUDA {g['cuda']}; models {', '.join(names)}, "
        f"{args.dtype}, compile {args.compile}, {args.steps} steps ({args.warmup} warm-up)")
    hw = plan_hardware(device)
    rows, models, failed = [], {}, False
    try:
        for name in names:
            spec = MODELS[name]
            sizes = {**spec["model"], **(spec["smoke"] if s else {})}
            seq = SMOKE_SEQ if s else spec["seq"]
            full = {**LazyConfig.load(resolve_config_path(spec["recipe"])).model, **sizes}  # + the recipe's sizes
            if args.micro_batch or s:
                micro, note = args.micro_batch or SMOKE_MICRO_BATCH, "given" if args.micro_batch else "--smoke"
            else:
                micro, note = fitted_micro_batch(spec, sizes, seq, spec["micro_batch"], hw, amp, scratch, log)
            models[name] = {"recipe": spec["recipe"], "sizes": sizes, "seq": seq, "micro_batch": micro,
                            "micro_batch_note": note}
            shape = f"{micro} x {seq}"
            for compiled in compiles:
                label = "on" if compiled else "off"
                out = scratch / f"{name}-compile-{label}"
                cfg, overrides = dufu_config(spec, sizes, seq, micro, args.steps, amp, compiled, out,
                                             "cpu" if device.type == "cpu" else "auto")
                models[name]["dufu_overrides"] = overrides
                common = {"model": name, "compile": label, "shape": shape, "dtype": args.dtype}
                if (time.perf_counter() - t0) / 60 > args.budget_minutes:
                    log(f"{name} compile {label}: skipped, the --budget-minutes {args.budget_minutes:g} are spent")
                    rows += [{**common, "impl": i, "error": "skipped: time budget spent"} for i in ("dufu", "plain")]
                    continue
                log(f"{name} ({shape}), compile {label}: dufu")
                reset_memory(device)
                try:
                    ran = run_dufu(cfg, args, device, log)
                    models[name].update(ran["model"])
                    rows.append({**common, "impl": "dufu", **ran["row"]})
                except Exception as e:  # noqa: BLE001 -- one failed run is a row; the others still run
                    failed = True
                    log(traceback.format_exc())
                    rows.append({**common, "impl": "dufu", "error": f"{type(e).__name__}: {e}"})
                    ran = None
                finally:
                    shutil.rmtree(out, ignore_errors=True)  # the final checkpoint (13 GB for llama_1b)
                if ran is not None:
                    log(f"{name} ({shape}), compile {label}: plain PyTorch")
                    reset_memory(device)
                    try:
                        rows.append({**common, "impl": "plain", **run_plain(spec, full, seq, ran["batches"], compiled,
                                                                              amp, device, args, ran["model"])})
                    except Exception as e:  # noqa: BLE001
                        failed = True
                        log(traceback.format_exc())
                        rows.append({**common, "impl": "plain", "error": f"{type(e).__name__}: {e}"})
                try:  # a fresh copy of the config: the run's may have been filled in by the Trainer
                    plan_cfg, _ = dufu_config(spec, sizes, seq, micro, args.steps, amp, compiled, out)
                    rows.append({**common, "impl": "plan", **predict(plan_cfg, hw)})
                except Exception as e:  # noqa: BLE001
                    failed = True
                    log(traceback.format_exc())
                    rows.append({**common, "impl": "plan", "error": f"{type(e).__name__}: {e}"})
                for r in rows[-3:]:
                    if not r.get("error"):
                        log(f"  {r['impl']:5s} {r['tokens_per_s']:12,.0f} tokens/s  MFU {100 * r['mfu']:5.1f}%")
                reset_memory(device)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    wall = time.perf_counter() - t0
    cmd = "python benchmarks/gpu.py" + (" " + " ".join(sys.argv[1:]) if len(sys.argv) > 1 else "")
    payload = {"benchmark": "gpu", "date": started.isoformat(timespec="seconds"), "command": cmd, "smoke": s,
               "steps": args.steps, "warmup": args.warmup, "gpu": g, "plan_hardware": hw.describe(),
               "machine": machine.describe(peaks=False, gpu=g["gpu"], cuda=g["cuda"]), "models": models,
               "rows": rows, "wall_seconds": wall}
    text = markdown(payload)
    log("\n" + text)
    if out_dir is not None:
        stem = results.stem(out_dir, "gpu", f"{started:%Y-%m-%d}", slug(g["gpu"]))
        results.write(stem, json.loads(json.dumps(payload, default=str)), text)
        log(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
