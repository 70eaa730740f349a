"""Slurm's job-step environment read into a dufu launch: for a ``dufu train`` that ``srun`` started, which host and
port the rendezvous is on, how many nodes and processes per node the run has, and whether this task is its node's
launcher (torchrun's agent) or one process of the run.

Slurm sets ``SLURM_*`` variables in every task of a step (``srun``): the step's hosts (``SLURM_STEP_NODELIST``, a
compressed host list such as ``node[01-03,7]``), its tasks and nodes, and this task's global, node and local ids.
From them dufu derives what ``torchrun`` would otherwise be told by hand:

* **the rendezvous**: the first host of the step's node list (Slurm's block distribution puts task 0 there),
  on port ``20000 + job id % 20000`` (:func:`rendezvous_port`), so every task of a job finds the same one without
  talking to the others and two jobs sharing a node rarely collide; ``MASTER_ADDR`` / ``MASTER_PORT`` in the
  environment (as Megatron-LM's and torchtitan's job scripts export them) win over the derived values, and
  ``dufu train --master-addr/--master-port`` over both;
* **the mode**, from the step's tasks and nodes (:func:`plan_launch`): one task per node (``srun
  --ntasks-per-node=1``) runs dufu's launcher, which starts ``--nproc`` workers through torchrun (default: the
  node's GPUs, ``SLURM_GPUS_ON_NODE``) with ``--nnodes``, ``--node-rank``, ``--master-addr`` and
  ``--master-port`` filled in; one task per process (``srun --ntasks-per-node=G``) is itself a worker: it gets
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from
  ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the node list, and runs without torchrun (on GPUs its
  device is ``cuda:LOCAL_RANK``, modulo the GPUs it sees when Slurm binds one GPU per task).

The host list is expanded here (:func:`expand_hostlist`) rather than by ``scontrol show hostnames``: every task of a
job reads it at start-up, which must not depend on Slurm's client tools being on the compute nodes' PATH nor start
a process per task; the tests compare the two on a real Slurm.

Only a step's task is read as Slurm's: the batch script's own shell (``sbatch``) and an ``salloc`` shell have
``SLURM_JOB_ID`` but no ``SLURM_STEP_ID``, and a ``dufu train`` started there runs as it would anywhere.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from dufu.errors import DufuError

PORT_BASE = 20000  # derived ports: 20000-39999, below Linux's ephemeral range (32768- by default: see rendezvous_port)
PORT_SPAN = 20000


class SlurmError(DufuError):
    """Slurm's environment does not describe a step dufu can run in (what is wrong and how to ask srun instead)."""


@dataclass(frozen=True)
class SlurmStep:
    """What Slurm says about this task's job step (``srun``)."""

    job_id: int
    step_id: str
    hosts: tuple[str, ...]  # the step's nodes, in Slurm's order (node 0 first)
    ntasks: int
    procid: int  # this task's rank among the step's tasks (SLURM_PROCID)
    nodeid: int  # this task's node among the step's nodes (SLURM_NODEID)
    localid: int  # this task's rank on its node (SLURM_LOCALID)
    tasks_per_node: tuple[int, ...]  # per node, in node order
    gpus_on_node: int
    restart_count: int  # times the batch job was requeued (SLURM_RESTART_COUNT)
    distribution: str  # SLURM_DISTRIBUTION: how tasks were laid out over nodes (block, cyclic, ...)

    @property
    def nnodes(self) -> int:
        return len(self.hosts)


@dataclass(frozen=True)
class SlurmLaunch:
    """How this task runs: ``mode`` "node" (this task is its node's launcher: torchrun's agent with ``nproc``
    workers, when ``nproc * nnodes > 1``; else a single process) or "process" (this task is worker ``rank``)."""

    step: SlurmStep
    mode: str
    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    rank: int
    local_rank: int
    sources: tuple[str, ...]  # where each value came from, when not from Slurm (for the start-up line)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def worker_env(self) -> dict[str, str]:
        """The variables torch's ``env://`` rendezvous and dufu read in a worker (what torchrun would set), for a
        task of the per-process mode."""
        if self.mode != "process":
            raise ValueError("worker_env() is for a task that is one process of the run (mode 'process')")
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def describe(self) -> str:
        """The start-up line: the step as Slurm gave it and what dufu made of it."""
        s = self.step
        nodes = f"{s.nnodes} node{'s' if s.nnodes > 1 else ''} ({compress_hosts(s.hosts)})"
        head = f"Slurm job {s.job_id} step {s.step_id}: {s.ntasks} task{'s' if s.ntasks > 1 else ''} on {nodes}"
        if s.restart_count:
            head += f", requeued {s.restart_count} time{'s' if s.restart_count > 1 else ''}"
        rdzv = f"rendezvous {self.master_addr}:{self.master_port}"
        if self.mode == "process":
            what = (f"one process per task (RANK=SLURM_PROCID, LOCAL_RANK=SLURM_LOCALID, no torchrun), "
                    f"world size {self.world_size}")
        elif self.world_size > 1:
            what = (f"one launcher per node: torchrun with --nnodes {self.nnodes} --node-rank {self.node_rank} "
                    f"--nproc {self.nproc_per_node}")
        else:
            what = "one process"
            rdzv = ""
        notes = [rdzv] if rdzv else []
        notes += list(self.sources)
        if self.mode == "process" and s.nnodes > 1 and not s.distribution.startswith(("block", "plane")) \
                and s.distribution:
            notes.append(f"SLURM_DISTRIBUTION={s.distribution} puts consecutive ranks on different nodes: tensor-"
                         "parallel peers then talk across nodes; srun --distribution=block keeps them together")
        return f"{head} -> {what}" + (f"; {'; '.join(notes)}" if notes else "")


# ------------------------------------------------------------------------------------------ Slurm's formats


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``node[01-03,7],gpu-a[1-2]-b[1-2]`` ->
    node01 node02 node03 node7 gpu-a1-b1 gpu-a1-b2 gpu-a2-b1 gpu-a2-b2 (a range keeps its zero padding; several
    bracket groups in one name expand as a product, the last fastest, as ``scontrol show hostnames`` does)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        parts = re.split(r"(\[[^\]]*\])", item)
        names = [""]
        for part in parts:
            if part.startswith("["):
                names = [n + x for n in names for x in _expand_ranges(part[1:-1], text)]
            elif part:
                names = [n + part for n in names]
        hosts += names
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``a[1,2],b`` -> ``a[1,2]``, ``b``: the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"host list {text!r}: '[' without ']'")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_ranges(inner: str, text: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7."""
    out = []
    for piece in inner.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not m:
            raise SlurmError(f"host list {text!r}: cannot read the range {piece!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmError(f"host list {text!r}: the range {piece!r} runs backwards")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def compress_hosts(hosts) -> str:
    """A short form of a host list for messages: ``vm``, ``node01,node02``, or ``node01 ... node16 (16 hosts)``."""
    hosts = list(hosts)
    return ",".join(hosts) if len(hosts) <= 4 else f"{hosts[0]} ... {hosts[-1]} ({len(hosts)} hosts)"


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks-per-node list: ``2(x3),1`` -> 2 2 2 1."""
    out = []
    for piece in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if not m:
            raise SlurmError(f"tasks per node {text!r}: cannot read {piece!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def rendezvous_port(job_id: int, environ: Optional[Mapping[str, str]] = None) -> int:
    """``MASTER_PORT`` when set, else ``20000 + job_id % 20000``: the same on every task of the job with nothing
    exchanged. Ports 20000-32767 are below Linux's default ephemeral range (32768-60999), where no outgoing
    connection takes them; 32768-39999 may be taken by one, which then fails the rendezvous with "address already
    in use": set ``MASTER_PORT`` in the job script then."""
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_PORT"):
        return _int(environ, "MASTER_PORT")
    return PORT_BASE + job_id % PORT_SPAN


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = environ.get(name)
    if value in (None, ""):
        if default is None:
            raise SlurmError(f"{name} is not set in this Slurm step; dufu reads it to place this task. Start the "
                             "task with srun (which sets it), or unset SLURM_STEP_ID to run outside Slurm.")
        return default
    # SLURM_GPUS_ON_NODE may hold a count; some Slurm versions give "N(IDX:...)": the leading number is the count
    m = re.match(r"\d+", str(value).strip())
    if not m:
        raise SlurmError(f"{name}={value!r} is not a number")
    return int(m.group(0))


# ------------------------------------------------------------------------------------------ reading a step


def read_step(environ: Optional[Mapping[str, str]] = None) -> Optional[SlurmStep]:
    """This task's Slurm step, or None outside one (no ``SLURM_STEP_ID``: not Slurm, or a batch/salloc shell).
    The step's own variables (``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_TASKS``, ...) are preferred to the job's
    (``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``, ``SLURM_NTASKS``, ...): a step may use part of its job."""
    environ = os.environ if environ is None else environ
    if not environ.get("SLURM_JOB_ID") or environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID")) is None:
        return None
    first = lambda *names: next((environ[n] for n in names if environ.get(n)), None)  # noqa: E731
    nodelist = first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("this Slurm step has no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST and "
                         "SLURM_NODELIST are all unset); dufu takes the rendezvous host from it.")
    hosts = tuple(expand_hostlist(nodelist))
    ntasks = int(first("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1)
    nnodes = int(first("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or len(hosts))
    if nnodes != len(hosts):
        raise SlurmError(f"Slurm says the step has {nnodes} nodes but its node list {nodelist!r} names "
                         f"{len(hosts)}: {compress_hosts(hosts)}")
    per_node_text = first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node_text:
        tasks_per_node = tuple(expand_tasks_per_node(per_node_text))
    elif environ.get("SLURM_NTASKS_PER_NODE"):
        tasks_per_node = (_int(environ, "SLURM_NTASKS_PER_NODE"),) * nnodes
    else:
        tasks_per_node = (ntasks // nnodes,) * nnodes
    return SlurmStep(
        job_id=_int(environ, "SLURM_JOB_ID"), step_id=str(environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))),
        hosts=hosts, ntasks=ntasks, procid=_int(environ, "SLURM_PROCID"), nodeid=_int(environ, "SLURM_NODEID", 0),
        localid=_int(environ, "SLURM_LOCALID", 0), tasks_per_node=tasks_per_node,
        gpus_on_node=_int(environ, "SLURM_GPUS_ON_NODE", 0), restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
        distribution=environ.get("SLURM_DISTRIBUTION", ""))


def plan_launch(step: SlurmStep, nproc: Optional[int] = None, nnodes: Optional[str] = None,
                node_rank: Optional[int] = None, master_addr: Optional[str] = None, master_port: Optional[int] = None,
                environ: Optional[Mapping[str, str]] = None) -> SlurmLaunch:
    """How this task runs in ``step``. Options given to ``dufu train`` (``nproc``, ``nnodes``, ``node_rank``,
    ``master_addr``, ``master_port``) win over what Slurm says, ``MASTER_ADDR`` / ``MASTER_PORT`` in the
    environment over the derived rendezvous.

    Tasks == nodes: each task is its node's launcher, with ``nproc`` workers (default: the node's GPUs, at least
    one). Tasks == nodes x k with the same k on every node: each task is one process (k per node); ``nproc`` is
    then refused, since each task would start ``nproc`` processes more."""
    environ = os.environ if environ is None else environ
    sources = []
    if master_addr is not None:
        sources.append("--master-addr given: used instead of the node list's first host")
    elif environ.get("MASTER_ADDR"):
        master_addr = environ["MASTER_ADDR"]
        sources.append("MASTER_ADDR from the environment")
    else:
        master_addr = step.hosts[0]
    if master_port is not None:
        sources.append("--master-port given")
    else:
        if environ.get("MASTER_PORT"):
            sources.append("MASTER_PORT from the environment")
        master_port = rendezvous_port(step.job_id, environ)
    layout = f"{step.ntasks} tasks on {step.nnodes} node{'s' if step.nnodes > 1 else ''}"
    if step.ntasks == step.nnodes:  # one task per node: its launcher
        if nnodes is not None:
            sources.append(f"--nnodes {nnodes} given (Slurm's step has {step.nnodes})")
        if node_rank is not None:
            sources.append(f"--node-rank {node_rank} given (Slurm's node id is {step.nodeid})")
        if nproc is not None:
            sources.append(f"--nproc {nproc} given")
        nodes = int(str(nnodes).split(":")[-1]) if nnodes is not None else step.nnodes
        per_node = nproc if nproc is not None else max(step.gpus_on_node, 1)
        return SlurmLaunch(step, "node", nodes, per_node, step.nodeid if node_rank is None else node_rank,
                           master_addr, int(master_port), rank=0, local_rank=0, sources=tuple(sources))
    if len(set(step.tasks_per_node)) != 1 or step.ntasks != sum(step.tasks_per_node):
        raise SlurmError(
            f"Slurm started {layout} ({', '.join(map(str, step.tasks_per_node))} per node): dufu runs one task "
            "per node (its launcher) or the same number of tasks, one per process, on every node. Ask srun for "
            "--ntasks-per-node=1 or --ntasks-per-node=G with --nodes=N.")
    if nproc is not None or nnodes is not None or node_rank is not None:
        given = " ".join(f"--{k} {v}" for k, v in (("nproc", nproc), ("nnodes", nnodes), ("node-rank", node_rank))
                         if v is not None)
        raise SlurmError(
            f"{given} with {layout}: each task is one process of the run here, and {given} would make each "
            f"start a launcher of its own. Either drop {given} (each of the {step.ntasks} tasks is then one "
            f"process), or give srun one task per node (--ntasks-per-node=1) for dufu's launcher to start "
            "the processes.")
    return SlurmLaunch(step, "process", step.nnodes, step.tasks_per_node[0], step.nodeid, master_addr,
                       int(master_port), rank=step.procid, local_rank=step.localid, sources=tuple(sources))
