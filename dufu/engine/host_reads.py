"""Counting host reads of tensor values: the calls that make the host wait for the device (on a GPU, a stream
synchronisation) — ``Tensor.item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__`` and ``__index__``.

A training step on a GPU should not read a value back until it is needed on the host: each read stalls the
host until the device has caught up, so it cannot queue the next kernels, and on many ranks one slow rank then
stalls all. dufu's loop keeps losses, gradient norms and non-finite verdicts on the device and reads them once per
``train.log_period`` (:class:`dufu.engine.step_stats.StepStats`); tests and ``benchmarks/gpu.py`` use
:func:`count_host_reads` to hold it to that. On the CPU a "read" costs nothing, but counting the same calls there
tells what a GPU run would wait for.

The counter replaces the methods on ``torch.Tensor`` for the duration of the ``with`` block only and restores them
after (a measuring tool for tests and benchmarks; nothing in a training run uses it).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@dataclass
class HostReads:
    """What :func:`count_host_reads` saw: ``count`` reads in all, ``by_site`` per ``file:line function`` of the
    dufu (or test) frame that made them. ``paused()`` excludes a block (e.g. the logging of a record)."""

    count: int = 0
    by_site: Counter = field(default_factory=Counter)
    _paused: int = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _seen(self) -> None:
        if self._paused:
            return
        self.count += 1
        for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
            if "/torch/" not in frame.filename:  # the first caller outside torch names the site
                self.by_site[f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"] += 1
                break


_lock = threading.Lock()


@contextlib.contextmanager
def count_host_reads():
    """``with count_host_reads() as reads: ...`` counts the host reads of tensor values made in the block (by
    any thread of this process; not re-entrant)."""
    reads = HostReads()
    with _lock:
        saved = {name: getattr(torch.Tensor, name) for name in READS}

        def counting(name):
            original = saved[name]

            def read(self, *args, **kwargs):
                reads._seen()
                return original(self, *args, **kwargs)

            read.__name__ = name
            return read

        try:
            for name in READS:
                setattr(torch.Tensor, name, counting(name))
            yield reads
        finally:
            for name, original in saved.items():
                setattr(torch.Tensor, name, original)
