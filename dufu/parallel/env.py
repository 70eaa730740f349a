"""Process environment: device and backend chosen from what the machine has."""

from __future__ import annotations

import os

import torch


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the torchrun environment, or a single process."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(local_rank: int = 0) -> torch.device:
    """CUDA device ``local_rank`` when GPUs are present, the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
