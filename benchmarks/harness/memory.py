"""Every rank's peak resident memory (RSS) in the phases of a ``dufu train`` job, and the parameters it holds.

:class:`MemoryPhases` is a hook (``train.hooks``) that writes ``rank<R>.json`` to its folder at the end of the run:

* ``build``      -- from the process's start to the loop's start (``on_start``): imports, data, the model (on the
                    meta device, then each rank's shards, or with ``train.meta_init=False`` the full model
                    first), process group, sharding, optimizer objects (AdamW creates its state lazily, at the
                    first step);
* ``train``      -- from there to the end of the last step (``after_optimizer`` of step ``train.train_iter``);
* ``checkpoint`` -- the final checkpoint save (the trainer always saves at the last step: ``on_save``).

Phase peaks come from the kernel's high-water mark (``VmHWM``), reset between phases
(:func:`harness.proc.reset_high_water_mark`); where that reset is refused, the phase values are cumulative peaks
(``"phases_cumulative": true``). The record also holds the trainer's ``meta_init`` and the parameters the rank
holds once built (``held_parameters``, ``held_parameter_bytes``: local shards of DTensors, tied tensors once).

:func:`memory_job` runs ``dufu train`` under torchrun with the hook and reads every rank's record. Run it with
``ALLOCATORS["mmap64k"]``: glibc then maps every allocation of 64 KiB or more on its own and returns it when freed,
so RSS follows the live tensors (with glibc's default, freed heap stays in the process).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

from dufu.engine.hooks import Hook
from harness import launch, proc

ALLOCATORS = {
    # RSS follows live tensors: allocations >= 64 KiB are mmap'ed and unmapped on free.
    "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"},
    # glibc's default: the mmap threshold grows with freed blocks (up to 32 MiB); freed memory below it stays.
    "default": {},
}
PHASES = ("build", "train", "checkpoint")


def held_parameters(parts) -> dict:
    """The parameters a rank holds: its pipeline stages' own tensors, each DTensor counted by its local shard, a
    tensor shared by two names once. Allocates nothing."""
    from torch.distributed.tensor import DTensor

    unique = {id(p): p for part in parts for p in part.parameters()}
    local = [p.to_local() if isinstance(p, DTensor) else p for p in unique.values()]
    return {"held_parameters": sum(t.numel() for t in local),
            "held_parameter_bytes": sum(t.numel() * t.element_size() for t in local)}


class MemoryPhases(Hook):
    """Peak RSS per phase of this rank (module docstring), written to ``out_dir/rank<R>.json`` at ``on_end``."""

    def __init__(self, out_dir: str):
        self.out_dir = Path(out_dir)
        self.record: dict = {"phases_kb": {}, "phases_cumulative": False}

    def _end_phase(self, name: str) -> None:
        if name not in self.record["phases_kb"]:
            self.record["phases_kb"][name] = proc.status_kib("VmHWM")
            if not proc.reset_high_water_mark():
                self.record["phases_cumulative"] = True

    def on_start(self, trainer) -> None:
        self._end_phase("build")
        self.record.update(held_parameters(trainer.model_parts), meta_init=bool(trainer.runtime.meta_init),
                           rss_after_build_kb=proc.status_kib("VmRSS"))

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        if trainer.step + 1 >= trainer.cfg.train.train_iter:  # the last step: the final save comes next
            self._end_phase("train")

    def on_save(self, trainer, path) -> None:
        if "train" in self.record["phases_kb"]:
            self._end_phase("checkpoint")

    def on_end(self, trainer, summary) -> None:
        r = self.record
        r["rss_at_exit_kb"] = proc.status_kib("VmRSS")
        # ru_maxrss (KiB on Linux): the peak since the last high-water-mark reset when resets work.
        r["ru_maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r["peak_kb"] = max(r["phases_kb"].values(), default=proc.status_kib("VmHWM"))
        launch.write_rank_file(self.out_dir, trainer.rank, r)


def phase_mib(rank: dict, phase: str) -> float:
    """A rank record's peak (``"peak"``) or one phase's peak, in MiB."""
    if phase == "peak":
        return rank["peak_kb"] / 1024
    return rank["phases_kb"].get(phase, 0) / 1024


def memory_job(label: str, nproc: int, argv: list[str], out: Path, cache: Path, timeout: float,
               allocator: str = "mmap64k", threads: int = 1) -> tuple[launch.Run, list[dict] | None]:
    """``dufu train ARGV`` under torchrun (``nproc`` workers, one as well) with a :class:`MemoryPhases` hook; its output folder is ``out/run``, every rank's record is read from ``out/mem``.
    Returns the run and the records (None when the run failed or a record is missing)."""
    mem_dir = out / "mem"
    argv = [*argv, f"train.output_dir={out / 'run'}",
            launch.hooks_override(("harness.memory.MemoryPhases", {"out_dir": mem_dir}))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dufu", "train", *argv]
    run = launch.execute(launch.Run(label, cmd, launch.job_env(cache, threads, ALLOCATORS[allocator]), out),
                         timeout)
    ranks = launch.read_rank_files(mem_dir, nproc) if run.rc == 0 else None
    return run, ranks

