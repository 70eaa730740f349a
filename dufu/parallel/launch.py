"""Process-group start-up and shutdown, and the torchrun command line for ``dufu train --nproc``."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time

import torch
import torch.distributed as dist

from dufu.parallel import env


def init_distributed(device: torch.device, timeout_minutes: float = 10.0) -> None:
    """Join the torchrun job (NCCL on GPUs, gloo on CPUs). A no-op for one process."""
    _, _, world_size = env.world_info()
    if world_size <= 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store_kwargs = {}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt > 0:
        # A restarted worker group (`--max-restarts`) talks through the same torchrun store as the failed
        # attempt, and process groups are named by a counter that starts over, so without a per-attempt key
        # prefix the new workers read the dead workers' gloo addresses and time out connecting.
        store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
        store_kwargs = dict(store=dist.PrefixStore(f"dufu_attempt_{attempt}/", store), rank=rank, world_size=size)
    dist.init_process_group(
        backend=env.pick_backend(device),
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        **store_kwargs,
    )


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
    if shutdown_timeout is not None:  # how long a signalled worker may take to save and stop
        cmd.append(f"--shutdown-timeout={int(shutdown_timeout)}")
    if command == "train":  # the agent passes these on to the workers, which save and stop (engine.preemption)
        cmd.append("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    return cmd + ["-m", "dufu", command, *argv]
