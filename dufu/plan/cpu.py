"""This machine's CPU as a device of the cost model: measured, once, and cached (what is measured:
:mod:`dufu.plan.hardware`; the record it fills: :class:`dufu.plan.device.Hardware`).

A figure the probe cannot measure (no loopback networking for the two gloo processes, a worker that failed, no
``/proc/meminfo``) is not made up silently: the record carries a conservative stand-in for it, listed under
``"assumed"`` with the reason, the Hardware's ``source`` says "assumed, not measured" (:func:`assumed_figures`
reads it back for the plan's notes), and a record with an assumed figure is never written to the cache, so the
next plan measures again. The same holds for a probe taken while other processes held it back from the cores (the
run-queue wait of :class:`dufu.engine.reporting.flops.LoadMeter`): its figures serve this plan, labelled "measured
under load", and the next plan measures again."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dufu.cache import file_lock, resolve_cache_dir
from dufu.engine.reporting.flops import LoadMeter, cpu_name, device_peak_flops
from dufu.models.gpt import GPTModel
from dufu.plan.device import GB, Hardware

# The matmul shapes the CPU probe times, (m, n, k): a large square, then the small dimensions a transformer's
# projections meet (few tokens per micro-batch; a head's width).
_PROBE_SHAPES = ((1024, 1024, 1024), (256, 1024, 1024), (64, 1024, 1024), (1024, 1024, 64), (128, 128, 128))
_CACHE_FILE = "plan_hardware.json"
_PROBE_VERSION = 11
# The model whose measured training step calibrates a CPU (a 2-layer GPT 512 wide, 4 x 64 tokens per step).
CALIBRATION_MODEL = dict(vocab_size=2048, hidden_size=512, num_layers=2, num_attention_heads=8,
                         max_position_embeddings=64, embedding_dropout=0.0, hidden_dropout=0.0,
                         attention_dropout=0.0)
CALIBRATION_BATCH = (4, 64)
# One tensor-parallel op costs several plain ops' dispatch: DTensor's sharding propagation and redistribution
# (measured on this project's CPU runs: TP layouts of a 4-layer GPT spend 2x the step time of one process at
# equal FLOPs).
_DTENSOR_OP_FACTOR = 12.0


def _cpu_key() -> str:
    return f"{cpu_name()}|cores={os.cpu_count()}|torch={torch.__version__}|probe={_PROBE_VERSION}"


def measured_cpu(remeasure: bool = False) -> Hardware:
    """This machine's CPU as a :class:`Hardware`: measured once (about two seconds) and cached. Concurrent callers
    (every rank of a job) wait for one measurement and read the same figures."""
    cache = resolve_cache_dir() / _CACHE_FILE
    key = _cpu_key()

    def read() -> dict:
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):
            return {}

    probe = None if remeasure else read().get(key)
    if probe is None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(cache.with_suffix(".lock")):
            table = read()
            probe = None if remeasure else table.get(key)
            if probe is None:
                probe = _best_of(probe_cpu(), table.get(key))
                # neither a stand-in nor a reading held back by other processes is cached as a measurement
                if not probe.get("assumed") and not probe.get("under_load"):
                    table[key] = probe
                    try:
                        tmp = cache.with_suffix(f".tmp{os.getpid()}")
                        tmp.write_text(json.dumps(table, indent=1))
                        os.replace(tmp, cache)
                    except OSError:
                        pass
    return cpu_from_probe(probe)


# Figures where more is better; every other timing figure is better smaller. A measurement taken while other work
# shares the cores only reads worse, so a new probe keeps the better of each figure.
_RATES = ("elementwise_bandwidth", "transcendental_bandwidth", "attention_efficiency", "optimizer_bandwidth",
          "stream_bandwidth", "gloo_bandwidth", "page_fault_bandwidth", "gloo_all_gather_bandwidth")
_TIMES = ("op_overhead_s", "gloo_latency_s")


def _best_of(new: dict, old) -> dict:
    """``new`` with each figure replaced by ``old``'s where that one is better (see _RATES). A figure ``new`` could
    not measure (its ``"assumed"``) is ``old``'s measured one, never a mix with the stand-in."""
    if not old:
        return new
    merged = dict(new)
    assumed = dict(new.get("assumed", {}))
    for k in _RATES:
        if k in old:
            merged[k] = old[k] if k in assumed else max(new.get(k, 0.0), old[k])
    for k in _TIMES:
        if k in old:
            merged[k] = old[k] if k in assumed else min(new.get(k, float("inf")), old[k])
    for k in list(assumed):
        if k in old:
            del assumed[k]
    if assumed:
        merged["assumed"] = assumed
    else:
        merged.pop("assumed", None)
    merged["gemm"] = {t: {d: max(v, old.get("gemm", {}).get(t, {}).get(d, 0.0)) for d, v in rates.items()}
                      for t, rates in new["gemm"].items()}
    old_cal = {str(t): v for t, v in old.get("calibration", {}).items()}
    merged["calibration"] = {t: min(v, old_cal.get(str(t), v)) for t, v in new.get("calibration", {}).items()}
    return merged


# The marker :func:`cpu_from_probe` writes into a Hardware's ``source`` before the figures it could not measure.
ASSUMED = "assumed, not measured"
# ... and after the figures of a probe that other processes held back from the cores.
UNDER_LOAD = "measured under load"
# Stand-ins for what the probe could not measure: conservative loopback figures for gloo (0: the planner uses
# the all-reduce's bandwidth for all-gathers and no page-fault cost), and a small machine's memory.
_GLOO_STAND_IN = {"gloo_latency_s": 2e-3, "gloo_bandwidth": 0.5e9, "page_fault_bandwidth": 0.0,
                  "gloo_all_gather_bandwidth": 0.0}
_MEMORY_STAND_IN = 16 * GB


def cpu_from_probe(probe: dict) -> Hardware:
    """The :class:`Hardware` of a probe record (see :func:`probe_cpu`); figures the probe could not measure are
    named in ``source`` after :data:`ASSUMED`, and ``measured`` is False then."""
    cores = int(probe["cores"])
    flops = {int(t): v for t, v in probe["gemm"].items()}
    assumed = dict(probe.get("assumed", {}))
    memory = _meminfo_bytes()
    if memory is None:
        memory = _MEMORY_STAND_IN
        assumed["memory_bytes"] = f"/proc/meminfo unreadable: {_MEMORY_STAND_IN / GB:.0f} GB taken"
    source = (f"measured on this machine ({probe['date']}): matmul, elementwise ops, attention, AdamW, op dispatch"
              + (", gloo all-reduce" if not any(k.startswith("gloo") for k in assumed) else ""))
    if probe.get("under_load"):
        source += f"; {UNDER_LOAD} ({probe['under_load']}): not cached"
    if assumed:
        by_reason: dict = {}
        for k, why in sorted(assumed.items()):
            by_reason.setdefault(why, []).append(k)
        source += f"; {ASSUMED}: " + "; ".join(f"{', '.join(ks)} ({why})" for why, ks in by_reason.items())
    return Hardware(
        name="cpu", description=f"this machine: {probe['cpu']}, {cores} cores, one process per device",
        peak_flops=dict(flops[1]), memory_bytes=memory, memory_bandwidth=probe["stream_bandwidth"],
        intra_node_bandwidth=probe["gloo_bandwidth"], inter_node_bandwidth=probe["gloo_bandwidth"],
        devices_per_node=max(cores, 1) * 64,  # every process on this one machine
        gemm_efficiency=1.0, gemm_half_size=probe["gemm_half_size"], attention_efficiency=probe["attention_efficiency"],
        memory_efficiency=1.0, comm_efficiency=1.0, elementwise_bandwidth=probe["elementwise_bandwidth"],
        transcendental_bandwidth=probe["transcendental_bandwidth"], optimizer_bandwidth=probe["optimizer_bandwidth"],
        op_overhead_s=probe["op_overhead_s"], param_op_overhead_s=probe["op_overhead_s"] * _DTENSOR_OP_FACTOR,
        # a two-rank ring all-reduce takes two steps: the measured latency is two of them
        intra_latency_s=probe["gloo_latency_s"] / 2, inter_latency_s=probe["gloo_latency_s"] / 2, overlap=0.0,
        reserved_bytes=0.0, synchronous=True, cores=cores, thread_flops=flops, measured=not assumed,
        calibration={int(t): v for t, v in probe.get("calibration", {}).items()},
        page_fault_bandwidth=probe.get("page_fault_bandwidth", 0.0),
        all_gather_bandwidth=probe.get("gloo_all_gather_bandwidth", 0.0),
        source=source,
    )


def assumed_figures(hw: Hardware) -> str:
    """The figures of ``hw`` that are stand-ins, with why ("" when every figure was measured or published)."""
    _, marker, rest = hw.source.partition(ASSUMED + ": ")
    return rest if marker else ""


def _meminfo_bytes():
    """The machine's memory (bytes), or None when /proc/meminfo cannot tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _best_time(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fit_half_size(rates: dict, peak: float) -> float:
    """The d0 of rate(m, n, k) = peak * f(m) f(n) f(k) / f(1024)^3, f(d) = d / (d + d0), closest (in log) to the
    measured rates."""
    best, best_err = 1.0, float("inf")
    for d0 in [0.0] + [2 ** (i / 8) for i in range(0, 96)]:
        f = lambda d: d / (d + d0)  # noqa: E731
        err = 0.0
        for (m, n, k), r in rates.items():
            model = peak * f(m) * f(n) * f(k) / f(1024) ** 3
            err += (math.log(model) - math.log(max(r, 1.0))) ** 2
        if err < best_err:
            best, best_err = d0, err
    return best


def probe_cpu() -> dict:
    """Measure this CPU (see the module docstring); returns a JSON-able record.

    Everything is measured on one thread (what each process of a multi-process run has: torchrun gives every
    worker one OpenMP thread), where readings hold still on a shared machine. The all-cores rate of a one-process
    run is the large matmul's best ever seen on all cores (:func:`dufu.engine.reporting.flops.device_peak_flops` keeps it,
    this reading included): a reading taken while other processes share the cores is low and must not stick."""
    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    record = {"cpu": cpu_name(), "cores": cores, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "machine": platform.machine(), "gemm": {}}
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    try:
        torch.set_num_threads(1)
        with LoadMeter(1) as load:
            rates = {}
            for name, dtype in dtypes:
                rates[name] = {}
                for m, n, k in _PROBE_SHAPES:
                    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
                    rates[name][(m, n, k)] = 2.0 * m * n * k / _best_time(lambda: torch.mm(a, b))
            peak1 = {name: max(r.values()) for name, r in rates.items()}
            record["gemm"][1] = {**peak1, "fp16": peak1["bf16"]}
            record["gemm_half_size"] = _fit_half_size(rates["fp32"], peak1["fp32"])
            record.update(_op_rates(peak1["fp32"]))
            record["op_overhead_s"] = _op_overhead()
            record["calibration"] = {1: _calibration_step()}
        if load.under_load:  # the one-thread figures read slow: this plan uses them, no later one does
            record["under_load"] = load.describe()
        torch.set_num_threads(threads_before)
        if threads_before > 1:
            s = _PROBE_SHAPES[0]
            square = {}
            for name, dtype in dtypes:
                a, b = torch.randn(s[0], s[2]).to(dtype), torch.randn(s[2], s[1]).to(dtype)
                now = 2.0 * s[0] * s[1] * s[2] / _best_time(lambda: torch.mm(a, b), repeats=2)
                square[name] = max(now, device_peak_flops(torch.device("cpu"), dtype, remeasure=False,
                                                          measured=now)[0])
            peak = {name: peak1[name] * min(max(1.0, square[name] / rates[name][s]), threads_before)
                    for name in peak1}
            record["gemm"][threads_before] = {**peak, "fp16": peak["bf16"]}
    finally:
        torch.set_num_threads(threads_before)
    record.update(gloo_figures())
    return record


def gloo_figures() -> dict:
    """The probe record's gloo figures (:func:`_gloo_probe`); when two processes cannot measure them, the
    stand-ins of :data:`_GLOO_STAND_IN`, each listed under ``"assumed"`` with the failure."""
    gloo, failure = _gloo_probe()
    if gloo is not None:
        return gloo
    return {**_GLOO_STAND_IN, "assumed": {k: f"the gloo probe failed: {failure}" for k in _GLOO_STAND_IN}}


def _op_rates(gemm_peak: float) -> dict:
    """One thread's rates of the ops besides matmuls, on tensors the size of a small model's activations (4 MB):
    simple elementwise ops, ops with transcendentals, fused attention (as a fraction of the matmul peak), fused
    AdamW and a large copy (bytes read + written per second)."""
    n = 1 << 20
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty(n)
    simple = 3 * 4 * n / _best_time(lambda: (torch.add(x, y, out=out), torch.mul(x, y, out=out)), repeats=5) * 2
    rows = x.view(1024, 1024)
    g = torch.randn(1024, 1024)
    weight, bias = torch.ones(1024), torch.zeros(1024)

    def heavy():
        F.gelu(rows, approximate="tanh")
        torch.ops.aten.gelu_backward(g, rows, approximate="tanh")
        out_, mean, rstd = torch.ops.aten.native_layer_norm(rows, [1024], weight, bias, 1e-5)
        torch.ops.aten.native_layer_norm_backward(g, rows, [1024], mean, rstd, weight, bias, [True, True, True])
        sm = torch.softmax(rows, -1)
        torch.ops.aten._softmax_backward_data(g, sm, -1, torch.float32)

    # bytes: gelu 2, gelu_backward 3, layer norm 2 + 3, softmax 2 + 3 tensor passes
    transcendental = 15 * 4 * n / _best_time(heavy, repeats=3)
    q, k, v = (torch.randn(4, 8, 128, 64, requires_grad=True) for _ in range(3))
    grad = torch.ones(4, 8, 128, 64)

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    flops = 4 * 4 * 8 * 128 * 128 * 64 * (1 + 2.5) * 0.5  # forward + backward, causal half
    attention_efficiency = min(1.0, flops / _best_time(attention, repeats=3) / gemm_peak)
    params = [torch.randn(n // 4) for _ in range(4)]
    grads = [torch.randn(n // 4) for _ in range(4)]
    m1 = [torch.zeros(n // 4) for _ in range(4)]
    m2 = [torch.zeros(n // 4) for _ in range(4)]
    steps = [torch.tensor(1.0) for _ in range(4)]

    def adamw():
        torch._fused_adamw_(params, grads, m1, m2, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)

    optimizer = 28 * n / _best_time(adamw, repeats=3)  # 16 bytes read, 12 written per parameter
    big = torch.ones(1 << 25)
    dst = torch.empty(1 << 25)
    stream = 2 * 4 * big.numel() / _best_time(lambda: dst.copy_(big), repeats=2)
    return {"elementwise_bandwidth": simple, "transcendental_bandwidth": transcendental,
            "attention_efficiency": attention_efficiency, "optimizer_bandwidth": optimizer,

            "stream_bandwidth": stream}


def _calibration_step() -> float:
    """Seconds of one forward + backward of :data:`CALIBRATION_MODEL` (the best of five: other work on a shared
    machine only ever slows a step down), on the current threads."""
    torch.manual_seed(0)
    model = GPTModel(**CALIBRATION_MODEL)
    b, t = CALIBRATION_BATCH
    ids = torch.randint(0, CALIBRATION_MODEL["vocab_size"], (b, t))

    def step():
        model(ids, shift_labels=ids).loss.backward()

    return _best_time(step, repeats=5)


def _op_overhead() -> float:
    """Seconds of host time per op of a training step on tiny tensors: forward with autograd, and its backward."""
    x = torch.ones(8, requires_grad=True)
    chain = 64

    def step():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    return _best_time(step, repeats=5) / (2 * chain + 2)


_GLOO_WORKER = r"""
import json, sys, time, datetime
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
pg = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
out = {}
# what a tensor new from the system costs beyond writing it (this worker runs with MALLOC_MMAP_THRESHOLD_ set)
n = 4 << 20
kept = torch.empty(n)
fresh, reuse = float("inf"), float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    torch.empty(n).fill_(1.0)
    fresh = min(fresh, time.perf_counter() - t0)
    t0 = time.perf_counter()
    kept.fill_(1.0)
    reuse = min(reuse, time.perf_counter() - t0)
out["fresh"] = 4 * n / max(fresh - reuse, 1e-9)
for n in (1 << 12, 1 << 19, 1 << 22):
    x = torch.ones(n // 4)
    pg.allreduce([x]).wait()
    a = torch.randn(128, 128)
    total = 0.0
    for _ in range(20):
        for _ in range(20):  # some work between collectives, as in a training step
            a @ a
        t0 = time.perf_counter()
        pg.allreduce([x]).wait()
        total += time.perf_counter() - t0
    out[n] = total / 20
# an all-gather the size of an FSDP unit (each rank sends half), as ZeRO gathers parameters
for n in (1 << 12, 1 << 24):
    dst, src = torch.empty(n // 4), torch.ones(n // 8)
    pg._allgather_base(dst, src).wait()
    total = 0.0
    for _ in range(5):
        for _ in range(20):
            a @ a
        t0 = time.perf_counter()
        pg._allgather_base(dst, src).wait()
        total += time.perf_counter() - t0
    out[f"ag{n}"] = total / 5
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_probe() -> tuple:
    """(figures, None), or (None, why) when the two processes could not measure: the figures are a gloo
    all-reduce's latency (s) and bandwidth (bytes/s) between two processes on this machine (two fresh interpreters,
    one thread each, as torchrun starts workers), as t = latency + bytes / bandwidth, its all-gather's bandwidth, and
    the bytes/s of memory new from the system beyond writing it (the page faults every large allocation pays when
    glibc returns freed memory to the system, ``MALLOC_MMAP_THRESHOLD_``). Each all-reduce follows some
    computation, as in a training step, and the mean is taken: the rank that arrives first waits, and waking it
    costs time. (Back-to-back all-reduces between two threads of one process read several times faster than what
    a step sees.)"""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_WORKER, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True) for r in range(2)]
    results, failures = [], []
    for rank, p in enumerate(procs):
        out = err = ""
        try:
            out, err = p.communicate(timeout=120)
            results.append(json.loads(out.strip().splitlines()[-1]))
        except Exception as e:  # no loopback networking, or a worker that failed or hung
            if p.poll() is None:
                p.kill()
                p.communicate()
            results.append(None)
            last = (err or "").strip().splitlines()[-1:] or [repr(e)]
            failures.append(f"worker {rank} (exit {p.returncode}): {last[0][:200]}")
    if None in results:
        return None, "; ".join(failures)
    return _gloo_figures(results), None


def _gloo_figures(results: list) -> dict:
    """The record's gloo figures from the two workers' measurements (see :func:`_gloo_probe`)."""
    fresh = min(r.pop("fresh") for r in results)
    ag = {int(k[2:]): max(results[0].pop(k), results[1].pop(k)) for k in list(results[0]) if k.startswith("ag")}
    for r in results[1:]:
        for k in [k for k in r if k.startswith("ag")]:
            r.pop(k)
    lo, hi = min(ag), max(ag)
    # two ranks: each sends half the output once, bus bytes = (n - 1) / n x size
    all_gather = 0.5 * (hi - lo) / max(ag[hi] - ag[lo], 1e-9)
    t = {int(n): max(results[0][n], results[1][n]) for n in results[0]}
    small, large = min(t), max(t)
    latency = t[small]
    # A two-rank ring all-reduce sends each byte once each way: time = latency + bytes / bandwidth.
    bandwidth = (large - small) / max(t[large] - latency, 1e-9)
    return {"gloo_latency_s": latency, "gloo_bandwidth": bandwidth, "page_fault_bandwidth": fresh,
            "gloo_all_gather_bandwidth": all_gather}


