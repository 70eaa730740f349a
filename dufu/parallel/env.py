"""Process environment: device and backend chosen from what the machine has, and the environment variables torch
reads for them (NCCL's error handling, the flight recorder)."""

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


# NCCL's error handling and torch's flight recorder (a ring buffer of each rank's last collectives, written to one
# file per rank when a collective times out), as environment variables, the only way torch takes them; each with
# every name torch reads, the newer first (torch 2.13's library holds both names of each). Async error handling 3, the
# documented default, written out: a failed or timed-out collective tears the process down without aborting the
# communicator (an abort can hang itself), so the job ends and torchrun can restart it. Sources:
# docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html, torch's flight recorder tutorial.
NCCL_ERROR_HANDLING = (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "3")
FLIGHT_RECORDER_BUFFER = (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000")  # entries per rank
FLIGHT_RECORDER_DUMP_ON_TIMEOUT = (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")
FLIGHT_RECORDER_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # a prefix: torch adds the rank
FLIGHT_RECORDER_PREFIX = "rank_"


def nccl_debug_environment(backend: str, flight_recorder_dir, environ=None) -> dict[str, str]:
    """Turn on NCCL's async error handling and the flight recorder, with dumps written to
    ``flight_recorder_dir/rank_<global rank>``, in ``environ`` (this process's environment by default), before the
    process group is created (torch reads them then). A setting the user made, under any of its names, is left as it
    is. Returns what was set. Only for NCCL: nothing is set for gloo, where the TORCH_NCCL_* variables do nothing
    and no watchdog writes the flight recorder on a timeout (gloo's collectives raise instead)."""
    environ = os.environ if environ is None else environ
    if backend != "nccl" or flight_recorder_dir is None:
        return {}
    prefix = os.path.join(os.fspath(flight_recorder_dir), FLIGHT_RECORDER_PREFIX)
    done = {}
    for names, value in (NCCL_ERROR_HANDLING, FLIGHT_RECORDER_BUFFER, FLIGHT_RECORDER_DUMP_ON_TIMEOUT,
                         (FLIGHT_RECORDER_FILE, prefix)):
        if not any(n in environ for n in names):
            done.update({n: value for n in names})
    if any(n in done for n in FLIGHT_RECORDER_FILE):
        os.makedirs(flight_recorder_dir, exist_ok=True)  # torch writes the file, not its directory
    environ.update(done)
    return done


def flight_recorder_prefix(environ=None) -> str | None:
    """Where this process's flight-recorder dump goes (a file-name prefix; torch appends the global rank), or None
    when no dump path is set (the flight recorder then writes to torch's default, /tmp/nccl_trace_rank_, if on)."""
    environ = os.environ if environ is None else environ
    return next((environ[n] for n in FLIGHT_RECORDER_FILE if environ.get(n)), None)
