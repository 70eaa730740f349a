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

* CUDA: the dense (no 2:4 sparsity) peak from the vendor data sheet, :data:`GPU_PEAKS`, matched by the words
  of ``torch.cuda.get_device_name`` (:func:`gpu_peak_tflops`). A GPU missing from the table has no peak and its
  runs report no MFU, as the start-up summary says, unless ``train.peak_tflops`` gives one: a measured
  2048-square matmul runs well below a GPU's peak and would overstate MFU. fp32 reads the rate without tensor
  cores unless fp32 matmuls may use TF32 (``torch.set_float32_matmul_precision``).
* CPU: there is no data sheet number for "this many threads of this CPU", so
  the peak is *measured*: the best throughput of a large square matmul in the
  training dtype (fp32, or bf16/fp16 under autocast), measured at every start,
  and cached as the best *quiet* value ever seen, per CPU model, thread count,
  dtype and torch version, in the dufu cache directory.
  Measured on 2 threads: Sapphire Rapids about 350 GFLOP/s fp32 and 2,000 bf16
  (AMX); AMD EPYC Zen 4 about 200 fp32 and 430 bf16 (AVX512-BF16); Ice Lake
  about 260 fp32 and 60 bf16 (no bf16 hardware). dufu.engine.precision picks
  the training dtype from these numbers.
* ``train.peak_tflops`` in the config (or ``DUFU_PEAK_TFLOPS``) overrides both.

How a measurement survives other processes on the cores (:func:`measure_matmuls`):

* every dtype is timed at the *same* matrix size (one size for all, chosen so the
  slowest dtype's matmul stays within a time budget), in alternation (one sample
  of each dtype in turn), each sample lasting about as long as the others (the
  faster dtype repeats its matmul), and the best sample of each counts;
* the load is measured while the matmuls run: the share of its threads' time this
  process spent ready to run but waiting for a core (the kernel's run-queue delay,
  ``/proc/self/task/*/schedstat``; where Linux does not report it, how far the
  process's CPU time falls short of wall time x threads). Above
  ``LOADED_WAIT_SHARE`` the reading is *under load*: it is used for this process
  only, labelled "measured under load: not cached", and never written to the
  cache; a cached peak is only raised by a quiet reading. A run's MFU basis is
  therefore the cached quiet peak where there is one, else this start-up's
  reading with that label in its source. (A cache entry written by a dufu that
  did not check the load, a bare number, is not trusted as a quiet peak.)
* under load, the dtypes' ratio, which picks the training dtype, is taken on one
  thread timed by its CPU time (:func:`matmul_speeds` says why): the same ratio
  as on a quiet machine, so the choice does not depend on the load.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from dufu.cache import atomic_write_text, file_lock, resolve_cache_dir
from dufu.layers.moe import MoE


@dataclass(frozen=True)
class GpuPeak:
    """One GPU's dense (no 2:4 sparsity) peaks, TFLOP/s per device, from its vendor data sheet.

    Most data sheets print the tensor-core figures *with* 2:4 sparsity (marked "*"), twice the dense rate a
    training run can reach: every number here is the dense one, half the starred figure. ``fp32`` is the rate
    without tensor cores (torch's default for fp32 matmuls, TF32 off); ``tf32`` the tensor-core rate with TF32
    allowed."""

    model: str  # the model's word in torch.cuda.get_device_name, e.g. "H100"
    variant: tuple = ()  # further words that must all be in the name ("NVL", "PCIE"); () matches any
    bf16: float = 0.0  # bf16/fp16 tensor cores (fp16 on GPUs without bf16: V100, T4), fp32 accumulate
    tf32: Optional[float] = None  # None: no TF32 (before Ampere)
    fp32: float = 0.0
    source: str = ""


# Most specific first: a name matches the first entry whose model word and variant words it contains, so
# "H100 NVL" and "H100 PCIe" are matched before the plain "H100" (SXM). Names are compared word by word, not by
# substring ("A10" is not "A100" or "A10G", "B200" is not "GB200").
GPU_PEAKS: tuple = (
    # NVIDIA H100 Tensor Core GPU data sheet (H100 SXM / H100 NVL columns; the NVL column is per GPU).
    GpuPeak("H100", ("NVL",), bf16=835.5, tf32=417.5, fp32=60.0, source="NVIDIA H100 data sheet, H100 NVL"),
    # NVIDIA H100 PCIe product brief / data sheet (PCIe column).
    GpuPeak("H100", ("PCIE",), bf16=756.5, tf32=378.0, fp32=51.0, source="NVIDIA H100 data sheet, H100 PCIe"),
    GpuPeak("H100", (), bf16=989.5, tf32=494.5, fp32=67.0, source="NVIDIA H100 data sheet, H100 SXM"),
    # H800: the H100's die with NVLink and FP64 cut for export; bf16/tf32/fp32 as the H100 of the same form factor
    # (NVIDIA H800 product page / data sheet).
    GpuPeak("H800", ("PCIE",), bf16=756.5, tf32=378.0, fp32=51.0, source="NVIDIA H800 data sheet, H800 PCIe"),
    GpuPeak("H800", (), bf16=989.5, tf32=494.5, fp32=67.0, source="NVIDIA H800 data sheet, H800 SXM"),
    # NVIDIA H200 Tensor Core GPU data sheet (H200 SXM / H200 NVL columns).
    GpuPeak("H200", ("NVL",), bf16=835.5, tf32=417.5, fp32=60.0, source="NVIDIA H200 data sheet, H200 NVL"),
    GpuPeak("H200", (), bf16=989.5, tf32=494.5, fp32=67.0, source="NVIDIA H200 data sheet, H200 SXM"),
    # NVIDIA GH200 Grace Hopper Superchip data sheet (its GPU: the H100 SXM's figures).
    GpuPeak("GH200", (), bf16=989.5, tf32=494.5, fp32=67.0, source="NVIDIA GH200 data sheet"),
    # NVIDIA GB200 NVL72 data sheet, per-GPU column (5 PFLOP/s bf16 and 2.5 TF32 with sparsity; 80 TFLOP/s fp32).
    GpuPeak("GB200", (), bf16=2500.0, tf32=1250.0, fp32=80.0, source="NVIDIA GB200 NVL72 data sheet, per GPU"),
    # NVIDIA HGX B200 data sheet, per-GPU column (4.5 PFLOP/s bf16 and 2.2 TF32 with sparsity; 75 TFLOP/s fp32).
    GpuPeak("B200", (), bf16=2250.0, tf32=1100.0, fp32=75.0, source="NVIDIA HGX B200 data sheet, per GPU"),
    # NVIDIA A100 Tensor Core GPU data sheet: SXM4 and PCIe, 40 and 80 GB, have the same compute figures.
    GpuPeak("A100", (), bf16=312.0, tf32=156.0, fp32=19.5, source="NVIDIA A100 data sheet"),
    # A800: the A100 with NVLink cut for export (NVIDIA A800 data sheet): the A100's compute figures.
    GpuPeak("A800", (), bf16=312.0, tf32=156.0, fp32=19.5, source="NVIDIA A800 data sheet"),
    # NVIDIA A10 Tensor Core GPU data sheet (bf16 125 dense, 250 with sparsity; TF32 62.5; fp32 31.2).
    GpuPeak("A10", (), bf16=125.0, tf32=62.5, fp32=31.2, source="NVIDIA A10 data sheet"),
    # A10G: AWS's own variant (EC2 G5 instances) has no NVIDIA data sheet, and AWS publishes no TFLOP/s for it.
    # The figures are third parties' (Baseten's "NVIDIA A10 vs A10G" comparison: fewer tensor-core FLOP/s than
    # the A10), not a vendor's: where MFU must be exact on an A10G, give train.peak_tflops.
    GpuPeak("A10G", (), bf16=70.0, tf32=35.0, fp32=31.2,
            source="no vendor data sheet; third-party figures for the AWS A10G"),
    # NVIDIA L4 Tensor Core GPU data sheet (bf16 242, TF32 120 with sparsity; fp32 30.3).
    GpuPeak("L4", (), bf16=121.0, tf32=60.0, fp32=30.3, source="NVIDIA L4 data sheet"),
    # NVIDIA L40S data sheet (bf16 362.05 dense, 733 with sparsity; TF32 183; fp32 91.6).
    GpuPeak("L40S", (), bf16=362.05, tf32=183.0, fp32=91.6, source="NVIDIA L40S data sheet"),
    # NVIDIA L40 data sheet (bf16 181.05 dense, 362.1 with sparsity; TF32 90.5; fp32 90.5).
    GpuPeak("L40", (), bf16=181.05, tf32=90.5, fp32=90.5, source="NVIDIA L40 data sheet"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 (fp16/bf16 with fp32 accumulate 165.2).
    GpuPeak("4090", ("RTX",), bf16=165.2, tf32=82.6, fp32=82.6, source="NVIDIA Ada GPU architecture whitepaper"),
    # NVIDIA V100 Tensor Core GPU data sheet: fp16 tensor cores only (no bf16, no TF32); PCIe is clocked lower.
    GpuPeak("V100", ("PCIE",), bf16=112.0, fp32=14.0, source="NVIDIA V100 data sheet, V100 PCIe"),
    GpuPeak("V100", (), bf16=125.0, fp32=15.7, source="NVIDIA V100 data sheet, V100 SXM2"),
    # NVIDIA T4 Tensor Core GPU data sheet (fp16 mixed precision 65; fp32 8.1).
    GpuPeak("T4", (), bf16=65.0, fp32=8.1, source="NVIDIA T4 data sheet"),
)


def _name_words(device_name: str) -> set:
    """The words of a device name, upper case: "NVIDIA A100-SXM4-80GB" -> {"NVIDIA", "A100", "SXM4", "80GB"}."""
    return set(re.split(r"[^A-Z0-9]+", device_name.upper())) - {""}


def gpu_peak(device_name: str) -> Optional[GpuPeak]:
    """The table entry of a GPU named as ``torch.cuda.get_device_name`` names it, else None."""
    words = _name_words(device_name)
    for entry in GPU_PEAKS:
        if entry.model in words and all(v in words for v in entry.variant):
            return entry
    return None


def gpu_peak_tflops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Optional[tuple[float, str]]:
    """(dense peak TFLOP/s, where it comes from) of the GPU ``device_name`` in ``dtype``, or None for a GPU the
    table does not hold. fp32 reads the non-tensor-core rate unless ``tf32`` (fp32 matmuls allowed to use TF32)."""
    entry = gpu_peak(device_name)
    if entry is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        return entry.bf16, f"{entry.bf16:g} TFLOP/s, dense {_name(dtype)} peak of {device_name} ({entry.source})"
    if tf32 and entry.tf32 is not None:
        return entry.tf32, f"{entry.tf32:g} TFLOP/s, dense TF32 peak of {device_name} ({entry.source})"
    return entry.fp32, f"{entry.fp32:g} TFLOP/s, fp32 peak of {device_name} without tensor cores ({entry.source})"


def _tf32_allowed() -> bool:
    """Whether fp32 matmuls on CUDA may run in TF32 (torch's default: no)."""
    return torch.get_float32_matmul_precision() != "highest"


def unknown_gpu_peak(device_name: str) -> str:
    """The MFU line's sentence for a GPU the table does not hold."""
    return (f"n/a: {device_name} is not in dufu's table of data-sheet peaks (dufu.engine.reporting.flops.GPU_PEAKS), "
            "so MFU is not reported; train.peak_tflops=<dense TFLOP/s of one device in the training dtype> sets it")


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


# A reading is under load when this process's threads waited for a core this share of their time or more. With a
# core each, threads do not wait; one other busy process on a 2-core machine where dufu runs 2 threads takes half
# of one thread's time (0.25); two CPU hogs there read 0.8-0.95 (tests/engine/test_flops.py prints it).
LOADED_WAIT_SHARE = 0.1
MIN_ROUNDS = 3  # samples of each dtype, however long they take: the best of fewer is no statistic
MAX_REPEATS = 16  # a fast dtype repeats its matmul at most this often to last as long as the slow one's
ONE_THREAD_SIZE = 512  # the one-thread comparison under load: short samples, many of them in 0.5 s


class LoadMeter:
    """How much other processes held this process back while the block ran (``with LoadMeter(threads) as load:``).

    ``wait_share``: the share of its ``threads`` threads' time the process spent ready to run but waiting for a
    core, from the kernel's run-queue delay of each thread (``/proc/self/task/*/schedstat``, Linux), or where that
    is not reported (``method`` says which), 1 - CPU time / (wall time x threads)."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self.wait_share = 0.0
        self.method = "run-queue wait" if _run_queue_waits() is not None else "CPU time"

    def __enter__(self) -> "LoadMeter":
        self._waits, self._cpu, self._wall = _run_queue_waits(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self._wall, 1e-9) * self.threads
        waits = _run_queue_waits()
        if self._waits is not None and waits is not None:
            # a thread that started inside the block waited all its life inside it
            waited = sum(ns - self._waits.get(tid, 0) for tid, ns in waits.items()) / 1e9
            self.wait_share = min(1.0, max(0.0, waited / wall))
        else:
            self.wait_share = min(1.0, max(0.0, 1.0 - (time.process_time() - self._cpu) / wall))

    @property
    def under_load(self) -> bool:
        return self.wait_share >= LOADED_WAIT_SHARE

    def describe(self) -> str:
        what = "waited for a core" if self.method == "run-queue wait" else "were not running"
        return f"its {self.threads} thread{'s' if self.threads > 1 else ''} {what} {self.wait_share:.0%} of the time"


def _run_queue_waits() -> dict[str, int] | None:
    """Nanoseconds each thread of this process has spent waiting on a run queue, by thread id; None where the
    kernel does not report it."""
    waits = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            waits[tid] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except FileNotFoundError:
            continue  # the thread ended between the listing and the read
        except (OSError, IndexError, ValueError):
            return None
    return waits or None


@dataclass
class MatmulReading:
    """One measurement (:func:`measure_matmuls`): ``samples`` the FLOP/s of every sample of each dtype (a sample:
    ``repeats[dtype]`` matmuls of ``size`` x ``size`` matrices), ``speeds`` the best of each, and the load while
    they ran."""

    samples: dict
    size: int
    repeats: dict
    load: LoadMeter
    cpu_time: bool = False  # timed by the thread's CPU time, not the wall clock

    @property
    def speeds(self) -> dict:
        return {dtype: max(s) for dtype, s in self.samples.items()}

    @property
    def under_load(self) -> bool:
        return self.load.under_load

    def describe(self) -> str:
        """E.g. "1024x1024 matmuls, best of 9 samples each; its 2 threads waited for a core 31% of the time"."""
        rounds = min(len(s) for s in self.samples.values())
        clock = ", timed by CPU time" if self.cpu_time else ""
        return f"{self.size}x{self.size} matmuls{clock}, best of {rounds} samples each; {self.load.describe()}"


def _timed_matmuls(a: torch.Tensor, b: torch.Tensor, device: torch.device, repeats: int = 1,
                   clock=time.perf_counter) -> float:
    """Seconds ``repeats`` matmuls of ``a`` and ``b`` take by ``clock``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    for _ in range(repeats):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - t0


def _common_size(dtypes, device: torch.device, size: int, budget: float = 0.25, smallest: int = 256) -> int:
    """``size``, halved until one matmul of the slowest of ``dtypes`` takes about ``budget`` seconds or less (timed
    at ``smallest``, best of three, and scaled by n^3); the same size for every dtype, so that their ratio compares
    like with like (a small matrix runs further below the peak than a large one). A dtype the hardware does not
    compute natively can be 100x slower: bf16 on a CPU without AVX-512 runs at ~1 GFLOP/s, where one 2048 matmul
    takes ~17 s; a smaller matmul tells the same (that the dtype is slow) in milliseconds. The budget is generous,
    so a load that slows the timing a few times over does not change the size."""
    slowest = 0.0
    for dtype in dtypes:
        a, b = (torch.randn(smallest, smallest, device=device).to(dtype) for _ in range(2))
        torch.matmul(a, b)  # warm-up (kernel selection, oneDNN/AMX init)
        slowest = max(slowest, min(_timed_matmuls(a, b, device) for _ in range(3)))
    n = size
    while n > smallest and slowest * (n / smallest) ** 3 > budget:
        n //= 2
    return n


def measure_matmuls(device: torch.device, dtypes, size: int = 2048, seconds: float = 0.8,
                    cpu_time: bool = False) -> MatmulReading:
    """The best FLOP/s of an (n x n) @ (n x n) matmul in each of ``dtypes``, measured now, and the load meanwhile.

    One n for all dtypes (:func:`_common_size`, at most ``size``); the dtypes alternate, one sample of each in turn,
    and the faster ones repeat their matmul so every sample lasts about as long as the slowest dtype's matmul (a
    load then hits them alike; the repeats follow the best time per matmul seen so far); at least ``MIN_ROUNDS``
    samples of each, more until ``seconds`` have passed. ``cpu_time``: time by this thread's CPU time instead of
    the wall clock (one thread on the CPU only): the matmuls' speed while they ran, however often the thread
    waited for a core."""
    if cpu_time and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("cpu_time=True times one thread's CPU time: use it on the CPU with torch.set_num_threads(1) "
                         f"(here: {device.type}, {torch.get_num_threads()} threads).")
    clock = time.thread_time if cpu_time else time.perf_counter
    dtypes = tuple(dict.fromkeys(dtypes))
    n = _common_size(dtypes, device, size)
    pairs = {dtype: tuple(torch.randn(n, n, device=device).to(dtype) for _ in range(2)) for dtype in dtypes}
    per_matmul = {}
    for dtype, (a, b) in pairs.items():
        torch.matmul(a, b)  # warm-up at the measured size
        per_matmul[dtype] = max(_timed_matmuls(a, b, device, 1, clock), 1e-9)
    samples, repeats = {dtype: [] for dtype in dtypes}, {}
    with LoadMeter(torch.get_num_threads() if device.type == "cpu" else 1) as load:
        deadline = time.perf_counter() + seconds
        while len(samples[dtypes[0]]) < MIN_ROUNDS or time.perf_counter() < deadline:
            longest = max(per_matmul.values())
            for dtype, (a, b) in pairs.items():
                repeats[dtype] = max(1, min(MAX_REPEATS, round(longest / per_matmul[dtype])))
                t = max(_timed_matmuls(a, b, device, repeats[dtype], clock), 1e-9)
                per_matmul[dtype] = min(per_matmul[dtype], t / repeats[dtype])
                samples[dtype].append(2.0 * n**3 * repeats[dtype] / t)
    return MatmulReading(samples, n, repeats, load, cpu_time)


@contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _data_sheet(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """The vendor's dense peak (FLOP/s, source) for a GPU of :data:`GPU_PEAKS`, else None."""
    if device.type != "cuda":
        return None
    sheet = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype, tf32=_tf32_allowed())
    return None if sheet is None else (sheet[0] * 1e12, sheet[1])


class DtypeSpeeds(dict):
    """``{dtype: FLOP/s}`` from :func:`matmul_speeds`; ``note`` says how they were measured when that was not at
    the process's threads by the wall clock (under load), else it is empty."""

    note: str = ""


def matmul_speeds(device: torch.device, dtypes, size: int = 2048, seconds: float = 0.8) -> DtypeSpeeds:
    """FLOP/s of a matmul in each of ``dtypes``, measured now (:func:`measure_matmuls`: one size for all, in
    alternation, best of each), to compare the dtypes. Known GPUs answer from the data sheet. On the CPU each
    reading is kept as the dtype's peak (:func:`keep_reading`): in the cache when it was quiet, for this process
    only when it was taken under load. A GPU missing from the table is measured for the comparison only: a
    2048-square matmul runs well below a GPU's peak, so it is no MFU basis (:func:`device_peak_flops`).

    Under load the CPU's dtypes are compared once more, on one thread timed by its CPU time (``ONE_THREAD_SIZE``
    matrices, 0.5 s), and those speeds are returned. By the wall clock a load decides which dtype reads faster:
    a process's OpenMP threads wait for each other at every barrier inside a matmul, so one thread waiting for a
    core stalls them all, more often in a kernel with more barriers (on 2 shared cores fp32 read 2 GFLOP/s, 1/150
    of its quiet speed, and bf16 14.8x fp32 where it is ~6x quiet); even one thread's best wall-clock sample is
    luck when the thread gets a fraction of a core. One thread's CPU time counts only the time it ran: its ratio
    reads the same quiet and beside CPU hogs (tests/engine/test_flops.py). ``note`` of the result and the peak's
    label (:func:`device_peak_flops`) say so."""
    sheet = {dtype: _data_sheet(device, dtype) for dtype in dtypes}
    if all(sheet.values()):
        return DtypeSpeeds({dtype: sheet[dtype][0] for dtype in dtypes})
    reading = measure_matmuls(device, dtypes, size, seconds)
    speeds, how = DtypeSpeeds(reading.speeds), reading.describe()
    if reading.under_load and device.type == "cpu" and len(speeds) > 1:
        with _threads(1):
            single = measure_matmuls(device, dtypes, min(size, ONE_THREAD_SIZE), seconds=0.5, cpu_time=True)
        speeds = DtypeSpeeds(single.speeds)
        speeds.note = f"one thread, by CPU time: under load, {reading.load.describe()}"
        low, high = min(speeds, key=speeds.get), max(speeds, key=speeds.get)
        how += (f"; the dtypes compared on one thread instead ({single.describe()}): "
                f"{_name(high)} {speeds[high] / speeds[low]:.2f}x {_name(low)}")
    if device.type == "cpu":
        for dtype, flop_s in reading.speeds.items():
            keep_reading(device, dtype, flop_s, reading.under_load, how)
    return speeds


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Readings this process took but did not cache (under load, or of unknown load): key -> (best FLOP/s, why). They
# serve this process (this run) only, as the MFU basis where the cache has no quiet peak, labelled as such.
_UNCACHED: dict[str, tuple[float, str]] = {}


def _key(device: torch.device, dtype: torch.dtype) -> str:
    name = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}"


def _cache_file() -> Path:
    return resolve_cache_dir() / "peak_flops.json"


def _read_cache() -> dict:
    try:
        table = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _quiet_peak(table: dict, key: str) -> float | None:
    """The cached quiet peak; an entry without the load check (a bare number, from an older dufu) is none."""
    entry = table.get(key)
    return float(entry["flop_s"]) if isinstance(entry, dict) and "flop_s" in entry else None


def keep_reading(device: torch.device, dtype: torch.dtype, flop_s: float, under_load: bool | None,
                 how: str = "") -> bool:
    """Keep a matmul reading: a quiet one (``under_load`` False) raises the cached peak when it beats it; one taken
    under load (True) or whose load was not checked (None) is kept for this process only, never cached. ``how``:
    how it was measured (for the label). Returns whether the reading counted for the cache (it was quiet, and the
    cache holds it or a better one)."""
    key = _key(device, dtype)
    if under_load is False:
        cache = _cache_file()
        try:
            with file_lock(cache.with_name(cache.name + ".lock")):
                table = _read_cache()
                if flop_s > (_quiet_peak(table, key) or 0.0):
                    table[key] = {"flop_s": flop_s, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "how": how}
                    atomic_write_text(cache, json.dumps(table, indent=1))
            return True
        except OSError as e:
            why = f"quiet, but the cache {cache} could not be written ({e}): not cached"
    elif under_load:
        why = f"measured under load: not cached ({how})" if how else "measured under load: not cached"
    else:
        why = "load not checked: not cached"
    if flop_s > _UNCACHED.get(key, (0.0, ""))[0]:
        _UNCACHED[key] = (flop_s, why)
    return False


def device_peak_flops(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None,
                      remeasure: bool = True, measured: float | None = None,
                      under_load: bool | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in ``dtype``, a sentence saying where the number comes from).

    ``train.peak_tflops`` (``override_tflops``, or ``DUFU_PEAK_TFLOPS``) wins; a GPU of :data:`GPU_PEAKS` answers
    from its data sheet; any other CUDA device has no peak: (None, "n/a: ...", saying that train.peak_tflops sets
    it), and the run reports no MFU. On the CPU:

    The peak is the cached best quiet reading; where the cache has none, this process's best reading taken under
    load, with "measured under load: not cached" in the sentence. ``measured``: a reading the caller just took
    (kept by :func:`keep_reading`, cached only with ``under_load=False``; nothing more is measured).
    ``remeasure=False`` measures only where neither the cache nor this process has a reading."""
    if override_tflops is None and os.environ.get("DUFU_PEAK_TFLOPS"):
        override_tflops = float(os.environ["DUFU_PEAK_TFLOPS"])
    if override_tflops is not None:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s given in the config"
    sheet = _data_sheet(device, dtype)
    if sheet is not None:
        return sheet
    if device.type != "cpu":  # a GPU missing from the table: a measured matmul would overstate MFU
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        return None, unknown_gpu_peak(name)
    key = _key(device, dtype)
    if measured is not None:
        keep_reading(device, dtype, measured, under_load)
    elif remeasure or (_quiet_peak(_read_cache(), key) is None and key not in _UNCACHED):
        reading = measure_matmuls(device, (dtype,), seconds=0.6)
        keep_reading(device, dtype, reading.speeds[dtype], reading.under_load, reading.describe())
    name = cpu_name()
    threads = torch.get_num_threads()
    what = f"{_name(dtype)} matmul on {name} with {threads} thread{'s' if threads != 1 else ''}"
    quiet, uncached = _quiet_peak(_read_cache(), key), _UNCACHED.get(key)
    if quiet is not None:
        later = (f"; a reading of this run, {uncached[0] / 1e9:,.0f} GFLOP/s, was {uncached[1]}"
                 if uncached is not None else "")
        return quiet, f"{quiet / 1e9:,.0f} GFLOP/s, measured best quiet {what} (cached{later})"
    flop_s, why = uncached
    return flop_s, f"{flop_s / 1e9:,.0f} GFLOP/s, {what}, {why}"
