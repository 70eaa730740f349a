"""`python -m dufu ...`: the same as the `dufu` command (dufu.cli.main), and how torchrun starts dufu's workers.

A worker's every exit, error or not, goes through :func:`dufu.parallel.launch.exit_process`, which never lets the
interpreter tear down a live gloo process group (that can abort a rank after its work is done). (The workers of
``dufu train --nproc N`` are forked instead: dufu.cli.workers.)
"""

import sys

from dufu import cli

code = cli.run()
if "torch.distributed" in sys.modules:  # only a process that may have a process group pays for the import
    from dufu.parallel.launch import exit_process

    # A rank that stops because a peer failed leaves a moment later: torchrun's agent (polling every 0.1 s) names
    # the failure it sees first, which must be the peer's (e.g. "killed by SIGKILL"), not this consequence.
    exit_process(code, linger_seconds=1.0 if cli.peer_failed else 0.0)
sys.exit(code)
