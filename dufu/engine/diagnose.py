"""Failures a person can act on: a collective with other ranks that failed or timed out (which ranks no longer
respond, and, from the flight recorder's dumps, which rank did not join which collective), and non-finite losses or
gradients (and which parameters they are in)."""

from __future__ import annotations

import ast
import contextlib
import datetime
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dufu.errors import DistributedFailure, DufuError
from dufu.parallel import env


@contextlib.contextmanager
def collective_failures(rank: int, activity: Callable[[], str], timeout_minutes: float, health_group):
    """Turn a failed or timed-out collective (another rank died or hangs) into a DistributedFailure that names
    this rank, what it was doing (``activity()``), the ranks that no longer respond and where NCCL's flight
    recorder writes its dumps (with their verdict once every rank's is there), instead of a hang or a wall of
    traceback. Errors of this rank's own making pass through unchanged."""
    try:
        yield
    except DufuError:
        raise
    except (RuntimeError, dist.DistError) as e:
        if not looks_distributed(e):
            raise
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        raise DistributedFailure(
            f"rank {rank} stopped {activity()}: a collective operation with the other ranks failed or waited "
            f"longer than train.dist.timeout_minutes={timeout_minutes} (train.dist.startup_timeout_minutes before "
            f"the first step ended). {unresponsive_ranks(health_group, timeout_minutes)}"
            f"{flight_recorder_note(world_size)}Cause: {first[:300]}"
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


# ------------------------------------------------------------------------------------------- the flight recorder
# torch's flight recorder keeps each rank's last collectives in a ring buffer and, on NCCL with
# TORCH_NCCL_DUMP_ON_TIMEOUT (set by dufu.parallel.env.nccl_debug_environment), writes it to one pickle per rank
# when a collective times out: {"version", "pg_config": {group name: {"name", "desc", "ranks"}}, "pg_status": {group
# name: {"last_enqueued_collective", ...}}, "entries": [{"process_group": (name, desc), "collective_seq_id",
# "profiling_name", "input_sizes", "output_sizes", "state", "is_p2p", "time_created_ns", ...}]} (torch's flight
# recorder tutorial). torch's analyzer (torchfrtrace, torch.distributed.flight_recorder) prints its verdicts through a
# logger rather than returning them, refuses a set without every rank's dump (a rank killed before it wrote one) and
# fails on gloo's dumps (KeyError: their pg_config lists no groups, which it looks every entry up in); so the verdict
# below (who did not join what) is computed here, on the documented fields.
DUMP_NAME = re.compile(r"^(.*?)(\d+)$")


@dataclass
class Unjoined:
    """A collective of one process group that some of its ranks entered and others did not (yet)."""

    group: str  # the process group's name in the dumps
    group_desc: str  # what made it ("default_pg", "mesh_tensor", ...)
    group_ranks: list[int]  # its global ranks
    seq: int  # the collective's sequence number in the group (collective_seq_id)
    op: str  # as torch names it: "nccl:all_reduce", "gloo:broadcast", ...
    input_sizes: list
    output_sizes: list
    joined: list[int]  # ranks whose dump shows they entered it
    missing: list[int]  # ranks whose dump shows they did not
    no_dump: list[int]  # ranks of the group without a dump
    time_created_ns: int = 0

    def __str__(self) -> str:
        what = (f"{self.op} (input sizes {self.input_sizes}, output sizes {self.output_sizes})" if self.op
                else "its entry has left the ring buffer")
        text = (f"rank(s) {_ranks(self.missing)} did not join collective #{self.seq} of process group {self.group} "
                f"({self.group_desc}, ranks {_ranks(self.group_ranks)}): {what}, which rank(s) {_ranks(self.joined)} "
                f"entered")
        return text + (f"; no dump from rank(s) {_ranks(self.no_dump)}" if self.no_dump else "")


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def find_dumps(path) -> tuple[Path, dict[int, Path]]:
    """The newest set of flight-recorder dumps under ``path`` (a run's output_dir, its ``flight_recorder``
    directory, or any directory of ``<prefix><rank>`` files): its directory and rank -> file. A restarted job's
    dumps are in ``attempt_N`` subdirectories; the last attempt that wrote any is taken."""
    path = Path(path)
    if (path / "flight_recorder").is_dir():
        path = path / "flight_recorder"
    if not path.is_dir():
        raise DufuError(f"{path} is not a directory; pass a run's output_dir or the directory of its "
                        "flight-recorder dumps (OUTPUT_DIR/flight_recorder).")
    attempts = sorted((d for d in path.glob("attempt_*") if d.is_dir() and d.name[8:].isdigit()),
                      key=lambda d: int(d.name[8:]))
    for directory in [*reversed(attempts), path]:
        files = _dump_files(directory)
        if files:
            return directory, files
    raise DufuError(f"no flight-recorder dumps in {path}: NCCL writes them when a collective times out "
                    "(TORCH_NCCL_DUMP_ON_TIMEOUT=1, which dufu sets for NCCL runs); gloo runs write none.")


def _dump_files(directory: Path) -> dict[int, Path]:
    by_prefix: dict[str, dict[int, Path]] = {}
    for f in directory.iterdir():
        m = DUMP_NAME.match(f.name)
        if f.is_file() and m:
            by_prefix.setdefault(m.group(1), {})[int(m.group(2))] = f
    if len(by_prefix) > 1:  # dufu's own name first, then the most files
        prefix = "rank_" if "rank_" in by_prefix else max(by_prefix, key=lambda p: len(by_prefix[p]))
        return by_prefix[prefix]
    return next(iter(by_prefix.values()), {})


def read_dump(file) -> dict:
    """One rank's dump: the documented pickle (``entries``, ``pg_config``, ``pg_status``, ``version``). Read here,
    not by torch's loader (torch.distributed.flight_recorder.components.loader.read_dump), which drops
    ``pg_status``: the last collective each group enqueued, also when its entry has left the ring buffer."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            raw = pickle.load(f)
        return {"entries": raw["entries"], "pg_config": raw["pg_config"], "pg_status": raw.get("pg_status") or {},
                "version": raw.get("version", "")}
    except (OSError, EOFError, KeyError, TypeError, pickle.UnpicklingError) as e:
        raise DufuError(f"{file} is not a readable flight-recorder dump ({type(e).__name__}: {e}); it may have "
                        "been cut short when its rank was killed. Move it aside and read the others.") from e


def unjoined_collectives(dumps: dict[int, dict]) -> list[Unjoined]:
    """The collectives that some ranks of a group entered and others did not, from every rank's dump, the earliest
    first (the first one is usually the cause: the others wait behind it). In each group, a rank's last entered
    collective is its ``pg_status`` ``last_enqueued_collective`` (or its newest entry); the first sequence number
    a member has not reached is the collective it did not join."""
    found = []
    for (name, ranks), desc in _groups(dumps).items():
        last = {r: _last_enqueued(dumps[r], name) for r in ranks if r in dumps}
        if not last or min(last.values()) == max(last.values()):
            continue
        seq = min(last.values()) + 1
        entry = next((e for r in ranks if r in dumps for e in dumps[r]["entries"]
                      if _group_name(e) == name and not e.get("is_p2p") and e.get("collective_seq_id") == seq), {})
        found.append(Unjoined(
            group=name, group_desc=desc, group_ranks=list(ranks), seq=seq, op=entry.get("profiling_name", ""),
            input_sizes=entry.get("input_sizes", []), output_sizes=entry.get("output_sizes", []),
            joined=[r for r, n in last.items() if n >= seq], missing=[r for r, n in last.items() if n < seq],
            no_dump=[r for r in ranks if r not in dumps], time_created_ns=entry.get("time_created_ns") or 0))
    return sorted(found, key=lambda u: (u.time_created_ns or float("inf"), u.group))


def _groups(dumps: dict[int, dict]) -> dict[tuple[str, tuple[int, ...]], str]:
    """(name, global ranks) -> description of every process group in the dumps. NCCL lists its groups in
    ``pg_config``; gloo's dumps list none there, so a group is also known by the ``pg_status`` and entries of the
    ranks that used it, which are then taken as its ranks."""
    groups = {}
    for dump in dumps.values():
        for name, cfg in dump["pg_config"].items():
            if str(name) and _group_ranks(cfg):
                groups.setdefault((str(name), _group_ranks(cfg)), cfg.get("desc", ""))
    listed = {name for name, _ in groups}
    used: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        for name in {*map(str, dump["pg_status"]), *(_group_name(e) for e in dump["entries"])} - listed:
            used.setdefault(name, set()).add(rank)
    descs = {_group_name(e): e["process_group"][1] for d in dumps.values() for e in d["entries"]}
    groups.update({(name, tuple(sorted(ranks))): descs.get(name, "") for name, ranks in used.items()})
    return groups


def _group_name(entry: dict) -> str:
    return str(entry["process_group"][0])


def _group_ranks(cfg: dict) -> tuple[int, ...]:
    ranks = cfg["ranks"]  # a string in the dumps: "[0, 1]"
    return tuple(ast.literal_eval(ranks) if isinstance(ranks, str) else ranks)


def _last_enqueued(dump: dict, group: str) -> int:
    status = {str(k): v for k, v in dump["pg_status"].items()}.get(group) or {}
    if "last_enqueued_collective" in status:
        return int(status["last_enqueued_collective"])
    seqs = [e.get("collective_seq_id", 0) for e in dump["entries"] if _group_name(e) == group and not e.get("is_p2p")]
    return max(seqs, default=0)


def explain_flight_recorder(path) -> str:
    """What a run's flight-recorder dumps say, one finding a line: which rank did not join which collective (sequence
    number, op, sizes, process group), which ranks wrote no dump, and, when every rank entered the same collectives,
    which did not complete."""
    directory, files = find_dumps(path)
    dumps = {rank: read_dump(f) for rank, f in sorted(files.items())}
    lines = [f"flight-recorder dumps of rank(s) {_ranks(dumps)} in {directory}:"]
    unjoined = unjoined_collectives(dumps)
    lines += [f"  {u}" for u in unjoined]
    members = {r for d in dumps.values() for cfg in d["pg_config"].values() for r in _group_ranks(cfg)}
    if members - set(dumps):
        lines.append(f"  no dump from rank(s) {_ranks(members - set(dumps))}: killed before writing one, or written "
                     "elsewhere (their TORCH_FR_DUMP_TEMP_FILE)")
    if not unjoined:
        lines.append("  every rank with a dump entered the same collectives in every process group")
        for rank, dump in dumps.items():
            pending = [e for e in dump["entries"] if e.get("state") not in ("completed", None) and not e.get("retired")]
            if pending:
                e = pending[0]
                lines.append(f"  rank {rank}: {e.get('profiling_name')} (#{e.get('collective_seq_id')} of process "
                             f"group {_group_name(e)}, {e['process_group'][1]}) did not complete: {e.get('state')}")
    return "\n".join(lines)


def flight_recorder_note(world_size: int) -> str:
    """For a failure message: where NCCL's flight recorder writes this run's dumps, and what they say when every
    rank's dump is already there; empty when no dump path is set (gloo runs)."""
    prefix = env.flight_recorder_prefix()
    if not prefix:
        return ""
    directory = Path(prefix).parent
    try:
        _, files = find_dumps(directory)
        if len(files) >= world_size:
            header, *findings = explain_flight_recorder(directory).splitlines()
            return f"{header[0].upper()}{header[1:]} {'; '.join(f.strip() for f in findings)}. "
    except DufuError:
        pass
    return (f"NCCL's flight recorder writes each rank's last collectives to {directory} on a timeout: "
            f"`dufu diagnose {directory}` then names the rank that did not join and the collective. ")
