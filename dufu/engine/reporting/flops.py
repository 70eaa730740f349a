"""Model FLOPs and device peak, for MFU (model FLOPs utilisation).

Training FLOPs per token follow the PaLM paper (Chowdhery et al. 2022, app. B):

    flops_per_token = 6 * N + 12 * L * H * T

* ``N``: parameters that take part in a matrix multiply (every weight except the
  token/position lookup tables; a tied output head counts once, as a matmul).
  6 = 2 (multiply-add) x 3 (forward + backward, which costs twice the forward).
* ``12 * L * H * T``: attention scores and the weighted sum of values for L
  layers, hidden size H and sequence length T (forward + backward, causal
  masking not discounted, as in PaLM).

Activation recomputation is *not* counted (that would be hardware FLOPs, not
model FLOPs). MFU = flops_per_token * tokens_per_second / (peak * devices).

Peak FLOP/s, per device and dtype:

* CUDA: the dense tensor-core peak from the vendor data sheet for known GPUs
  (table below); unknown GPUs are measured like the CPU.
* CPU: there is no data sheet number for "this many threads of this CPU", so
  the peak is *measured*: the best throughput of a large square matmul in the
  training dtype (fp32, or bf16/fp16 under autocast), measured at every start
  and cached as the best value ever seen, per CPU model, thread count, dtype and
  torch version, in the dufu cache directory (a reading taken while other
  processes share the cores is low and does not stick).
  Measured on 2 threads: Sapphire Rapids about 350 GFLOP/s fp32 and 2,000 bf16
  (AMX); AMD EPYC Zen 4 about 200 fp32 and 430 bf16 (AVX512-BF16); Ice Lake
  about 260 fp32 and 60 bf16 (no bf16 hardware). dufu.engine.precision picks
  the training dtype from these numbers.
* ``train.peak_tflops`` in the config (or ``DUFU_PEAK_TFLOPS``) overrides both.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
from torch import nn

from dufu.layers.moe import MoE

from dufu.cache import resolve_cache_dir

# Dense (no sparsity) peak TFLOP/s from vendor data sheets: (bf16/fp16, fp32 non-tensor-core).
_GPU_PEAK_TFLOPS = {
    "H200": (989.0, 67.0),
    "H100": (989.0, 67.0),  # SXM; PCIe is lower (756), matched below
    "H100 PCIE": (756.0, 51.0),
    "A100": (312.0, 19.5),
    "A800": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "A10G": (70.0, 31.2),
    "RTX 4090": (165.0, 82.6),
    "V100": (125.0, 15.7),
    "T4": (65.0, 8.1),
}


def count_matmul_params(model: nn.Module, active: bool = True) -> int:
    """Parameters used in matrix multiplies: all but embedding tables (tied weights counted once). ``active``:
    count only the parameters one token uses, so a mixture-of-experts layer's experts count top_k / E of
    theirs (the model FLOPs per token of MoE models, as Megatron-core and torchtitan count them for MFU)."""
    seen: set[int] = set()
    total = 0.0
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    share = {}  # id(parameter) -> the fraction of it a token uses
    if active:
        for m in model.modules():
            if isinstance(m, MoE):
                share.update({id(p): m.top_k / m.num_experts for p in m.experts.parameters()})
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embedding_params and id(p) not in heads:
            continue
        total += p.numel() * share.get(id(p), 1.0)
    return int(round(total))


def flops_per_token(num_matmul_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    return 6.0 * num_matmul_params + 12.0 * num_layers * hidden_size * seq_length


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed_matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _matmul_size(dtype, device: torch.device, size: int, budget: float = 0.1, smallest: int = 256) -> int:
    """``size``, halved until one matmul of ``dtype`` takes about ``budget`` seconds or less (timed at ``smallest``
    and scaled by n^3). A dtype the hardware does not compute natively can be 100x slower: bf16 on a CPU without
    AVX-512 runs at ~1 GFLOP/s, where one 2048 matmul takes ~17 s and measuring it held every start-up for
    half a minute; a smaller matmul tells the same (that the dtype is slow) in milliseconds."""
    a, b = (torch.randn(smallest, smallest, device=device).to(dtype) for _ in range(2))
    torch.matmul(a, b)  # warm-up (kernel selection, oneDNN/AMX init)
    t = _timed_matmul(a, b, device)
    n = size
    while n > smallest and t * (n / smallest) ** 3 > budget:
        n //= 2
    return n


def _best_matmul_flops(dtypes, device: torch.device, size: int, seconds: float) -> dict:
    """Best observed FLOP/s of a (size x size) @ (size x size) matmul in each of ``dtypes`` (smaller for a dtype
    so slow that one such matmul would take long: :func:`_matmul_size`), one matmul of each dtype in turn (so a
    load that shares the cores slows them alike), until ``seconds`` have passed."""
    sizes = {dtype: _matmul_size(dtype, device, size) for dtype in dtypes}
    pairs = {dtype: tuple(torch.randn(sizes[dtype], sizes[dtype], device=device).to(dtype) for _ in range(2))
             for dtype in dtypes}
    for a, b in pairs.values():
        torch.matmul(a, b)  # warm-up at the measured size
    best = dict.fromkeys(dtypes, 0.0)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or min(best.values()) == 0.0:
        for dtype, (a, b) in pairs.items():
            best[dtype] = max(best[dtype], 2.0 * sizes[dtype] ** 3 / _timed_matmul(a, b, device))
    return best


def measure_matmul_flops(dtype: torch.dtype, device: torch.device, size: int = 2048, seconds: float = 0.6) -> float:
    """Best observed FLOP/s of a (size x size) @ (size x size) matmul."""
    return _best_matmul_flops((dtype,), device, size, seconds)[dtype]


def _data_sheet(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """The vendor's dense peak for a known GPU, else None."""
    if device.type != "cuda":
        return None
    low_precision = dtype in (torch.bfloat16, torch.float16)
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(_GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            tf = _GPU_PEAK_TFLOPS[key][0 if low_precision else 1]
            return tf * 1e12, f"{tf:g} TFLOP/s, data-sheet peak of {name} ({'bf16' if low_precision else 'fp32'})"
    return None


def matmul_speeds(device: torch.device, dtypes, size: int = 2048, seconds: float = 0.8) -> dict:
    """FLOP/s of a (size x size) matmul in each of ``dtypes``, measured now and in alternation (one matmul of
    each dtype in turn, best of each), so a load that shares the cores slows them alike and their ratio holds.
    Known GPUs answer from the data sheet. What is measured also updates the cache of best values."""
    sheet = {dtype: _data_sheet(device, dtype) for dtype in dtypes}
    if all(sheet.values()):
        return {dtype: sheet[dtype][0] for dtype in dtypes}
    best = _best_matmul_flops(dtypes, device, size, seconds)
    for dtype, flops in best.items():
        device_peak_flops(device, dtype, measured=flops)
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None,
                      remeasure: bool = True, measured: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device in ``dtype``, a sentence saying where the number comes from).

    ``measured``: a reading the caller just took (it is recorded; nothing more is measured).
    ``remeasure=False`` takes the cached best value where there is one (no 0.6 s measurement)."""
    if override_tflops is None and os.environ.get("DUFU_PEAK_TFLOPS"):
        override_tflops = float(os.environ["DUFU_PEAK_TFLOPS"])
    if override_tflops is not None:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s given in the config"
    sheet = _data_sheet(device, dtype)
    if sheet is not None:
        return sheet
    cpu = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    key = f"{device.type}|{cpu}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"
    cache = resolve_cache_dir() / "peak_flops.json"
    table = {}
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    # Measure at every start (0.6 s) and keep the best value ever seen: a measurement taken while other
    # processes share the cores reads low, and must not stick.
    if measured is None:
        measured = measure_matmul_flops(dtype, device) if remeasure or key not in table else 0.0
    if measured > table.get(key, 0.0):
        table[key] = measured
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, cache)
        except OSError:
            pass
    peak = table[key]
    return peak, (
        f"{peak / 1e9:,.0f} GFLOP/s, measured best {str(dtype).replace('torch.', '')} matmul on {cpu} "
        f"with {torch.get_num_threads()} threads"
    )
