"""Run torchrun's agent inside the launching `dufu` process, its workers forked from dufu's worker server, and
report, in dufu's words, which worker died and how; shared by `dufu train --nproc N` and `dufu eval --nproc N`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

from dufu.cli import workers
from dufu.errors import DufuError

_AGENT_LOG = "torch.distributed.elastic.multiprocessing.api"


def run_torchrun(cmd: list[str]) -> int:
    """Run the ``python -m torch.distributed.run ARGS -m dufu COMMAND ...`` command line ``cmd`` and return its exit
    code.

    The launcher has imported torch for its checks already, so torchrun's agent runs in this process (what the
    ``torchrun`` command runs, :func:`_run`) instead of a new interpreter that imports torch again before it starts
    any worker; the workers are forked from the worker server (dufu.cli.workers), not started as ``python -u -m
    dufu COMMAND ...``. Failures end as the command's do: the error and the failed ranks' summary on stderr, exit
    code 1."""
    if cmd[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        raise DufuError(f"not a torchrun command line: {' '.join(cmd[:3])} ...")
    watcher = _WorkerFailures()
    agent_log = logging.getLogger(_AGENT_LOG)
    agent_log.addHandler(watcher)
    agent_log.addFilter(_no_traceback_of_an_exit)
    try:
        _run(cmd[3:])
    except SignalException as e:  # Ctrl-C or a termination signal: the agent has stopped the workers
        print("interrupted" if e.sigval == signal.SIGINT else f"stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except SystemExit as e:  # argument errors
        return e.code if isinstance(e.code, int) else 1
    except Exception:  # a failed worker group (ChildFailedError) or agent error, reported as torchrun reports it
        traceback.print_exc()
        return 1
    finally:
        agent_log.removeHandler(watcher)
        agent_log.removeFilter(_no_traceback_of_an_exit)
    return 0


@record
def _run(torchrun_args: list[str]) -> None:
    """``torch.distributed.run.run`` (what ``torchrun ARGS`` runs) with the workers forked: ``-m dufu COMMAND ...``
    becomes the entrypoint :func:`dufu.cli.workers.dufu` (torchrun takes a function only from Python; its command
    line takes a program)."""
    args = parse_args(torchrun_args)
    if not args.module or args.training_script != "dufu":
        raise DufuError(f"not a torchrun command line of dufu: -m {args.training_script} ...")
    launch_forked(args, workers.dufu, list(args.training_script_args), *workers.launch_state())


def launch_forked(args, entrypoint, *entry_args) -> None:
    """torchrun's launch of the parsed torchrun arguments ``args`` (``torch.distributed.run.parse_args``), each
    worker running ``entrypoint(*entry_args)`` forked from the worker server: torchrun's argument handling
    (``--standalone``: a rendezvous on a free local port) and launch config, with the start method "forkserver"."""
    single_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and single_node):  # as torchrun: a rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    workers.start_worker_server(config.nproc_per_node)  # started already by the command, before it loaded the config
    elastic_launch(config, entrypoint=entrypoint)(*entry_args)


def _no_traceback_of_an_exit(record: logging.LogRecord) -> bool:
    """torchrun logs a failed function worker with the traceback of the exception that reports its exit code
    (``ProcessExitedException``, raised in the agent, not in the worker); a worker started as a program gets the
    line alone. The line is kept, the agent's traceback dropped: the worker's own error is printed above it."""
    if (str(record.msg).startswith("failed (exitcode") and record.exc_info
            and record.exc_info[0].__name__ == "ProcessExitedException"):
        record.exc_info, record.exc_text = None, None
    return True


class _WorkerFailures(logging.Handler):
    """Says in dufu's words which worker died and how, when torchrun's agent sees a worker group fail (before
    it restarts the group under --max-restarts, or gives up)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        code, local_rank, pid = record.args[:3]
        how = f"exit code {code}"
        if isinstance(code, int) and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        node = os.environ.get("GROUP_RANK")
        print(f"dufu: worker local rank {local_rank}{f' of node {node}' if node else ''} (pid {pid}) died: {how}",
              file=sys.stderr)
