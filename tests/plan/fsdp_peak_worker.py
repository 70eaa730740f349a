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
* ``rise``: the step's peak above that, from torch's profiler (``profile_memory=True``): every allocation and free
  of torch's CPU allocator from the step's start to the end of its optimizer step, summed in time order;
* ``peak``: their sum.

The step is measured by a training-loop hook (:class:`PeakMemory`, attached through ``train.hooks``).
tests/launch.py's in_turn marks each run done in ``JOB/.done/NAME``."""

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


class PeakMemory(Hook):
    def __init__(self):
        self.out = Path(os.environ["DUFU_TEST_PEAK_FILE"])
        self.prof = None
        self.states = 0

    def on_step_start(self, trainer) -> None:
        if trainer.step + 1 != MEASURED_STEP:
            return
        self.states = resident_bytes(trainer)
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def after_optimizer(self, trainer, loss: float, grad_norm: float) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        events = sorted((e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        now = peak = 0
        for e in events:
            now += e.nbytes()
            peak = max(peak, now)
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
