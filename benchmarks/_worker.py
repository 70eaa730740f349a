"""One `dufu train` worker that also records its own resident memory, for benchmarks/parallel.py.

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/_worker.py train CONFIG key=value ...

It runs exactly what ``dufu train`` runs in a worker (``dufu.cli.main``). When ``DUFU_BENCH_MEMORY_DIR`` is set,
it writes ``rank<R>.json`` there with the peak resident set size (RSS) of this process in three phases:

* ``build``      -- from the start of ``Trainer.__init__`` (all imports done) to its end: data, the model
                    (on the meta device, then each rank's shards, or with ``train.meta_init=False`` the full
                    model first), process group, sharding, optimizer objects (AdamW creates its state lazily,
                    at the first step);
* ``train``      -- from there to the start of the final checkpoint save: the training steps;
* ``checkpoint`` -- the final checkpoint save (the trainer always saves at the last step).

It also records the trainer's ``meta_init`` and the parameters the rank holds once built
(``held_parameters``, ``held_parameter_bytes``: local shards of DTensors, tied tensors once).

Phase peaks come from the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``), reset between phases
by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). Where that reset is refused, the phase values are
cumulative peaks (``"phases_cumulative": true``). The patches below only wrap trainer methods to take
readings; they change nothing the trainer does.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

OUT_DIR = os.environ.get("DUFU_BENCH_MEMORY_DIR")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryRecorder:
    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.record: dict = {"phases_kb": {}, "phases_cumulative": False}
        self.written = False

    def mark_start(self) -> None:
        self.record["rss_at_trainer_start_kb"] = _status_kb("VmRSS")
        self.record["hwm_before_trainer_kb"] = _status_kb("VmHWM")
        self._reset()

    def end_phase(self, name: str) -> None:
        if name not in self.record["phases_kb"]:
            self.record["phases_kb"][name] = _status_kb("VmHWM")
            self._reset()

    def _reset(self) -> None:
        if not _reset_high_water_mark():
            self.record["phases_cumulative"] = True

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        self.record["rss_at_exit_kb"] = _status_kb("VmRSS")
        # ru_maxrss (KiB on Linux): the peak since the last high-water-mark reset when resets work.
        self.record["ru_maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        phases = self.record["phases_kb"]
        self.record["peak_kb"] = max([*phases.values(), self.record["hwm_before_trainer_kb"]])
        rank = int(os.environ.get("RANK", 0))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, self.out_dir / f"rank{rank}.json")


def held_parameters(parts) -> dict:
    """The parameters this rank holds after building: its pipeline stages' own tensors, each DTensor counted
    by its local shard, a tensor shared by two names once. Read after the build phase; allocates nothing."""
    from torch.distributed.tensor import DTensor

    unique = {id(p): p for part in parts for p in part.parameters()}
    local = [p.to_local() if isinstance(p, DTensor) else p for p in unique.values()]
    return {"held_parameters": sum(t.numel() for t in local),
            "held_parameter_bytes": sum(t.numel() * t.element_size() for t in local)}


def install(recorder: MemoryRecorder) -> None:
    import atexit

    import dufu.parallel.launch as launch
    from dufu.engine.trainer import Trainer

    init, save, finish = Trainer.__init__, Trainer.save_checkpoint, launch.finish_distributed

    def __init__(self, *args, **kwargs):
        recorder.mark_start()
        init(self, *args, **kwargs)
        recorder.end_phase("build")
        recorder.record.update(held_parameters(self.model_parts), meta_init=bool(self.meta_init))

    def save_checkpoint(self, *args, **kwargs):
        recorder.end_phase("train")
        try:
            return save(self, *args, **kwargs)
        finally:
            recorder.end_phase("checkpoint")

    def finish_distributed(*args, **kwargs):
        recorder.write()  # finish_distributed leaves through os._exit: atexit handlers do not run
        return finish(*args, **kwargs)

    Trainer.__init__ = __init__
    Trainer.save_checkpoint = save_checkpoint
    launch.finish_distributed = finish_distributed  # dufu.cli imports it from the module at call time
    atexit.register(recorder.write)  # one process: no finish_distributed


def main() -> int:
    if OUT_DIR:
        install(MemoryRecorder(OUT_DIR))
    from dufu.cli import main as dufu_main

    return dufu_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
