"""What a result was measured on: the machine (CPU model and the features that decide which dtype is fast, cores,
memory, versions, the fp32 and bf16 matmul peaks measured now) and the dufu code (commit, files changed).

The peaks are measured by dufu itself (:func:`dufu.engine.reporting.flops.matmul_speeds`, the alternating fp32 / bf16
matmuls that ``train.amp.enabled=auto`` decides from, :mod:`dufu.engine.precision`), with this process's torch
threads, so a result's machine says how fast this CPU multiplies in each dtype while the benchmark ran.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

from harness import proc

REPO = Path(__file__).resolve().parents[2]
# The CPU features that decide which dtype is fast (AMX and AVX512-BF16 make bf16 matmuls fast).
DTYPE_FEATURES = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def cpu_model_and_features() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`DTYPE_FEATURES` it has (``/proc/cpuinfo``)."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu, sorted(flags & DTYPE_FEATURES)


def measured_peaks() -> dict:
    """GFLOP/s of large fp32 and bf16 matmuls on this CPU now, this process's threads (dufu's measurement)."""
    import torch

    from dufu.engine.reporting.flops import measure_matmuls

    reading = measure_matmuls(torch.device("cpu"), (torch.float32, torch.bfloat16))
    speeds = reading.speeds
    return {"fp32": round(speeds[torch.float32] / 1e9, 1), "bf16": round(speeds[torch.bfloat16] / 1e9, 1),
            "threads": torch.get_num_threads(), "under_load": reading.under_load, "how": reading.describe(),
            "measured_by": "dufu.engine.reporting.flops.measure_matmuls"}


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def dufu_commit() -> str:
    """The checkout's short commit, with a note when dufu/ has uncommitted changes."""
    commit = git("rev-parse", "--short", "HEAD") or "(not a git checkout)"
    return commit + (" (+ uncommitted changes in dufu/)" if git("status", "--porcelain", "--", "dufu") else "")


def code_state(note: str | None = None) -> dict:
    """The dufu code measured: the commit, the files of dufu/ that differ from it, and a ``note`` on it."""
    changed = [line[3:] for line in git("status", "--porcelain", "--", "dufu").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD") or None, "changed": changed, "note": note}


def dufu_digests() -> dict[str, str]:
    """A digest of every source file of dufu/: :func:`changed_since` tells whether the code changed during a run."""
    return {f.relative_to(REPO).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((REPO / "dufu").rglob("*.py"))}


def changed_since(digests: dict[str, str]) -> list[str]:
    """The files of dufu/ added, removed or changed since ``digests`` were taken."""
    now = dufu_digests()
    return sorted(f for f in set(digests) | set(now) if digests.get(f) != now.get(f))


def describe(peaks: bool = True, **extra) -> dict:
    """The machine: CPU model and dtype features, logical CPUs, memory, torch threads and version, Python, libc,
    platform, the dufu commit and (``peaks``) the matmul peaks measured now; plus ``extra``."""
    import torch

    cpu, features = cpu_model_and_features()
    total = proc.meminfo_kib("MemTotal")
    info = {"cpu": cpu, "cpu_features": features, "logical_cpus": os.cpu_count(), "cores": os.cpu_count(),
            "memory_gib": round(total / 2**20, 1) if total else None, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "libc": " ".join(platform.libc_ver()), "platform": platform.platform(), "dufu_commit": dufu_commit()}
    if peaks:
        info["matmul_peaks_gflops"] = measured_peaks()
    return {**info, **extra}


def peaks_text(info: dict) -> str:
    """"fp32 225 and bf16 967 GFLOP/s (2 threads)" from a :func:`describe`, or "" where it has none."""
    p = info.get("matmul_peaks_gflops")
    if not p:
        return ""
    return f"measured matmul peaks fp32 {p['fp32']:,.0f} and bf16 {p['bf16']:,.0f} GFLOP/s ({p['threads']} threads)"
