"""Failures a person can act on: a collective with other ranks that failed or timed out (and which ranks no
longer respond), and non-finite losses or gradients (and which parameters they are in)."""

from __future__ import annotations

import contextlib
import datetime
import re
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.errors import DistributedFailure, DufuError


@contextlib.contextmanager
def collective_failures(rank: int, activity: Callable[[], str], timeout_minutes: float, health_group):
    """Turn a failed or timed-out collective (another rank died or hangs) into a DistributedFailure that names
    this rank, what it was doing (``activity()``) and the ranks that no longer respond, instead of a hang or a
    wall of traceback. Errors of this rank's own making pass through unchanged."""
    try:
        yield
    except DufuError:
        raise
    except (RuntimeError, dist.DistError) as e:
        if not looks_distributed(e):
            raise
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise DistributedFailure(
            f"rank {rank} stopped {activity()}: a collective operation with the other ranks failed or waited "
            f"longer than train.dist.timeout_minutes={timeout_minutes}. "
            f"{unresponsive_ranks(health_group, timeout_minutes)}Cause: {first[:300]}"
        ) from e


def looks_distributed(e: BaseException) -> bool:
    """A failure of communication with other ranks (as opposed to a bug on this rank). torch raises most of
    them as DistError; a backend's own timeout or broken connection may arrive as a RuntimeError, which only
    its text tells apart."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "socket"))


def unresponsive_ranks(health_group, timeout_minutes: float) -> str:
    """Which ranks no longer respond: every surviving rank meets at a monitored barrier on ``health_group``
    (gloo, so it works beside NCCL and after NCCL's own group failed), and rank 0 learns who did not arrive."""
    if health_group is None:
        return ""
    try:
        seconds = max(5.0, min(30.0, 60.0 * timeout_minutes))
        dist.monitored_barrier(group=health_group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        found = re.search(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier", msg)
        if found:
            return f"Rank(s) {found.group(1).strip()} did not respond: they died or hang. "
        return "Another rank died or hangs (see its own message above). "
    return "All ranks still respond; see the other ranks' messages above. "


def non_finite_loss(loss: float, step: int) -> DufuError:
    return DufuError(
        f"the loss became {loss} at step {step}. Lower optim.lr, enable train.clip_grad_norm, "
        "use train.amp.dtype=bf16 instead of fp16, or set train.nan_policy=skip."
    )


def non_finite_gradients(model_parts, step: int, what: str, world_size: int) -> DufuError:
    """Name the step and the first parameters whose gradients are not finite, gathered from all ranks (each
    holds other parameters or other shards). Every rank takes part: the verdict that led here is global."""
    bad = []
    for part in model_parts:
        for name, p in part.named_parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if not bool(torch.isfinite(g).all()):
                    bad.append(name)
    if world_size > 1:
        # Python objects: torch pickles them into tensors on the current device (set at start-up, so NCCL
        # finds its own GPU).
        gathered = [None] * world_size
        dist.all_gather_object(gathered, bad)
        bad = sorted({n for names in gathered for n in names})
    named = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return DufuError(
        f"non-finite values at step {step}: {what}"
        f"{'; gradients of ' + named + ' contain inf/NaN' if bad else ''}. Lower optim.lr, check the data, "
        "use train.amp.dtype=bf16 instead of fp16, or set train.nan_policy=skip to drop such updates."
    )
