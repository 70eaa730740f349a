"""Run torchrun's agent inside the launching `dufu` process and report, in dufu's words, which worker died and
how; shared by `dufu train --nproc N` and `dufu eval --nproc N`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main

from dufu.errors import DufuError


def run_torchrun(cmd: list[str]) -> int:
    """Run the ``python -m torch.distributed.run ARGS`` command line ``cmd`` and return its exit code.

    The launcher has imported torch for its checks already, so torchrun's agent runs in this process
    (``torch.distributed.run.main(ARGS)``, the function behind the ``torchrun`` command) instead of a new
    interpreter that imports torch again before it starts any worker. Failures end as the command's do: the
    error and the failed ranks' summary on stderr, exit code 1."""
    if cmd[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        raise DufuError(f"not a torchrun command line: {' '.join(cmd[:3])} ...")
    watcher = _WorkerFailures()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addHandler(watcher)
    try:
        torchrun_main(cmd[3:])
    except SignalException as e:  # Ctrl-C or a termination signal: the agent has stopped the workers
        print("interrupted" if e.sigval == signal.SIGINT else f"stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except SystemExit as e:  # argument errors
        return e.code if isinstance(e.code, int) else 1
    except Exception:  # a failed worker group (ChildFailedError) or agent error, reported as torchrun reports it
        traceback.print_exc()
        return 1
    finally:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeHandler(watcher)
    return 0


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
