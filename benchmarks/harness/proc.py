"""Readings of the Linux ``/proc`` files the benchmarks take: a process's resident memory and its high-water mark,
the machine's memory, and how busy the machine's CPUs were (to tell a benchmark's own load from everyone else's).

Every reader answers for the calling process (``/proc/self``) unless it says otherwise; where a file does not
exist (not Linux) the readers that can say so return None.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def status() -> dict[str, int]:
    """Every ``kB`` counter of ``/proc/self/status`` (VmRSS, VmHWM, RssAnon, RssFile, RssShmem, ...), in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def status_kib(field: str) -> int:
    """One counter of ``/proc/self/status`` in KiB: ``VmRSS`` (resident now), ``VmHWM`` (its peak), ``RssAnon`` ..."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/self/status")


def reset_high_water_mark() -> bool:
    """Set ``VmHWM`` to the current ``VmRSS``, so the next reading is the peak since now; False where the kernel
    refuses (the peak then counts from the start). The runs' own records reset it the same way
    (:func:`dufu.engine.reporting.memory.reset_rss_high_water`), which this calls."""
    from dufu.engine.reporting.memory import reset_rss_high_water  # torch: imported by the benchmarks anyway

    return reset_rss_high_water()


def smaps_rollup() -> dict[str, int]:
    """The ``kB`` counters of ``/proc/self/smaps_rollup`` (Rss, Pss, Anonymous, ...) in KiB."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def meminfo_kib(field: str) -> int | None:
    """One line of ``/proc/meminfo`` in KiB (``MemTotal``, ``MemAvailable``), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def system_busy_seconds() -> float | None:
    """CPU seconds all processes have been busy since boot, summed over CPUs (``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (reaped) children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime + children_cpu_seconds()


def other_load(busy0: float | None, busy1: float | None, own_cpu_s: float, wall_s: float) -> float | None:
    """The share of the machine's CPU time that other processes used over ``wall_s`` seconds: the machine's busy
    seconds between two :func:`system_busy_seconds` readings minus ``own_cpu_s``, over wall x CPUs (0 on a quiet
    machine; high values mean a measurement's wall times are inflated by sharing the cores)."""
    if busy0 is None or busy1 is None or wall_s <= 0:
        return None
    return max(0.0, (busy1 - busy0 - own_cpu_s) / (wall_s * (os.cpu_count() or 1)))


def process_start_time(pid: int | None = None) -> float:
    """When the kernel started process ``pid`` (this one by default), on the wall clock (``time.time()``): its
    start in clock ticks since boot (``/proc/PID/stat``, 10 ms resolution), placed on the wall clock through
    CLOCK_BOOTTIME (the boot time in ``/proc/stat`` is whole seconds)."""
    stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    start_since_boot = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - start_since_boot)
