"""Checkpoints: sharded with ``torch.distributed.checkpoint`` (DCP), committed atomically.

Layout of one checkpoint::

    <output_dir>/checkpoints/step_0000100/
        .metadata, __*_*.distcp   model + optimizer, every rank writes only its own shards (DCP)
        rank_00000.pt ...         per-rank trainer state: step, LR scheduler, data sampler, RNG states
        manifest.json             written last: file names, sizes and SHA-256 checksums

A checkpoint is written under ``.step_0000100.partial`` and renamed to its final
name only after every rank has finished and the manifest is on disk, so a
checkpoint directory is either complete or absent. Loading verifies the
manifest and never unpickles arbitrary objects (``weights_only=True``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
# torch's private DCP pieces, for reading a checkpoint whose keys are not known in advance: torch has no public API
# for that (its own dcp_to_torch_save uses these two)
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # private, as above

from dufu.errors import CheckpointError

from dufu.engine.weights.checkpoint_safe import SafeFileSystemReader, SafeLoadPlanner  # noqa: F401
from dufu.engine.resilience import faults
from dufu.models.base import contract_of


_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"


# Optimizer state keyed by parameter name ("state.blocks.0.mlp.fc1.weight.exp_avg"), one entry per
# parameter: the form that merges across pipeline stages and loads into any other layout.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A delta run saves and loads only what trains (its base comes from its source at every start); strict=False
# lets the frozen parameters be absent; every key the state dict holds must be in the checkpoint (DCP).
_DELTA_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _as_list(x):  # one part or a list of pipeline-stage parts
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _state_dicts(model_parts, optimizers, options=_OPTIONS) -> tuple[dict, dict, list[tuple[set, set]]]:
    """Merged model and optimizer state dicts of all parts, and each part's own key sets."""
    model_sd, optim_sd, keys = {}, {}, []
    for part, opt in zip(model_parts, optimizers):
        msd, osd = (get_model_state_dict(part, options=options), {}) if _empty(opt) else \
            get_state_dict(part, opt, options=options)
        if options.ignore_frozen_params:  # also a frozen parameter's tied alias (torch keeps that second name)
            msd = {k: v for k, v in msd.items() if k not in _frozen_names(part)}
        model_sd.update(msd)
        optim_sd.update(osd)
        keys.append((set(msd), set(osd)))
    return model_sd, optim_sd, keys


def _empty(optimizer) -> bool:  # a part with nothing to train (see dufu.engine.optim)
    return not any(g["params"] for g in optimizer.param_groups)


def _frozen_names(part) -> set:
    return {n for n, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _remove(path: Path) -> None:
    """Delete a committed checkpoint so that no moment leaves it half there: it is first renamed out of the
    ``step_N`` names (one atomic rename), then deleted; a process stopped in between leaves a ``.deleting``
    directory that no resume takes, removed by the next save's clean-up of leftovers."""
    doomed = path.with_name(f".{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def describe_steps(steps: list[int], most: int = 8) -> str:
    """"2, 4, 6" (the last ``most`` of them, after "..." when there are more)."""
    shown = [str(s) for s in steps[-most:]]
    return ("..., " if len(steps) > most else "") + ", ".join(shown)


def other_checkpoints(path: Path) -> str:
    """The end of a damaged checkpoint's message: the other complete checkpoints beside it and how to resume one."""
    path = Path(path)
    steps = [s for s, p in Checkpointer(path.parent).complete_checkpoints() if p.name != path.name]
    if not steps:
        return (f"{path.parent} holds no other complete checkpoint: resume another run's with `dufu train ... "
                "--resume-from CHECKPOINT_DIR`, or start over.")
    return (f"Resume another checkpoint with `dufu train ... --resume-step N` (or --resume-from CHECKPOINT_DIR); "
            f"complete ones in {path.parent}: steps {describe_steps(steps)}.")


def _describe_load_failure(path: Path, e: BaseException) -> str:
    # torch's CheckpointException carries each rank's own exception: prefer dufu's own message.
    for wrapped in getattr(e, "failures", {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, CheckpointError):
            return str(inner)
    text = " ".join(str(e).split())
    # DCP re-raises a rank's error as text inside its own; recover dufu's message from it.
    found = re.search(r"(checkpoint metadata \S+ cannot be read: .*?use another checkpoint\.)", text)
    if found:
        return found.group(1)
    return (f"could not load checkpoint {path}: {text[-400:] or type(e).__name__}. The checkpoint may belong to "
            "a different model; check model.* in the config.")


class Checkpointer:
    def __init__(self, root: str | Path, max_to_keep: Optional[int] = None, rank: int = 0, async_save: bool = False,
                 async_group=None):
        self.root = Path(root)
        # Background saves run their own collectives (planning, barriers): on a dedicated group they cannot
        # interleave with the training thread's collectives on the default group.
        self.async_group = async_group
        self.max_to_keep = max_to_keep
        self.rank = rank
        self.async_save = async_save
        self.options = _OPTIONS  # _DELTA_OPTIONS for a delta run: see set_delta_only
        self._pending = None  # (future, tmp, final, extra) of an asynchronous save not yet committed

    @staticmethod
    def read_meta(path: Path) -> dict:
        """The manifest's metadata of checkpoint ``path`` (step, layout, ...), unverified; {} if unreadable."""
        manifest = Path(path) / MANIFEST
        return json.loads(manifest.read_text()) if manifest.is_file() else {}

    def set_delta_only(self) -> None:  # save and load only the trainable parameters and their state
        self.options = _DELTA_OPTIONS

    # ---------------------------------------------------------------- listing
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / MANIFEST).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Optional[Path]:
        ckpts = self.complete_checkpoints()
        return ckpts[-1][1] if ckpts else None

    # ------------------------------------------------------------------- save
    def save(self, step: int, model, optimizer, trainer_state: dict, extra_meta: Optional[dict] = None,
             config_text: Optional[str] = None) -> Path:
        """Save ``model`` / ``optimizer`` (one each, or lists of pipeline-stage parts and their optimizers).

        With ``async_save`` the shards are staged in memory and written in the background; the checkpoint
        is committed (manifest + rename) by the next ``save`` or by ``wait``. Until then it does not exist
        as far as ``--resume`` is concerned."""
        self.wait()
        final = self.root / f"step_{step:07d}"
        tmp = self.root / f".step_{step:07d}.partial"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            for leftover in self.root.glob(".step_*.deleting"):  # a deletion a stopped process left halfway
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd, _ = _state_dicts(_as_list(model), _as_list(optimizer), self.options)
        torch.save(trainer_state, tmp / f"rank_{self.rank:05d}.pt")
        if config_text is not None and self.rank == 0:
            (tmp / "config.yaml").write_text(config_text)  # the checkpoint is self-describing
        meta = {"step": step, **(extra_meta or {})}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if self.async_save:
                future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                                        process_group=self._background_group())
                self._pending = (future, tmp, final, meta)
                return final
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        self._commit(tmp, final, meta)
        return final

    def _background_group(self):
        """The group asynchronous saves coordinate on: ``async_group``, else one made here on first use.

        It must be gloo: DCP stages the shards in host memory and refuses a group without a CPU backend
        (NCCL), and the default group is busy with the training thread's collectives. Every rank saves at
        the same step, so creating the group here is collective like any other."""
        if self.async_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.async_group = dist.new_group(backend="gloo")
        return self.async_group

    def wait(self) -> Optional[Path]:
        """Finish and commit a pending asynchronous save (a no-op if there is none)."""
        if self._pending is None:
            return None
        future, tmp, final, meta = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final, meta)
        return final

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        _barrier()  # every rank's shards are on disk
        faults.in_save(meta["step"])
        if self.rank == 0:
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            manifest = {
                **meta,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
                _remove(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier()

    def _prune(self) -> None:
        if not self.max_to_keep or self.max_to_keep < 1:
            return
        ckpts = self.complete_checkpoints()
        for _, path in ckpts[: -self.max_to_keep]:
            _remove(path)

    # ------------------------------------------------------------------- load
    def verify(self, path: Path, share: tuple[int, int] = (0, 1), only: Optional[set] = None) -> dict:
        """Check a checkpoint against its manifest: every file present with its size, and the SHA-256 of the
        files in this process's ``share`` = (index, count) of them (all by default; the ranks of a job split
        the hashing, see :meth:`verify_together`), or of the files named in ``only``. Returns the manifest."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist. Check the path, or omit it to use the latest one.")
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"checkpoint {path} is incomplete: it has no {MANIFEST} (the save did not finish). "
                f"{other_checkpoints(path)} Or delete this directory."
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError as e:
            raise CheckpointError(
                f"checkpoint manifest {manifest_path} is corrupt ({e}). {other_checkpoints(path)}") from None
        for i, (name, info) in enumerate(sorted(manifest["files"].items())):
            f = path / name
            if not f.is_file():
                raise CheckpointError(
                    f"checkpoint file {f} is missing (listed in {MANIFEST}). {other_checkpoints(path)}")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"checkpoint file {f} is truncated or changed: {size} bytes, the manifest says {info['bytes']}. "
                    f"{other_checkpoints(path)}"
                )
            mine = i % share[1] == share[0] if only is None else name in only
            if mine and _sha256(f) != info["sha256"]:
                raise CheckpointError(
                    f"checkpoint file {f} is corrupt: its SHA-256 checksum does not match the manifest. "
                    f"{other_checkpoints(path)}"
                )
        return manifest

    def verify_together(self, path: Path) -> dict:
        """:meth:`verify` by all ranks of a job, each hashing its share of the files (so a large checkpoint is
        read once, not once per rank); any rank's finding is raised on every rank."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.verify(path)
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            manifest, error = self.verify(path, share=(rank, world)), ""
        except CheckpointError as e:
            manifest, error = None, str(e)
        except Exception as e:  # e.g. an unreadable file: a rank that left now would hang the others' gather
            manifest, error = None, f"checkpoint {path} cannot be verified on rank {rank}: {type(e).__name__}: {e}"
        errors = [None] * world
        # An object collective: torch stages the pickles on the device the default group's backend takes
        # (this rank's CUDA device under NCCL, set by init_distributed), so no tensor is placed here.
        dist.all_gather_object(errors, error)
        found = next((e for e in errors if e), None)
        if found:
            raise CheckpointError(found)
        return manifest

    def consolidated_model_state(self, path: Path) -> dict:
        """The full (unsharded) model state dict of a checkpoint, read in this one process, whatever the
        layout and number of processes that wrote it."""
        class _Planner(_EmptyStateDictLoadPlanner):
            load_bytes = SafeLoadPlanner.load_bytes

        self.verify(path)
        state: dict = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore")
            try:
                _load_state_dict(state, storage_reader=SafeFileSystemReader(str(path)),
                                 planner=_Planner(keys={"model"}), no_dist=True)
            except CheckpointError:
                raise
            except BaseException as e:  # torch's CheckpointException wraps per-rank failures
                raise CheckpointError(_describe_load_failure(path, e)) from None
        return state["model"]

    @staticmethod
    def _tied_renames(path: Path, parts, state: dict) -> list[tuple[str, str, str]]:
        """(group, requested key, key in checkpoint) for tied parameters the checkpoint stores under the other
        name: e.g. a pipeline stage holding the output head, resuming a checkpoint written without pipeline
        parallelism, where the optimizer state of the shared embedding/head tensor is keyed by ``wte.weight``."""
        aliases: dict[str, str] = {}
        for part in parts:
            for a, b in contract_of(part).tied_parameter_names.items():
                aliases[a], aliases[b] = b, a
        if not aliases:
            return []
        available = set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)
        renames = []
        for group in ("model", "optim"):
            for key in list(state.get(group, ())):  # load_model asks for the model only
                if f"{group}.{key}" in available:
                    continue
                for name, twin in aliases.items():
                    if name in key:
                        alt = key.replace(name, twin)
                        if f"{group}.{alt}" in available and alt not in state[group]:
                            renames.append((group, key, alt))
                            break
        return renames

    def _load_sharded(self, path: Path, parts, state: dict) -> None:
        """DCP-load ``state`` (this rank's sharded state dicts) in place: each rank reads the chunks its shards
        need, resharding from the saved layout; tied tensors stored under the other name are found."""
        renames = self._tied_renames(path, parts, state)
        for group, old, new in renames:  # load a tied tensor under the name the checkpoint has
            state[group][new] = state[group].pop(old)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            try:
                dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
            except CheckpointError:
                raise
            except BaseException as e:  # DCP raises CheckpointException (not an Exception) with per-rank details
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(_describe_load_failure(path, e)) from None
        for group, old, new in renames:
            state[group][old] = state[group].pop(new)

    def load_model(self, path: Path, model, skip: frozenset = frozenset()) -> None:
        """Load only the model weights of checkpoint ``path`` into ``model`` (a part or a list of pipeline-stage
        parts), in any layout: starting a run from another run's weights (``model.pretrained`` = a dufu run).
        ``skip``: parameter names the checkpoint cannot hold (a delta added since), left as they are."""
        path = Path(path)
        self.verify_together(path)
        parts = _as_list(model)
        sds = [{k: v for k, v in get_model_state_dict(part, options=_OPTIONS).items() if k not in skip}
               for part in parts]
        state = {"model": {k: v for sd in sds for k, v in sd.items()}}
        self._load_sharded(path, parts, state)
        for part, sd in zip(parts, sds):
            set_model_state_dict(part, {k: state["model"][k] for k in sd},
                                 options=_DELTA_OPTIONS if skip else _OPTIONS)

    def load(self, path: Path, model, optimizer) -> dict:
        """Load model and optimizer in place (resharding to the current layout); return this rank's trainer state."""
        path = Path(path)
        self.verify_together(path)
        parts, optims = _as_list(model), _as_list(optimizer)
        model_sd, optim_sd, keys = _state_dicts(parts, optims, self.options)
        state = {"model": model_sd, "optim": optim_sd}
        self._load_sharded(path, parts, state)
        for part, opt, (mkeys, okeys) in zip(parts, optims, keys):
            if _empty(opt):
                set_model_state_dict(part, {k: state["model"][k] for k in mkeys}, options=self.options)
                continue
            set_state_dict(
                part, opt,
                model_state_dict={k: state["model"][k] for k in mkeys},
                optim_state_dict={k: state["optim"][k] for k in okeys},
                options=self.options,
            )
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if not rank_file.is_file():
            rank_file = path / "rank_00000.pt"
        try:
            return torch.load(rank_file, weights_only=True, map_location="cpu")
        except Exception as e:
            raise CheckpointError(f"checkpoint file {rank_file} cannot be read: {e}") from None
