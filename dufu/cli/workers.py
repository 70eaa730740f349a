"""The workers of ``dufu train --nproc N`` and ``dufu eval --nproc N``, forked from a server that imported torch and
dufu once.

A worker started as a new interpreter (``python -m dufu train``, torchrun's way) spends its first 4-5 s of CPU
importing torch, dufu, TorchDynamo (the optimizer step imports it) and DTensor, and every worker of a node does so at
once: N times the CPU, and N processes reading the same thousands of files (a known load on the shared file systems
of clusters). Here the launcher starts the standard library's fork server (``multiprocessing`` "forkserver") before
it loads the config, with :data:`PRELOAD` imported in it, so the import runs beside the launcher's own checks; the
agent of torchrun (run in the launcher by dufu.cli.torchrun) then asks it for its workers, which start with all of
it imported. The fork server is a fresh interpreter that never touched a GPU, and forks before any thread runs:
this is what torch recommends for CUDA workers (a fork of a process that initialised CUDA cannot use it).

A forked worker is what a new one would be (:func:`dufu`): the launcher's environment at the launch
(variables it set after the server started included) plus torchrun's per-worker variables, its working
directory, a session of its own (torchrun starts workers so: a Ctrl-C reaches the launcher, which passes it on),
``sys.argv`` as ``dufu`` would have it, and unbuffered output (torchrun runs workers with ``python -u``). It reports
its exit code as ``dufu/__main__`` does, through the multiprocessing start method's own exit (``os._exit`` after
the function returns: the interpreter is never finalized, so gloo's teardown race that ``exit_process`` avoids
cannot happen). ``DUFU_AGENT_PID`` names its agent, which is not its parent (the fork server is).

This module imports neither torch nor the rest of dufu at its top: the launcher starts the server before it
imports them.
"""

from __future__ import annotations

import os
import sys
import time

from dufu.environment import environment

# What every worker imports before its first step; ``dufu.cli.workers`` first, so that _SERVER_ENV below is the
# fork server's environment.
PRELOAD = ("dufu.cli.workers", "dufu.cli.train", "dufu.cli.eval", "dufu.engine.trainer", "torch._dynamo",
           "torch.distributed.tensor")

# Set in the fork server, where this module is imported first (the workers inherit them): the environment the
# server started with, and its pid.
_SERVER_ENV = dict(os.environ)
_SERVER_PID = os.getpid()

AGENT_PID_ENV = "DUFU_AGENT_PID"  # read by dufu.parallel.env.agent_pid


def start_worker_server(nproc: int) -> None:
    """Start the fork server of this launcher's workers (imports :data:`PRELOAD` in the background) with the
    variables torchrun gives its workers at start-up: one OpenMP thread per worker when there are several (unless
    ``OMP_NUM_THREADS`` is set; OpenMP reads it when torch loads, so it must be there in the server), and
    unbuffered output. This process's own environment is left as it was."""
    from multiprocessing import forkserver

    start_env = {"PYTHONUNBUFFERED": "1"}
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        start_env["OMP_NUM_THREADS"] = "1"
    with environment(start_env):
        forkserver.set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()


def launch_state() -> tuple[dict, str, int]:
    """What a forked worker takes from its launcher: (environment, working directory, pid)."""
    return dict(os.environ), os.getcwd(), os.getpid()


def become_worker(launcher_env: dict, cwd: str, agent_pid: int) -> None:
    """Make this forked process what a worker torchrun started would be: a session of its own, the launcher's
    environment with torchrun's per-worker variables over it, the launcher's working directory, and
    ``DUFU_AGENT_PID``."""
    os.setsid()
    if os.getpid() != _SERVER_PID:  # imported in the server: its environment is known
        # torchrun's per-worker variables (RANK, LOCAL_RANK, MASTER_PORT, ...): what the agent set over it
        agent_set = {name: value for name, value in os.environ.items() if _SERVER_ENV.get(name) != value}
        os.environ.clear()
        os.environ.update(launcher_env)
        os.environ.update(agent_set)
    else:  # not preloaded: the agent's variables cannot be told apart, so everything here is kept
        for name, value in launcher_env.items():
            os.environ.setdefault(name, value)
    os.environ[AGENT_PID_ENV] = str(agent_pid)
    os.chdir(cwd)


def dufu(argv: list[str], launcher_env: dict, cwd: str, agent_pid: int) -> None:
    """Run ``dufu ARGV`` as a worker of torchrun's agent, in a process forked from the worker server (named as the
    program a worker started by torchrun runs, which is the name torchrun's failure report gives).

    Returns on success (torchrun's multiprocessing context waits for every worker's return); raises SystemExit
    with the exit code ``python -m dufu ARGV`` would have had otherwise."""
    become_worker(launcher_env, cwd, agent_pid)
    sys.argv = ["dufu", *argv]

    from dufu import cli

    code = cli.run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        if cli.peer_failed:  # as dufu/__main__: the failed peer's exit is seen first
            time.sleep(1.0)
        raise SystemExit(code)
