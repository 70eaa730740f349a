"""Process-group start-up (with its start-up and steady-state timeouts) and shutdown, and the torchrun command line
for ``dufu train --nproc``."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time

import torch
import torch.distributed as dist

from dufu.torch_versions import torchrun_has_shutdown_timeout
from dufu.parallel import env


def init_distributed(device: torch.device, timeout_minutes: float = 10.0, startup_timeout_minutes: float | None = None,
                     flight_recorder_dir: str | os.PathLike | None = None) -> None:
    """Join the torchrun job (NCCL on GPUs, gloo on CPUs). A no-op for one process.

    The process group waits up to the start-up timeout for a collective: ``startup_timeout_minutes`` (never less
    than ``timeout_minutes``; None: ``timeout_minutes``), which covers the rendezvous, the groups made next and the
    first step; :func:`enter_steady_state` applies ``timeout_minutes`` after it. On NCCL, async error handling and
    the flight recorder are turned on (where the user has not set them) with the dumps written to
    ``flight_recorder_dir/rank_<global rank>`` (:func:`dufu.parallel.env.nccl_debug_environment`)."""
    _, _, world_size = env.world_info()
    if world_size <= 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = env.pick_backend(device)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if flight_recorder_dir is not None and attempt > 0:  # a restarted group's dumps beside, not over, the last ones
        flight_recorder_dir = os.path.join(os.fspath(flight_recorder_dir), f"attempt_{attempt}")
    env.nccl_debug_environment(backend, flight_recorder_dir)  # before the group: NCCL reads them at its creation
    timeout = datetime.timedelta(minutes=startup_timeout(timeout_minutes, startup_timeout_minutes))
    store_kwargs = {}
    if attempt > 0:
        # A restarted worker group (`--max-restarts`) talks through the same torchrun store as the failed
        # attempt, and process groups are named by a counter that starts over, so without a per-attempt key
        # prefix the new workers read the dead workers' gloo addresses and time out connecting.
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        store_kwargs = dict(store=dist.PrefixStore(f"dufu_attempt_{attempt}/", store), rank=rank, world_size=size)
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        **store_kwargs,
    )


def startup_timeout(timeout_minutes: float, startup_timeout_minutes: float | None) -> float:
    """The minutes a collective may wait before the first step has ended: the start-up timeout, never less than the
    steady one (None: the steady one)."""
    return max(timeout_minutes, startup_timeout_minutes or 0.0)


def enter_steady_state(timeout_minutes: float, groups=None) -> str | None:
    """Called by the loop once the first step has ended: from then on a collective that waits longer than
    ``timeout_minutes`` (a dead or hung rank) fails, on every process group of this rank (or on ``groups``), those
    made after the default group included (the mesh's, the health group: torch gave them its own default, 30
    minutes on gloo, 10 on NCCL). Returns a notice to show when this torch cannot change a group's timeout."""
    return set_group_timeouts(timeout_minutes, groups)


def set_group_timeouts(timeout_minutes: float, groups=None) -> str | None:
    """Every process group of this rank (or ``groups``) waits ``timeout_minutes`` for a collective from now on (work
    already enqueued keeps its timeout). A no-op without a process group. Returns None, or a notice when this torch
    cannot change a group's timeout (the groups then keep the one they were made with)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    timeout = datetime.timedelta(minutes=timeout_minutes)
    for group in own_process_groups() if groups is None else groups:
        if not set_pg_timeout(group, timeout):
            return (f"torch {torch.__version__} cannot change a process group's timeout: collectives keep waiting as "
                    f"long as at start-up (train.dist.startup_timeout_minutes), not {timeout_minutes} minutes")
    return None


def set_pg_timeout(group, timeout: datetime.timedelta) -> bool:
    """torch's ``_set_pg_timeout(timeout, group)``, private (torch 2.11 and 2.13 have it): it sets the timeout the
    group's gloo and NCCL backends give every new collective. False when this torch lacks it; a group this rank is
    not in is left alone."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        setter(timeout, group)
    return True


def own_process_groups() -> list:
    """Every process group this rank is in: torch's registry of them (``_world.pg_map``, private: no public API lists
    them), or the default group alone where that registry is missing."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or ())
    return groups or [dist.distributed_c10d._get_default_group()]


def finish_distributed(exit_code: int = 0) -> None:
    """End a successful distributed run without racing the process-group teardown.

    All ranks meet at a barrier (so every file is written), flush their output and
    leave with ``os._exit``: gloo's teardown in ``destroy_process_group`` was seen
    to abort a rank ("terminate called without an active exception") after all
    work was done in about 1 run in 100. Failures never reach this function: an
    exception propagates and the rank exits non-zero.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is not None:
        # a forked worker (dufu.cli.workers): it returns to torchrun's worker wrapper, which reports it done, and
        # the start method ends the process with os._exit, without finalizing the interpreter either
        return
    os._exit(exit_code)


def exit_process(code, linger_seconds: float = 0.0) -> None:
    """Leave the process with ``code`` (an int, or what ``SystemExit`` carries), never through the interpreter's
    finalization while a process group lives.

    Gloo's worker threads can still hold finished collectives' tensors when the interpreter is torn down; freeing
    them then takes the GIL of a dying interpreter, and the rank aborts (SIGABRT) after its work, or after it
    printed its error. Every failure path of a worker (an error reported with exit code 2, an uncaught exception)
    therefore ends like a success (:func:`finish_distributed`): output flushed, then ``os._exit``, after
    ``linger_seconds`` (a rank whose failure is a peer's consequence waits, so the launcher sees the peer's exit
    first). A process without a process group exits normally."""
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        if linger_seconds:
            time.sleep(linger_seconds)
        os._exit(code)
    sys.exit(code)


def torchrun_command(nproc: int, argv: list[str], nnodes: str | None = None, node_rank: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None,
                     max_restarts: int | None = None, command: str = "train",
                     shutdown_timeout: int | None = None, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m dufu COMMAND ARGV`` (``train``, or ``eval``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes is None and master_addr is None and rdzv_endpoint is None:
        cmd.append("--standalone")
    if rdzv_endpoint is not None:  # elastic membership: torchrun's c10d rendezvous (the first node hosts it)
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id or 'dufu'}"]
    if nnodes is not None:
        cmd.append(f"--nnodes={nnodes}")
    if node_rank is not None:
        cmd.append(f"--node-rank={node_rank}")
    if master_addr is not None:
        cmd.append(f"--master-addr={master_addr}")
    if master_port is not None:
        cmd.append(f"--master-port={master_port}")
    if max_restarts is not None:
        cmd.append(f"--max-restarts={max_restarts}")
    # how long a signalled worker may take to save and stop; torch 2.11's torchrun has no such flag (a fixed 30 s)
    if shutdown_timeout is not None and torchrun_has_shutdown_timeout():
        cmd.append(f"--shutdown-timeout={int(shutdown_timeout)}")
    if command == "train":  # the agent passes these on to the workers, which save and stop (engine.preemption)
        cmd.append("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    return cmd + ["-m", "dufu", command, *argv]
