"""`python -m dufu ...`: the same as the `dufu` command (dufu.cli.command), and how torchrun starts dufu's workers.

A worker's every exit, error or not, goes through :func:`dufu.parallel.launch.exit_process` (in
:func:`dufu.cli.command`). (The workers of ``dufu train --nproc N`` are forked instead: dufu.cli.workers.)
"""

from dufu import cli

cli.command()
