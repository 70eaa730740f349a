"""Memory on the record: each rank's peak since the last look, gathered for rank 0's record and the end summary,
the planner's predicted peak beside it, and, when memory runs out, an error that says what filled it.

What is measured, per device type:

* CUDA: the caching allocator's peaks, ``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved``
  (what the allocator holds from the driver, its cache included), reset after each reading;
* CPU: the process's resident set high-water mark (``VmHWM`` of ``/proc/self/status``). Linux 4.0 and later
  reset it to the current resident set when "5" is written to ``/proc/self/clear_refs`` (proc(5)); where that is
  refused (or on a system without ``/proc``) the reading is the high water of the whole process so far, and its key
  says so (``mem_rss_run_peak_mib`` instead of ``mem_rss_peak_mib``). The resident set counts the interpreter,
  torch's libraries and a memory-mapped dataset's touched pages beside the tensors: compare the planner's figure
  (tensors only) with its growth above the resident set before the run was built (:func:`process_rss_bytes`).

The planner (:mod:`dufu.plan`) sits above the engine in dufu's layers, so :func:`planned_memory` takes its estimate
function from the caller (``dufu.cli.train``) instead of importing it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.parallel.env import collective_device

MiB = 1024**2
CUDA_KEYS = ("mem_peak_allocated_mib", "mem_peak_reserved_mib")
RSS_KEY = "mem_rss_peak_mib"  # since the previous reading (the high-water mark could be reset)
RSS_RUN_KEY = "mem_rss_run_peak_mib"  # since the process started (it could not)
# What the CPU allocator's failure says (c10's DefaultCPUAllocator); torch raises it as a RuntimeError.
CPU_ALLOCATION_FAILURE = "DefaultCPUAllocator: can't allocate memory"
HISTORY_ENTRIES = 100_000  # allocation events the CUDA allocator keeps for a snapshot (a ring: the latest ones)
LARGEST_SHOWN = 50  # tensors listed in an out-of-memory snapshot


# ------------------------------------------------------------------------------------------- measuring


def _proc_status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (``VmHWM``, ``VmRSS``), or None without it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _run_peak_rss_bytes() -> int:
    """The process's resident set high water since it started, where /proc is missing (getrusage: KiB on Linux,
    bytes on macOS)."""
    import resource  # here, not at the top: POSIX only, and only where /proc is missing

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def process_rss_bytes() -> int:
    """This process's resident set now (bytes); 0 where the system does not say."""
    kib = _proc_status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def reset_rss_high_water() -> bool:
    """Set the resident set high-water mark to the current resident set (proc(5), clear_refs "5", Linux >= 4.0);
    False where the kernel, a sandbox or the file's permissions refuse."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_record(device: torch.device) -> dict:
    """This rank's peak memory since the previous call (the first: since the process started), in MiB, and the
    peak reset for the next call. CUDA: ``mem_peak_allocated_mib`` (tensors) and ``mem_peak_reserved_mib`` (the
    allocator's share of the device, its cache included). Any other device: the process's resident set,
    ``mem_rss_peak_mib``, or ``mem_rss_run_peak_mib`` where the high-water mark cannot be reset (then it is the
    whole process's peak so far; see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":  # unverified here: this machine has no GPU
        record = {"mem_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MiB,
                  "mem_peak_reserved_mib": torch.cuda.max_memory_reserved(device) / MiB}
        torch.cuda.reset_peak_memory_stats(device)
        return record
    hwm = _proc_status_kib("VmHWM")
    if hwm is None:
        return {RSS_RUN_KEY: _run_peak_rss_bytes() / MiB}
    key = RSS_KEY if reset_rss_high_water() else RSS_RUN_KEY
    return {key: hwm * 1024 / MiB}


def gather_memory_records(record: dict, group=None) -> tuple[dict, list[dict]]:
    """(the largest value of each key over the ranks of ``group``, every rank's record in rank order). Every rank
    calls it with the same keys (the same device type): one all-gather of a few numbers, on the device the
    group's backend reduces on (NCCL: this rank's GPU). Without a process group: (``record``, [``record``])."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(record), [dict(record)]
    keys = sorted(record)
    device = collective_device(group)
    mine = torch.tensor([float(record[k]) for k in keys], dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu()  # (ranks, keys)
    per_rank = [dict(zip(keys, row)) for row in table.tolist()]
    return dict(zip(keys, table.max(dim=0).values.tolist())), per_rank


class RunPeaks:
    """Every rank's peak over the run so far, from the per-rank records of :func:`gather_memory_records`, and
    the end summary's line about them."""

    def __init__(self):
        self.per_rank: list[dict] = []

    def add(self, per_rank: list[dict]) -> None:
        if not self.per_rank:
            self.per_rank = [dict(r) for r in per_rank]
            return
        for mine, new in zip(self.per_rank, per_rank):
            for k, v in new.items():
                mine[k] = max(mine.get(k, v), v)

    def text(self, planned: Optional["PlannedMemory"] = None, start_rss_bytes: Optional[int] = None) -> str:
        """``peak memory  ...``: the largest rank's peak (and the spread over ranks), beside the planned peak:
        on CUDA against the allocated peak, on a CPU against the growth above ``start_rss_bytes`` (the resident
        set before the run was built, :func:`process_rss_bytes`)."""
        if not self.per_rank:
            return "  peak memory  not measured"
        key = next((k for k in (CUDA_KEYS[0], RSS_KEY, RSS_RUN_KEY) if k in self.per_rank[0]), None)
        if key is None:
            return "  peak memory  not measured"
        values = [r[key] for r in self.per_rank]
        top = max(range(len(values)), key=values.__getitem__)
        what = {CUDA_KEYS[0]: "allocated", RSS_KEY: "resident set", RSS_RUN_KEY: "resident set"}[key]
        text = f"  peak memory  {values[top]:,.1f} MiB {what}"
        if len(values) > 1:
            text += f" on rank {top} (ranks {min(values):,.1f}-{values[top]:,.1f} MiB)"
        if key == CUDA_KEYS[0]:
            text += f", {max(r[CUDA_KEYS[1]] for r in self.per_rank):,.1f} MiB reserved"
        compared = values[top] if key == CUDA_KEYS[0] else None  # the resident set: only its growth compares
        if key != CUDA_KEYS[0] and start_rss_bytes:
            compared = values[top] - start_rss_bytes / MiB
            text += f", {compared:,.1f} MiB above the resident set before the run was built"
        if planned is not None and planned.peak_bytes:
            text += f"; planned {planned.peak_bytes / MiB:,.1f} MiB of tensors"
            if compared is not None and compared > 0:
                text += f" ({planned.peak_bytes / MiB / compared:.2f}x the measured)"
        return text


# ------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlannedMemory:
    """The planner's predicted peak of one rank, or why there is none. ``peak_bytes``: the most loaded pipeline
    rank's (None: no prediction); ``covers``: what the figure counts, or the reason; ``by_pipeline_rank``: the
    peak of each pipeline rank (every data/tensor-parallel rank of a stage holds the same)."""

    peak_bytes: Optional[int]
    covers: str
    by_pipeline_rank: tuple = ()

    def record(self) -> dict:
        """``{"mem_planned_peak_mib": ...}`` for a record, or {} without a prediction."""
        return {} if self.peak_bytes is None else {"mem_planned_peak_mib": self.peak_bytes / MiB}

    def line(self) -> str:
        """The start-up summary's line."""
        if self.peak_bytes is None:
            return f"  memory       no planned peak: {self.covers}"
        return f"  memory       planned peak {self.peak_bytes / MiB:,.1f} MiB per rank: {self.covers}"


def planned_memory(cfg, world_size: int, estimate: Callable, dtype: Optional[str] = None) -> PlannedMemory:
    """The planner's predicted per-rank peak for ``cfg`` on ``world_size`` processes, or None with the reason.

    ``estimate(cfg, world_size)``: ``dufu.plan.estimate`` with the run's device bound, e.g.
    ``functools.partial(dufu.plan.estimate, hardware=dufu.plan.auto.hardware_for_run(cfg))`` (the caller passes
    it: dufu.plan sits above the engine). ``dtype``: the precision the runtime chose ("fp32", "bf16" or "fp16"),
    given to the planner so that it does not choose again. The model is built on the meta device and one step
    traced on fake tensors (a few blocks of it, :mod:`dufu.plan.trace`): no memory of the run's own."""
    cfg = copy.deepcopy(cfg)
    if dtype is not None:
        cfg.train.amp.enabled = False if dtype == "fp32" else dtype
    try:
        est = estimate(cfg, world_size)
    except Exception as e:  # a report must not stop a run: any failure of the planner is a reason, not a crash
        reason = " ".join(str(e).split()) or type(e).__name__
        return PlannedMemory(None, f"the planner cannot predict this run ({reason[:300]})")
    covers = (f"tensors of the most loaded rank at its peak ({est.peak_where}): parameters, gradients, optimizer "
              "states, activations, communication buffers and temporaries; not the allocator's cache, the CUDA "
              "context or the process itself")
    if cfg.get("distill") is not None:
        covers += "; without the distillation teacher"
    return PlannedMemory(int(est.memory_per_gpu_bytes), covers, tuple(int(b) for b in est.memory_by_rank))


# ------------------------------------------------------------------------------------------- out of memory


def start_memory_history(device: torch.device, max_entries: int = HISTORY_ENTRIES) -> bool:
    """Have the CUDA allocator keep its latest ``max_entries`` allocation events with their Python stacks, for the
    snapshot :func:`on_out_of_memory` writes; True when it does. A no-op (False) on other devices."""
    if torch.device(device).type != "cuda":
        return False
    # unverified here (no GPU): the API of torch >= 2.1; Python stacks only, C++ ones cost much more per allocation
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    return True


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure: torch's OutOfMemoryError (CUDA), the CPU allocator's RuntimeError, a MemoryError."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and CPU_ALLOCATION_FAILURE in str(error)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor, device: torch.device) -> Optional[tuple]:
    """((device, address), bytes) of the storage under ``t`` when it lives on ``device``, else None."""
    try:
        s = _local(t).untyped_storage()
        where = s.device  # a fake tensor says "cpu" but its storage is on the meta device
        if where.type != device.type or (device.index is not None and where.index not in (None, device.index)):
            return None
        if not s.data_ptr():
            return None
        return (str(where), s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, meta, fake: nothing of the device's
        return None


def live_tensors(device: torch.device, model_parts: Iterable = (), optimizers: Iterable = ()) -> list[dict]:
    """Every storage on ``device`` this process can see, largest first, each once: the model parts' parameters
    and gradients, the optimizers' states, then the other tensors Python holds (found through ``gc``; a tensor
    autograd saved for backward has no Python object and is not among them)."""
    device = torch.device(device)
    seen: dict = {}

    def add(t, category: str, name: str) -> None:
        found = _storage(t, device)
        if found is not None and found[0] not in seen and found[1] > 0:
            seen[found[0]] = {"category": category, "name": name, "shape": list(t.shape),
                              "dtype": str(t.dtype).removeprefix("torch."), "bytes": found[1]}

    names = {}
    parts = list(model_parts)
    for part in parts:
        for name, p in part.named_parameters():
            names[id(p)] = name
            add(p, "parameters", name)
    for part in parts:
        for name, p in part.named_parameters():
            if p.grad is not None:
                add(p.grad, "gradients", name)
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(value, "optimizer states", f"{key} of {names.get(id(p), 'a parameter')}")
    for obj in gc.get_objects():  # on an out-of-memory error only: a walk of every object Python tracks
        if issubclass(type(obj), torch.Tensor):  # not isinstance: it reads __class__, which some objects warn on
            add(obj, "other tensors", "")
    return sorted(seen.values(), key=lambda r: -r["bytes"])


def _in_use_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes this rank holds on ``device``, what that figure is)."""
    if device.type == "cuda":  # unverified here
        return torch.cuda.memory_allocated(device), "allocated by torch"
    return process_rss_bytes(), "the process's resident set"


def write_memory_snapshot(path: Path, device: torch.device, rank: int, error: BaseException,
                          model_parts: Iterable = (), optimizers: Iterable = ()) -> dict:
    """Write ``path`` (JSON): the bytes by category, what they leave unaccounted, the largest live tensors; on
    CUDA also the allocator's snapshot beside it (``.pickle``, for https://pytorch.org/memory_viz). Returns the
    JSON's content with ``pickle`` (its path or None)."""
    device = torch.device(device)
    tensors = live_tensors(device, model_parts, optimizers)
    categories: dict = {}
    for t in tensors:
        categories[t["category"]] = categories.get(t["category"], 0) + t["bytes"]
    in_use, what = _in_use_bytes(device)
    data = {"rank": rank, "device": str(device), "error": " ".join(str(error).split())[:1000],
            "categories_bytes": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "in_use_bytes": in_use, "in_use_is": what,
            "unaccounted_bytes": max(in_use - sum(categories.values()), 0),
            "largest": [{**t, "mib": round(t["bytes"] / MiB, 3)} for t in tensors[:LARGEST_SHOWN]], "pickle": None}
    path.parent.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda":  # unverified here: the allocator's state and its recorded history, if started
        pickled = path.with_suffix(".pickle")
        try:
            torch.cuda.memory._dump_snapshot(str(pickled))
            data["pickle"] = str(pickled)
        except Exception as e:  # the JSON still says what filled the device
            data["pickle_error"] = f"{type(e).__name__}: {e}"
    path.write_text(json.dumps(data, indent=1))
    return data


ADVICE = {
    "activations": "a smaller train.train_micro_batch_size (raise train.num_accumulation_steps, or keep "
                   "train.global_batch_size, for the same batch) or activation checkpointing "
                   "(train.activation_checkpoint.enabled=True; mode=full keeps the least)",
    "model states": "ZeRO over the data-parallel ranks (train.zero_optimization.enabled=True, stage=3 shards "
                    "parameters, gradients and optimizer states), or tensor / pipeline parallelism",
}


def out_of_memory_message(data: dict, path: Path, activity: str = "") -> str:
    """The error's text: where, the largest holders with MiB, the snapshot, and what to change (the advice for
    the larger of the model states and the rest first)."""
    cats = data["categories_bytes"]
    held = [f"{name} {b / MiB:,.1f} MiB" for name, b in cats.items()]
    unaccounted = data["unaccounted_bytes"]
    process = ", the interpreter and libraries" if data["device"].startswith("cpu") else ""
    held.append(f"{unaccounted / MiB:,.1f} MiB of {data['in_use_is']} not held by those (activations autograd "
                f"saved for backward, temporaries{process})")
    states = sum(cats.get(k, 0) for k in ("parameters", "gradients", "optimizer states"))
    order = ["model states", "activations"] if states > unaccounted + cats.get("other tensors", 0) else \
        ["activations", "model states"]
    snapshot = f"{path}" + (f" and the allocator's history {data['pickle']} (open it at https://pytorch.org/memory_viz)"
                            if data.get("pickle") else "")
    where = f" {activity}" if activity else ""
    return (f"rank {data['rank']} ran out of memory on {data['device']}{where}: {data['error'][:300]}. "
            f"What it held: {'; '.join(held)}. The largest tensors are listed in {snapshot}. To need less memory "
            f"per rank: {ADVICE[order[0]]}; or {ADVICE[order[1]]}. `dufu plan CONFIG --gpus N` predicts each "
            "layout's peak.")


@contextlib.contextmanager
def on_out_of_memory(output_dir, device, rank: int = 0, model_parts: Iterable = (), optimizers: Iterable = (),
                     activity: Callable[[], str] | str = ""):
    """A context manager that turns an allocation failure inside it (:func:`is_out_of_memory`) into an error of
    the same type whose message names this rank's largest holders of memory with MiB, the snapshot written to
    ``output_dir/memory_snapshot_rank<rank>.json`` (:func:`write_memory_snapshot`) and how to need less memory.
    ``model_parts``, ``optimizers``: what the categories parameters, gradients and optimizer states are read
    from; ``activity``: where the run was ("at step 12"), or a function returning it. Other errors pass."""
    model_parts, optimizers = list(model_parts), list(optimizers)
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error) or getattr(error, "memory_reported", False):
            raise
        path = Path(output_dir) / f"memory_snapshot_rank{rank}.json"
        try:
            data = write_memory_snapshot(path, torch.device(device), rank, error, model_parts, optimizers)
        except Exception as e:  # the original error matters more than its report
            error.add_note(f"(no memory snapshot: {type(e).__name__}: {e})")
            raise error  # with the failed report as its context
        where = activity() if callable(activity) else activity
        message = out_of_memory_message(data, path, where or "")
        try:  # the same type, so that code catching torch's OutOfMemoryError still catches it
            clear = type(error)(message)
        except TypeError:  # a subclass whose constructor takes other arguments
            clear = RuntimeError(message)
        clear.memory_reported = True  # an outer guard passes it on unchanged
        raise clear from error

