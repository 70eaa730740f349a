"""Process environment: device and backend chosen from what the machine has."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torchrun environment, or a single process."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def agent_pid() -> int:
    """The pid of this worker's torchrun agent: its parent, or, for a worker forked from dufu's worker server (whose
    parent is that server), the launcher named in ``DUFU_AGENT_PID`` (set by dufu.cli.workers)."""
    return int(os.environ.get("DUFU_AGENT_PID") or os.getppid())


def pick_device(local_rank: int = 0) -> torch.device:
    """CUDA device ``local_rank`` when GPUs are present, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pick_backend(device: torch.device) -> str:
    """The process-group backend for ``device``: NCCL moves CUDA tensors only, gloo CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(group=None) -> torch.device:
    """The device a tensor must live on to be reduced over ``group`` (the default group if None).

    For code that has no tensor of its own to take the device from (a rank with nothing to report
    still has to join the collective): NCCL takes tensors on this rank's current CUDA device only,
    gloo takes CPU tensors (and is what a single process without a process group falls back to)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
