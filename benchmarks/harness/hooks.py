"""Hook objects benchmarks attach to dufu's Trainer (:mod:`dufu.engine.hooks`): they take readings at the loop's
declared points and change nothing the run computes.

A benchmark running the Trainer in its own process passes them as ``Trainer(cfg, hooks=[...])``; a job started as
``dufu train`` gets them from its config, ``train.hooks`` (:func:`harness.launch.hooks_override`), and writes what
they read to a file at ``on_end`` (before the worker leaves through ``finish_distributed``): see
:class:`harness.memory.MemoryPhases` and the ``*_probe.py`` modules next to the scripts.

During a hook call ``trainer.step`` counts the steps taken, so the step under way is ``trainer.step + 1``;
``after_optimizer`` comes after the step's last collective, so a step timed from ``on_step_start`` to it is the
whole step on this rank. The Trainer's start-up phases are the runtime's own record, ``trainer.runtime.startup``
(phase -> seconds, in order), readable from ``on_start`` on.
"""

from __future__ import annotations

import time

from dufu.engine.hooks import Hook


class StepTimes(Hook):
    """Wall and process CPU seconds of every step and its loss (``steps``), and the samples each step drew
    (``samples``: every micro-batch's indices)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.samples: list[list[list[int]]] = []
        self._t0 = self._c0 = 0.0

    def on_step_start(self, trainer) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def before_forward_backward(self, trainer, micro_batches) -> None:
        self.samples.append([list(mb) for mb in micro_batches])

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        loss = float(loss)  # a host read: on a GPU the timer then covers the whole step, not just its queueing
        self.steps.append({"step": trainer.step + 1, "wall_s": time.perf_counter() - self._t0,
                           "cpu_s": time.process_time() - self._c0, "loss": loss})
