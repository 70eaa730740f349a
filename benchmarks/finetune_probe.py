"""The clocks of the ``dufu`` side of ``benchmarks/finetune.py``: a hook its ``dufu train`` worker attaches to the
Trainer (``train.hooks``), reading time at the loop's declared points into :data:`RECORD`, which the worker entry
writes out when the run is over. It changes nothing the run computes.

* ``init_s`` -- the Trainer's construction: the runtime's start-up profile (``trainer.runtime.startup``: plan,
  model build, process group, precision, teacher, optimizer), whose ``precision`` phase is dufu's matmul-peak
  measurement (``peak_measure_s``);
* ``train_start`` / ``train_end`` -- the loop's start (``on_start``) and end (``on_end``, the summary written);
* ``train_step_s`` -- every step, ``on_step_start`` to ``after_optimizer``;
* ``evaluate_s`` -- every evaluation: from the first to the end of the last forward in eval mode (forward hooks on
  the model parts) between two steps;
* ``save_s`` -- every checkpoint save: from the end of the step (or of the evaluation after it) to ``on_save``.

With ``profile_steps``, steps ``profile_at`` .. ``profile_at + profile_steps - 1`` run under ``torch.profiler``,
each inside the step region of :mod:`harness.profile`, and ``RECORD["profile"]`` is their breakdown.
"""

from __future__ import annotations

import time

from dufu.engine.hooks import Hook

RECORD: dict = {"train_step_s": [], "evaluate_s": [], "save_s": []}


class DufuClocks(Hook):
    def __init__(self, profile_at: int = 0, profile_steps: int = 0):
        self.profile_at, self.profile_steps = profile_at, profile_steps
        self.calls, self.prof, self.region = 0, None, None
        self.t0 = self.last = 0.0
        self.eval_from = self.eval_to = None

    # evaluation windows: forwards of the model in eval mode
    def _eval_forward_start(self, module, args) -> None:
        if not module.training and self.eval_from is None:
            self.eval_from = time.perf_counter()

    def _eval_forward_end(self, module, args, output) -> None:
        if not module.training:
            self.eval_to = time.perf_counter()

    def _close_evaluation(self) -> None:
        if self.eval_from is not None and self.eval_to is not None:
            RECORD["evaluate_s"].append(self.eval_to - self.eval_from)
            self.last = max(self.last, self.eval_to)
        self.eval_from = self.eval_to = None

    def on_start(self, trainer) -> None:
        import torch

        rt = trainer.runtime
        RECORD["startup_phases_s"] = dict(rt.startup)
        RECORD["init_s"] = sum(rt.startup.values())
        RECORD["peak_measure_s"] = rt.startup.get("precision", 0.0)
        RECORD["precision"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(rt.amp_dtype, "fp32")
        RECORD["output_dir"] = str(rt.output_dir)
        RECORD["train_start"] = time.time()
        for part in rt.model_parts:
            part.register_forward_pre_hook(self._eval_forward_start)
            part.register_forward_hook(self._eval_forward_end)

    def on_step_start(self, trainer) -> None:
        self._close_evaluation()
        self.calls += 1
        if self.profile_steps and self.calls == self.profile_at:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
            self.prof.__enter__()
        if self.prof is not None:
            from torch.profiler import record_function

            from harness.profile import STEP_REGION

            self.region = record_function(STEP_REGION)
            self.region.__enter__()
        self.t0 = time.perf_counter()

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        self.last = time.perf_counter()
        RECORD["train_step_s"].append(self.last - self.t0)
        if self.region is not None:
            self.region.__exit__(None, None, None)
            self.region = None
            if self.calls == self.profile_at + self.profile_steps - 1:
                from harness.profile import step_breakdown

                prof, self.prof = self.prof, None
                prof.__exit__(None, None, None)
                RECORD["profile"] = step_breakdown(prof.events(), self.profile_steps)

    def on_save(self, trainer, path) -> None:
        self._close_evaluation()
        now = time.perf_counter()
        RECORD["save_s"].append(now - self.last)
        self.last = now

    def on_end(self, trainer, summary) -> None:
        self._close_evaluation()
        RECORD["train_end"] = time.time()
