"""Training through failures without a restart: fault-tolerant replica groups on torchft (``train.fault_tolerance``).

A job (one ``dufu train``, one torchrun) is one *replica group*; ``replica_parallel_size`` groups train one model
together, coordinated by a Lighthouse (``dufu lighthouse``). Inside a group everything is as without fault
tolerance (plain data parallelism, ZeRO/FSDP, tensor parallelism). Across groups, torchft's Manager forms a
quorum of the live groups, and rank r of every group joins one reconfigurable process group with rank r of the
others (torchft's HSDP idea). Modes (``mode``):

* ``"replicate"``: every step, the gradients (each rank's local shards) are averaged over the live groups, and
  the optimizer steps only when ``Manager.should_commit()`` says every group finished the step; a step that a
  dying group broke is taken again, with the same samples, by the groups that are left.
* ``"diloco"``: ``sync_every`` local steps, then the pseudo-gradients (weights at the last synchronisation minus
  the local weights) are averaged and an outer Nesterov SGD step is taken (Douillard et al. 2023,
  arXiv:2311.08105; torchft.local_sgd.DiLoCo). ``"local_sgd"``: the weights are averaged every ``sync_every``
  steps (Lin et al. 2018, arXiv:1805.09767; torchft.local_sgd.LocalSGD).

A group that (re)joins while the others are further along heals: the Manager fetches a live peer's state through
torchft's checkpoint transport (HTTP): the weights, the optimizer state (DiLoCo: also the outer optimizer and the
weights of the last synchronisation), and the trainer's step and position in the sample order.

Data: the sampler's data-parallel axis spans all groups (rank ``replica_group_id * dp + dp_rank`` of
``replica_parallel_size * dp``, the global batch ``replica_parallel_size`` times the group's), so each group reads
its own part of every global batch. docs/faults.md says what loss continuity holds when groups come and go.

Records: rank 0 of each group appends one line per step to ``OUTPUT_DIR/fault_tolerance.jsonl``: the step, the
groups in the quorum, whether the step was committed or retried, a heal, and the bytes this rank handed to
cross-group all-reduces (counted at the Manager's all-reduce, whatever calls it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from dufu.engine.resilience.fault_tolerance_state import TrainingState
from dufu.engine.hooks import Hook, RetryStep
from dufu.errors import ConfigError, DistributedFailure

MODES = ("replicate", "diloco", "local_sgd")
RECORDS = "fault_tolerance.jsonl"
DEFAULT_PORT = 29510  # dufu lighthouse's default port


class NotCommitted(RetryStep):
    """A step some group did not finish (it died, or a collective failed): no group applies it."""


def settings(cfg):
    """``train.fault_tolerance`` when it is enabled, else None."""
    ft = cfg.train.fault_tolerance
    return ft if ft.enabled else None


def lighthouse_address(lighthouse: str | None) -> str:
    """``train.fault_tolerance.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``, as a URL."""
    address = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ConfigError(
            "train.fault_tolerance.enabled=True needs the Lighthouse's address: set "
            f"train.fault_tolerance.lighthouse=http://HOST:PORT (start one with `dufu lighthouse --bind [::]:"
            f"{DEFAULT_PORT}`), or the TORCHFT_LIGHTHOUSE environment variable.")
    return address if "://" in address else f"http://{address}"


def check_config(cfg, dims) -> None:
    """Start-up checks of ``train.fault_tolerance`` (run by :func:`dufu.engine.preflight.plan_run`, so the launcher
    refuses a bad config before any worker starts): the combinations dufu supports, and a Lighthouse that answers."""
    ft = settings(cfg)
    if ft is None:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError('train.fault_tolerance.enabled=True needs torchft, which is not installed: '
                          'pip install "dufu[ft]" torch==2.13.0')
    t = cfg.train
    mode, size, gid = ft.mode, ft.replica_parallel_size, ft.replica_group_id
    if mode not in MODES:
        raise ConfigError(f"train.fault_tolerance.mode={mode!r}: use one of {', '.join(map(repr, MODES))}.")
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"train.fault_tolerance.replica_parallel_size={size!r}: the number of replica groups "
                          "(jobs) that train together, an integer of 1 or more.")
    if not isinstance(gid, int) or not 0 <= gid < size:
        raise ConfigError(f"train.fault_tolerance.replica_group_id={gid!r} is outside [0, {size}) for "
                          f"replica_parallel_size={size}: give each group (job) its own id 0 .. {size - 1}.")
    min_size = ft.min_replica_size
    if not isinstance(min_size, int) or not 1 <= min_size <= size:
        raise ConfigError(f"train.fault_tolerance.min_replica_size={min_size!r}: the fewest live groups that may "
                          f"still take a step, between 1 and replica_parallel_size={size} (1: train on while "
                          "any group lives).")
    if dims.pp_enabled:
        raise ConfigError(
            f"train.fault_tolerance with pipeline parallelism (pipeline_parallel_size={dims.pipeline_parallel_size})"
            " is not supported: the cross-group averaging and healing act on one model part and one optimizer per "
            "rank. Set train.dist.pipeline_parallel_size=1 (data, tensor or ZeRO parallelism inside a group), or "
            "train.fault_tolerance.enabled=False.")
    if mode != "replicate":
        every = ft.sync_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"train.fault_tolerance.sync_every={every!r}: the number of local steps between two "
                              f"synchronisations of mode {mode!r}, an integer of 1 or more (e.g. 100).")
        # A skipped optimizer step would shift this group's synchronisations against the others' (a deadlock).
        if t.nan_policy == "skip" or str(t.amp.enabled).lower() == "fp16" or (
                t.amp.enabled is True and t.amp.dtype == "fp16"):
            raise ConfigError(
                f"train.fault_tolerance.mode={mode!r} counts optimizer steps to meet the other groups, and "
                "nan_policy='skip' or fp16 loss scaling skip steps on one group only. Use train.nan_policy='stop' "
                "and bf16 or fp32 (train.amp.dtype='bf16'), or mode='replicate'.")
    if mode == "diloco":
        outer = ft.outer_optimizer
        if not outer.lr > 0 or not 0 <= outer.momentum < 1:
            raise ConfigError(f"train.fault_tolerance.outer_optimizer={dict(outer)!r}: DiLoCo's outer Nesterov SGD "
                              "needs lr > 0 and 0 <= momentum < 1 (the paper's: lr=0.7, momentum=0.9).")
    check_lighthouse(lighthouse_address(ft.lighthouse), float(ft.connect_timeout_seconds))


def check_lighthouse(address: str, timeout: float) -> None:
    """Fail fast, naming the address, when nothing listens there (a Manager would retry until its timeout)."""
    url = urlparse(address)
    host, port = url.hostname, url.port
    if host is None or port is None:
        raise ConfigError(f"train.fault_tolerance.lighthouse={address!r} is not an address: use http://HOST:PORT, "
                          f"e.g. http://localhost:{DEFAULT_PORT}.")
    try:
        with socket.create_connection((host, port), timeout=min(timeout, 5.0)):
            pass
    except OSError as e:
        raise ConfigError(
            f"no Lighthouse answers at {host}:{port} (train.fault_tolerance.lighthouse={address!r}): {e}. Start "
            f"it first, on that host: `dufu lighthouse --bind [::]:{port} --min-replicas 1`, or point "
            "train.fault_tolerance.lighthouse at the one that runs.") from None


def replica_groups(trainer):
    """This job's :class:`ReplicaGroups` hook when ``train.fault_tolerance`` is enabled, else None."""
    ft = settings(trainer.cfg)
    if ft is None:
        return None
    return ReplicaGroups(trainer, **{k: v for k, v in ft.items() if k != "enabled"})


class ReplicaGroups(Hook):
    """This job's side of the replica groups (see the module docstring), a hook of the training loop: the quorum
    at step start (a healed group continues from its peer's step and sample position), in mode ``replicate`` the
    gradients averaged over the live groups after the backward and a step some group did not finish taken again
    (:class:`~dufu.engine.hooks.RetryStep`), a record after every step. Keyword arguments: ``train.fault_tolerance``
    (the sampler's share of the groups' global batch is the runtime's: ``Runtime.data_rank``)."""

    def __init__(self, trainer, lighthouse=None, replica_group_id=0, replica_parallel_size=1, min_replica_size=1,
                 mode="replicate", sync_every=100, outer_optimizer=None, timeout_seconds=60.0,
                 quorum_timeout_seconds=300.0, connect_timeout_seconds=10.0):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and commit at info level
        import torchft  # optional (dufu[ft]): only for fault-tolerant runs

        # torchft says at every new quorum that it cannot reset NCCL's flight recorder (there is none on CPUs)
        logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        # a received checkpoint's tensors are read from a read-only buffer, and never written in place
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.trainer, self.mode, self.sync_every = trainer, mode, int(sync_every)
        self.group_id, self.num_groups = int(replica_group_id), int(replica_parallel_size)
        self.outer = dict(outer_optimizer or {"lr": 0.7, "momentum": 0.9, "nesterov": True})
        self.bytes_sent, self.healed_at, self.algorithm = 0, None, None
        self.records = Path(trainer.output_dir) / RECORDS if trainer.is_main else None
        self.retries = 0
        store_host, store_port = self._group_store()
        timeout = timedelta(seconds=float(timeout_seconds))
        # torchft's process group across groups: NCCL in a child process on GPUs, gloo on CPUs.
        pg = (torchft.ProcessGroupBabyNCCL(timeout=timeout) if trainer.device.type == "cuda"
              else torchft.ProcessGroupGloo(timeout=timeout))
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=int(min_replica_size),
            # DiLoCo needs the quorum before the step (torchft refuses an asynchronous one); a healed group must
            # hold its peer's weights before its forward.
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=float(quorum_timeout_seconds)),
            connect_timeout=timedelta(seconds=float(connect_timeout_seconds)),
            rank=trainer.rank, world_size=trainer.world_size, store_addr=store_host, store_port=store_port,
            lighthouse_addr=lighthouse_address(lighthouse),
            # the trailing digits are the group's number in torchft's rank arithmetic
            replica_id=f"dufu_replica_group_{self.group_id}",
            # Every group initialises the same weights from train.seed: nothing to copy at step 0.
            init_sync=False)
        self.state = TrainingState(trainer, self)
        self.manager.register_state_dict_fn("dufu", self.state.load, self.state.save)
        self._count_bytes()
        trainer.runtime.notices.append(self.describe())

    # ------------------------------------------------------------ wiring
    def _group_store(self) -> tuple[str, int]:
        """A TCPStore of this group for its Manager, new in every attempt (a restarted torchrun's store still holds
        the dead attempt's Manager address): hosted by the group's rank 0, its address shared over gloo."""
        trainer, where = self.trainer, [None]
        if trainer.rank == 0:
            self.store = TCPStore(host_name="0.0.0.0", port=0, is_master=True, wait_for_workers=False)
            # the name other groups reach it by, as torchft's Manager advertises its own address
            where = [(socket.gethostname(), self.store.port)]
        if trainer.world_size > 1:
            dist.broadcast_object_list(where, src=0, group=trainer.runtime.health_group)
        return where[0]

    def _count_bytes(self) -> None:
        """Count every tensor handed to the Manager's all-reduce (the gradients here, DiLoCo's pseudo-gradients and
        LocalSGD's weights inside torchft): the payload this rank sends per all-reduce."""
        allreduce = self.manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.bytes_sent += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted

    def _start_algorithm(self) -> None:
        """DiLoCo / LocalSGD hook into the inner optimizer; built at the first step, after a resume loaded the
        weights DiLoCo keeps as those of the last synchronisation."""
        from torchft.local_sgd import DiLoCo, LocalSGD  # optional (dufu[ft])

        t = self.trainer
        if self.mode == "diloco":
            outer = torch.optim.SGD(t.model.parameters(), lr=self.outer["lr"], momentum=self.outer["momentum"],
                                    nesterov=self.outer["nesterov"])
            self.algorithm = DiLoCo(self.manager, [t.model], t.optimizers[0], outer, sync_every=self.sync_every,
                                    backup_device=torch.device("cpu"), pin_memory=t.device.type == "cuda")
        else:
            self.algorithm = LocalSGD(self.manager, t.model, t.optimizers[0], sync_every=self.sync_every)
        self.algorithm.__enter__()

    # ------------------------------------------------------------ the step (hook points)
    def on_step_start(self, trainer) -> None:
        if self.manager.current_step() == 0 and trainer.step > 0:  # resumed: the Manager's count continues ours
            syncs = trainer.step if self.mode == "replicate" else trainer.step // self.sync_every
            self.manager.load_state_dict({"step": syncs, "batches_committed": 0})
        if self.mode != "replicate":
            if self.algorithm is None:
                self._start_algorithm()
            return
        # A group that heals here takes its peer's step and sample position before the loop draws the batch.
        self._start_quorum()

    def after_backward(self, trainer, local_loss):
        """This group's gradients (reduced inside the group), then averaged over the live groups: one flat buffer
        per dtype, one all-reduce each; then every group agrees whether the step counts."""
        if self.mode != "replicate":
            return None
        grads = [p.grad for part in trainer.model_parts for p in part.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        for dtype in sorted({g.dtype for g in local}, key=str):
            same = [g for g in local if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])  # (sum of numels,)
            self.manager.allreduce(flat).wait()
            for g, avg in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(avg.view_as(g))
        if not self.manager.should_commit():
            raise NotCommitted(f"replica group {self.group_id}: step {trainer.step + 1} was not committed by every "
                               "live group; taking it again")
        return None

    def on_step_retry(self, trainer, error) -> None:
        self.retries += 1
        self._record(committed=False)

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        self._record(committed=True, retries=self.retries)
        self.retries = 0

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as e:  # a Lighthouse gone, or a quorum that never formed
            raise DistributedFailure(
                f"replica group {self.group_id}, rank {self.trainer.rank}: no quorum of replica groups at step "
                f"{self.trainer.step + 1} ({type(e).__name__}: {e}). Is the Lighthouse still running, and are at least "
                "min_replica_size groups alive?") from None

    def _record(self, committed: bool, retries: int = 0) -> None:
        """One line of fault_tolerance.jsonl (rank 0 of the group)."""
        step = self.trainer.step + (1 if committed else 0)
        record = {"step": step, "replica_group": self.group_id, "participants": self.manager.num_participants(),
                  "committed": committed, "bytes_allreduced": self.bytes_sent, "time": time.time()}
        if retries:
            record["retries"] = retries
        if self.healed_at is not None:
            record["healed_from_step"] = self.healed_at
            self.healed_at = None
        self.bytes_sent = 0
        if self.records is not None:
            self.records.parent.mkdir(parents=True, exist_ok=True)
            with self.records.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def describe(self) -> str:
        what = {"replicate": "gradients averaged over the live groups every step",
                "diloco": f"DiLoCo: outer Nesterov SGD (lr {self.outer['lr']}, momentum {self.outer['momentum']}) "
                          f"every {self.sync_every} steps",
                "local_sgd": f"LocalSGD: weights averaged every {self.sync_every} steps"}[self.mode]
        dp = self.trainer.dims.data_parallel_size
        parts = f"part {self.group_id * dp + 1}" if dp == 1 else f"parts {self.group_id * dp + 1}-{self.group_id * dp + dp}"
        return (f"fault tolerance: replica group {self.group_id} of {self.num_groups} (torchft; {what}); the group "
                f"reads {parts} of {self.num_groups * dp} of every global batch of "
                f"{self.trainer.sampler.global_batch_size} samples")
