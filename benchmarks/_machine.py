"""What every benchmark result records about the machine it ran on, and how busy the machine was.

Imported by the benchmark scripts as ``_machine`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The CPU features that decide which dtype is fast (AMX and AVX512-BF16 make bf16 matmuls fast).
DTYPE_FEATURES = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def cpu_model_and_features() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`DTYPE_FEATURES` it has (Linux ``/proc/cpuinfo``)."""
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


def machine_info(**extra) -> dict:
    """CPU model and features, CPU count, torch threads and version, Python, platform; plus ``extra``."""
    import torch

    cpu, features = cpu_model_and_features()
    return {"cpu": cpu, "cpu_features": features, "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), **extra}


def system_busy_seconds() -> float | None:
    """CPU seconds all processes have been busy since boot, summed over CPUs (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
