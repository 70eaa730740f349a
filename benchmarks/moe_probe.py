"""What a worker of ``benchmarks/moe.py`` (part 2) attaches to its Trainer (``train.hooks``): per step and rank, the
wall and process CPU time of the step and of the expert-parallel exchange. It changes nothing the run computes;
each rank writes ``rank<R>.json`` to its folder at the end of the run.

* the step: ``on_step_start`` to ``after_optimizer`` (after the step's last collective);
* dispatch / combine: the forward pre-hooks and forward hooks of every experts module, timed by a first and a last
  hook of this probe around them: ``ExpertDispatch.dispatch`` / ``combine`` (dufu/parallel/expert_parallel.py,
  installed as those hooks by ``distribute_module``), the index bookkeeping that orders tokens around the exchange
  included, and the experts' data-parallel unit's own pre- and post-forward;
* the token all-to-all itself, in forward and in backward: ``all_to_all_single_autograd``, torch's function the
  expert-parallel module calls, is replaced there by an autograd function that issues the same functional
  collective (``_c10d_functional.all_to_all_single`` + ``wait_tensor``, as torch's own backward does) with a timer
  around each direction;
* ``torch.distributed.all_to_all_single``: the exchange of the token counts before each dispatch;
* ``torch.distributed.all_reduce``: the data-parallel gradient average (blocking under ``replicate``, ZeRO off) and
  the loss, gradient-norm and target-count reductions, for comparison.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from dufu.engine.hooks import Hook
from harness import launch


class Clock:
    """Wall and process CPU seconds per named region, summed over the current step."""

    def __init__(self):
        self.acc: dict = {}
        self._open: dict = {}

    def reset(self) -> None:
        self.acc = {}

    def start(self, name: str) -> None:
        self._open[name] = (time.perf_counter(), time.process_time())

    def stop(self, name: str) -> None:
        wall0, cpu0 = self._open.pop(name)
        self.acc[f"{name}_s"] = self.acc.get(f"{name}_s", 0.0) + time.perf_counter() - wall0
        self.acc[f"{name}_cpu_s"] = self.acc.get(f"{name}_cpu_s", 0.0) + time.process_time() - cpu0

    @contextlib.contextmanager
    def timing(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)


def _time_collectives(clock: Clock) -> None:
    """The all-to-alls and all-reduces timed (module docstring); the functions are called as before."""
    import dufu.parallel.expert_parallel as ep_mod

    def exchange(x, output_split_sizes, input_split_sizes, group):
        # what all_to_all_single_autograd issues (and its backward, with the splits swapped), waited for at once
        y = torch.ops._c10d_functional.all_to_all_single(x, output_split_sizes, input_split_sizes, group.group_name)
        return torch.ops._c10d_functional.wait_tensor(y)

    class TimedAllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, output_split_sizes, input_split_sizes, group):
            ctx.splits, ctx.group = (list(output_split_sizes), list(input_split_sizes)), group
            with clock.timing("a2a_forward"):
                return exchange(x, output_split_sizes, input_split_sizes, group)

        @staticmethod
        def backward(ctx, grad):
            out_splits, in_splits = ctx.splits
            with clock.timing("a2a_backward"):
                return exchange(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None

    def all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group, tag=""):
        return TimedAllToAll.apply(x, output_split_sizes, input_split_sizes, group)

    ep_mod.all_to_all_single_autograd = all_to_all_single_autograd
    counts_exchange, all_reduce = dist.all_to_all_single, dist.all_reduce

    def all_to_all_single(*args, **kwargs):
        with clock.timing("a2a_counts"):
            return counts_exchange(*args, **kwargs)

    def timed_all_reduce(*args, **kwargs):
        with clock.timing("all_reduce"):
            return all_reduce(*args, **kwargs)

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, timed_all_reduce


class ExpertTimers(Hook):
    """The step's and the exchange's times on every step of this rank (module docstring)."""

    def __init__(self, out_dir: str):
        self.out_dir, self.clock, self.records = out_dir, Clock(), []

    def on_start(self, trainer) -> None:
        from dufu.parallel.expert_parallel import expert_modules

        clock = self.clock
        for part in trainer.model_parts if trainer.runtime.dims.ep_enabled else ():  # EP 1 exchanges nothing
            for _, experts in expert_modules(part):
                experts.register_forward_pre_hook(lambda m, a: clock.start("dispatch"), prepend=True)
                experts.register_forward_pre_hook(lambda m, a: clock.stop("dispatch"))
                experts.register_forward_hook(lambda m, a, out: clock.start("combine"), prepend=True)
                experts.register_forward_hook(lambda m, a, out: clock.stop("combine"))
        _time_collectives(clock)

    def on_step_start(self, trainer) -> None:
        self.clock.reset()
        self.clock.start("step")

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        self.clock.stop("step")
        self.records.append(dict(self.clock.acc))

    def on_end(self, trainer, summary) -> None:
        rt = trainer.runtime
        ep = rt.dims.expert_parallel_size if rt.dims.ep_enabled else 1
        launch.write_rank_file(self.out_dir, rt.rank, {"rank": rt.rank, "ep": ep, "steps": self.records})
