"""Which torch APIs newer than torch 2.11 the running torch has: one named check per API.

dufu is developed on torch 2.13; the GPU machines it borrows run torch 2.11 and cannot install anything, so dufu
runs there from its source tree. Code that uses an API torch 2.11 lacks asks the check named for that API and
takes the older path where it is missing, instead of failing at import or start-up (docs/gpu.md, "torch
versions"). Each check looks for the API itself (an attribute, a field, a command-line flag), not at the version
number, so a nightly or a backport answers for what it has; its docstring names the torch release that added the
API. Each is computed once and imports only what it inspects.

Found by running dufu on torch 2.11.0 beside 2.13.0 (``dufu --version``, ``dufu train`` in one process and with
``--nproc 2`` in several layouts, every module imported) and by comparing the torch names and parameters dufu's
code uses in both (docs/gpu.md lists the findings).
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = ["CHECKS", "has_single_functional_collectives", "torchrun_has_shutdown_timeout", "torch_release"]


def torch_release() -> tuple[int, int]:
    """(major, minor) of the running torch, e.g. (2, 11) for ``2.11.0+cu130``: for messages, not for checks."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@functools.cache
def has_single_functional_collectives() -> bool:
    """``torch.distributed._functional_collectives.all_gather_single`` and ``reduce_scatter_single`` exist.

    Added in torch 2.13, which renamed ``all_gather_tensor`` / ``reduce_scatter_tensor`` to them and warns on the
    old names; torch 2.12 and older have the old names alone (same arguments)."""
    import torch.distributed._functional_collectives as funcol

    return hasattr(funcol, "all_gather_single") and hasattr(funcol, "reduce_scatter_single")


@functools.cache
def torchrun_has_shutdown_timeout() -> bool:
    """torchrun takes ``--shutdown-timeout`` (the seconds between SIGTERM and SIGKILL of a stopping worker group).

    Added in torch 2.12 (``LaunchConfig.shutdown_timeout``, also read from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``);
    torch 2.11's torchrun refuses the flag ("unrecognized arguments") and gives workers a fixed 30 seconds."""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


# name -> (the torch release that added the API, what dufu does without it): docs/gpu.md's table
CHECKS = {
    "has_single_functional_collectives": (
        "2.13", "context parallelism calls all_gather_tensor / reduce_scatter_tensor (dufu.parallel.context_parallel)"),
    "torchrun_has_shutdown_timeout": (
        "2.12", "dufu train --nproc starts torchrun without --shutdown-timeout: a preempted run's workers get torch's "
        "fixed 30 seconds to save, not train.preemption.grace_seconds (dufu.parallel.launch)"),
}
