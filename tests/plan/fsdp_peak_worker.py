"""A torchrun worker: ``dufu train`` runs, one after another in the same processes, each with one training step's
peak of tensor memory measured on every rank, to check the planner's memory model against.

    python -m torch.distributed.run --standalone --nproc-per-node=N tests/plan/fsdp_peak_worker.py PLAN.json \
        train.output_dir=JOB

PLAN.json lists runs ``{"name", "config", "args"}``; each trains into ``JOB/NAME`` through
``dufu.cli.main(["train", ...])`` (as tests/parity_worker.py runs them: between runs the workers meet at a barrier
instead of leaving), and every rank writes ``JOB/NAME/peak-rank<r>.json``:

* ``states``: bytes of the tensors alive when the measured step (the second: the optimizer's state exists and the
  step is a steady one) starts that live through it: every parameter's local shard and buffer, the optimizer's
  state, read off the model and the optimizer;
* ``rise``: the step's peak above that, from torch's profiler (``profile_memory=True``): the CPU allocator's running
  total of live bytes, read at every allocation and free it records from the step's start to the end of its
  optimizer step (:func:`count_every_thread` says why the total and not the sum of the recorded sizes);
* ``peak``: their sum.

The step is measured by a training-loop hook (:class:`PeakMemory`, attached through ``train.hooks``).
tests/launch.py's in_turn marks each run done in ``JOB/.done/NAME``."""

import ctypes
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: launch.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import dufu.parallel.launch as dufu_launch  # noqa: E402
from dufu.cli import main as dufu  # noqa: E402
from dufu.engine.hooks import Hook  # noqa: E402
from launch import in_turn  # noqa: E402

MEASURED_STEP = 2


def resident_bytes(trainer) -> int:
    """Bytes of the storages behind the model parts' parameters and buffers and the optimizers' state (each
    storage once: FSDP2's shards are views of one padded buffer per parameter)."""
    tensors = []
    for part in trainer.runtime.model_parts:
        tensors += list(part.parameters()) + list(part.buffers())
    for opt in trainer.optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def count_every_thread() -> None:
    """Make the CPU allocator's profiler reporter count the allocations and frees of every thread, not only of the
    threads the profiler records (c10's flag ``caffe2_report_cpu_memory_usage``; torch exposes it to no Python API,
    so it is set in libc10 directly).

    The profiler records a free only on a thread it profiles. Gloo runs each collective on a worker thread that holds
    references to the collective's tensors until it drops the finished work; when that thread drops the last one
    (it was descheduled while the training thread moved on), the free is not recorded and the tensor looks alive to
    the end of the step. Summing the recorded sizes then added a block's reduce-scatter buffer (~200 KB) to the peak
    once for every such race: 0 to 7 per step, more on a loaded machine (one rank of the accumulating run measured
    15.19 MB against 14.50 MB on the other). With the flag set, the reporter keeps one running total over every
    thread's allocations, and each recorded event carries it. It stays set for the rest of the process: an
    allocation counted while it is set and freed after it is cleared would stay in the total."""
    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    if not lib.is_file():
        raise RuntimeError(f"{lib} is missing: this measurement needs torch's c10 library as Linux wheels ship it")
    ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage").value = True


def allocator_totals(prof) -> list:
    """[(bytes allocated (+) or freed (-), the allocator's total after it)] of the profile's memory events, in time
    order."""
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo += event.children
        if event.tag == torch._C._profiler._EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated))
    return [(size, total) for _, size, total in sorted(events, key=lambda e: e[0])]


class PeakMemory(Hook):
    def __init__(self):
        self.out = Path(os.environ["DUFU_TEST_PEAK_FILE"])
        self.prof = None
        self.states = 0

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 != MEASURED_STEP:
            return
        self.states = resident_bytes(trainer)
        count_every_thread()
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def after_optimizer(self, trainer, loss: float, grad_norm: float) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        events = allocator_totals(self.prof)
        start = events[0][1] - events[0][0]  # the total before the step's first allocation
        peak = max(total for _, total in events) - start
        self.out.write_text(json.dumps({"states": self.states, "rise": peak, "peak": self.states + peak}))
        self.prof = None


def between_runs(exit_code: int = 0) -> None:
    """What the runs call instead of ``finish_distributed`` (which ends the process): every rank is done."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()


def main(plan_file: str, job: str) -> None:
    runs = {run["name"]: run for run in json.loads(Path(plan_file).read_text())}
    finish, dufu_launch.finish_distributed = dufu_launch.finish_distributed, between_runs

    def train(name: str) -> None:
        run, out = runs[name], Path(job) / name
        os.environ["DUFU_TEST_PEAK_FILE"] = str(out / f"peak-rank{os.environ.get('RANK', '0')}.json")
        code = dufu(["train", run["config"], *run["args"], f"train.output_dir={out}",
                     f"train.train_iter={MEASURED_STEP}", 'train.hooks=[{"_target_": "__main__.PeakMemory"}]'])
        assert code == 0, f"dufu train exited with {code}"

    in_turn(job, list(runs), train)
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split("=", 1)[1])
