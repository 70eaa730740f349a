"""What a resumed run continues from, and that it continues the saved run rather than silently changing it.

``dufu train --resume`` takes the newest complete checkpoint of ``train.output_dir``; ``--resume-step N`` the one of
step N there, ``--resume-from PATH`` any checkpoint directory (another run's, to branch it). A missing or damaged
choice is refused with the checkpoints that are there (:class:`ResumeRequest`, :func:`choose_checkpoint`).

Before any work, the new config is compared with the checkpoint's own ``config.yaml`` and manifest (Megatron's
checks of the schedule and batch against the checkpoint, with its ``--override-opt_param-scheduler`` as the way
out):

* the learning-rate schedule (``train.train_iter``, every ``train.scheduler`` key, ``optim.lr``), the global batch
  size and the data (``train.seed``, every ``dataloader`` and ``tokenization`` key but cache directories) must be
  the saved run's, or be named with ``--override-saved KEY``; the run then says in its start-up lines what it
  changed (:func:`check_saved_settings`);
* a config that leaves the global batch unset keeps the saved one in any layout, the accumulation steps following
  (:func:`keep_saved_global_batch`): without that, the batch of a resumed run would follow the number of processes;
* the model this config builds must have the checkpoint's parameter names and shapes, else one error lists them and
  the model settings that differ from the saved run (:func:`check_model_shapes`).

Layout, precision, logging, evaluation and checkpoint cadence may change freely.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from dufu.config import LazyConfig
from dufu.engine.weights.checkpoint import MANIFEST, Checkpointer, describe_steps
from dufu.engine.weights.checkpoint_safe import SafeFileSystemReader
from dufu.errors import CheckpointError, ConfigError
from dufu.models.base import contract_of

# What a resume compares with the saved run: dotted keys and the groups they head.
SCHEDULE_KEYS = ("train.train_iter", "train.scheduler", "optim.lr")
DATA_KEYS = ("train.seed", "dataloader", "tokenization")
GLOBAL_BATCH_KEY = "train.global_batch_size"
_WHERE_NOT_WHAT = {"cache_dir"}  # where tokenized data is cached, not which data it is
_UNSET = object()
_SHOWN = 3  # examples of each kind in a model mismatch message (it stays one short paragraph)


@dataclass(frozen=True)
class ResumeRequest:
    """How ``dufu train`` continues a run. ``if_exists``: the newest checkpoint if there is one, else step 0
    (``--resume-if-exists``, restarts); ``step``: the step-N checkpoint of ``train.output_dir``; ``path``: that
    checkpoint directory; ``override_saved``: settings (or groups, e.g. ``train.scheduler``) the run may change."""

    if_exists: bool = False
    step: Optional[int] = None
    path: Optional[Path] = None
    override_saved: tuple[str, ...] = ()

    def overrides(self, key: str) -> bool:
        return any(_covers(o, key) for o in self.override_saved)

    def overrides_data(self) -> bool:
        """Whether a data setting may change: the sampler then continues at the saved position in the new order."""
        return any(_covers(o, k) or _covers(k, o) for o in self.override_saved for k in DATA_KEYS)


def as_request(resume) -> Optional[ResumeRequest]:
    """``resume`` as the Trainer takes it (False, True, "auto" or a request) as a request, or None for a new run."""
    if isinstance(resume, ResumeRequest):
        return resume
    if resume is False or resume is None:
        return None
    if resume is True:
        return ResumeRequest()
    if resume == "auto":
        return ResumeRequest(if_exists=True)
    raise TypeError(f"resume must be False, True, 'auto' or a ResumeRequest, not {resume!r}")


def _covers(override: str, key: str) -> bool:
    return key == override or key.startswith(override + ".")


def check_override_keys(keys) -> None:
    """Every ``--override-saved`` key names a compared setting or a group of them."""
    heads = (*SCHEDULE_KEYS, GLOBAL_BATCH_KEY, *DATA_KEYS)
    unknown = [k for k in keys if not any(_covers(k, h) or _covers(h, k) for h in heads)]
    if unknown:
        raise ConfigError(
            f"--override-saved {', '.join(unknown)}: not a setting a resume compares with the saved run. Those are "
            "the learning-rate schedule (train.train_iter, train.scheduler.*, optim.lr), the global batch "
            "(train.global_batch_size) and the data (train.seed, dataloader.*, tokenization.*); name one of them "
            "or a group such as train.scheduler. Any other setting may change on resume without it.")


# ------------------------------------------------------------------------------------------ which checkpoint


def choose_checkpoint(output_dir: Path, request: ResumeRequest) -> Optional[Path]:
    """The checkpoint ``request`` names: ``path``, the ``step`` of ``output_dir``, or the newest there (None: none
    yet, the run starts at step 0)."""
    root = Path(output_dir) / "checkpoints"
    if request.path is not None:
        return _checkpoint_at(Path(request.path))
    if request.step is not None:
        path = root / f"step_{request.step:07d}"
        if (path / MANIFEST).is_file():
            return path
        state = "is incomplete (it has no manifest.json: its save did not finish)" if path.is_dir() else \
            "does not exist"
        steps = [s for s, _ in Checkpointer(root).complete_checkpoints()]
        there = (f"the complete checkpoints in {root} are of steps {describe_steps(steps)}: name one of them"
                 if steps else f"{root} holds no complete checkpoint; name another run's with --resume-from PATH")
        raise CheckpointError(f"--resume-step {request.step}: checkpoint {path} {state}; {there}.")
    return Checkpointer(root).latest()


def _checkpoint_at(path: Path) -> Path:
    if (path / MANIFEST).is_file():
        return path
    if (path / "checkpoints").is_dir():  # a run directory
        steps = Checkpointer(path / "checkpoints").complete_checkpoints()
        example = f", e.g. --resume-from {steps[-1][1]} (complete: steps {describe_steps([s for s, _ in steps])})" \
            if steps else " (it holds no complete checkpoint)"
        raise CheckpointError(f"--resume-from {path} is a run directory, not a checkpoint; name one of its "
                              f"checkpoints{example}.")
    if not path.exists():
        raise CheckpointError(f"--resume-from {path}: no such directory. Name a checkpoint directory, such as "
                              "RUN/checkpoints/step_0000100.")
    steps = [s for s, p in Checkpointer(path.parent).complete_checkpoints()]
    others = f"; the complete checkpoints beside it are of steps {describe_steps(steps)}" if steps else ""
    raise CheckpointError(f"--resume-from {path} is not a complete checkpoint (it has no {MANIFEST}: its save did "
                          f"not finish, or it is not a checkpoint){others}.")


def set_aside_later_checkpoints(root: Path, step: int) -> Optional[str]:
    """Move the complete checkpoints of ``root`` after ``step`` (a resume from an earlier one: they belong to the
    continuation being replaced) to ``root/replaced_at_step_N/``, so that neither ``--resume`` nor pruning by
    train.checkpointer.max_to_keep mistakes them for this run's. Returns the line saying so, or None."""
    later = [(s, p) for s, p in Checkpointer(root).complete_checkpoints() if s > step]
    if not later:
        return None
    aside = Path(root) / f"replaced_at_step_{step:07d}"
    aside.mkdir(parents=True, exist_ok=True)
    for _, path in later:
        target = aside / path.name
        if target.exists():
            shutil.rmtree(target)
        path.rename(target)
    return (f"checkpoints after step {step} (steps {describe_steps([s for s, _ in later])}) belong to the run this "
            f"resume replaces: moved to {aside}")


# ------------------------------------------------------------------------------------------ the saved run


@dataclass
class SavedRun:
    """What a checkpoint says about the run that wrote it: its manifest and its config.yaml (flattened to dotted
    keys; None when the checkpoint holds none)."""

    path: Path
    manifest: dict
    config: Optional[dict]

    @classmethod
    def read(cls, path: Path) -> "SavedRun":
        path = Path(path)
        # every file present at its size; the two small files read here checked against their checksums
        manifest = Checkpointer(path.parent).verify(path, only={"config.yaml", ".metadata"})
        config = None
        if (path / "config.yaml").is_file():
            try:
                config = flatten(yaml.safe_load((path / "config.yaml").read_text()) or {})
            except yaml.YAMLError as e:
                raise CheckpointError(f"{path / 'config.yaml'} cannot be read ({' '.join(str(e).split())[:200]}); "
                                      "use another checkpoint.") from None
        return cls(path, manifest, config)

    @property
    def global_batch_size(self) -> Optional[int]:
        return self.manifest.get("global_batch_size")

    def model_shapes(self) -> dict[str, tuple]:
        """{parameter or buffer name: its full shape} of the checkpoint's model, from the DCP metadata."""
        metadata = SafeFileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        return {k[len("model."):]: tuple(m.size) for k, m in metadata.items()
                if k.startswith("model.") and hasattr(m, "size")}


def flatten(tree, prefix: str = "") -> dict:
    """{"a.b.c": value} of nested mappings; lists and empty mappings are values."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _kind(key: str) -> Optional[str]:
    if any(_covers(h, key) for h in SCHEDULE_KEYS):
        return "learning-rate schedule"
    if any(_covers(h, key) for h in DATA_KEYS) and key.rpartition(".")[2] not in _WHERE_NOT_WHAT:
        return "data"
    return None


def _show(value) -> str:
    if value is _UNSET:
        return "(unset)"
    text = repr(value) if isinstance(value, str) else json.dumps(value) if isinstance(value, (list, dict)) \
        else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------ the checks


def keep_saved_global_batch(cfg, saved: SavedRun, data_parallel_size: int) -> Optional[str]:
    """A config that leaves the global batch unset (``train.global_batch_size`` and ``num_accumulation_steps``
    None) keeps the checkpoint's: set here, so config.yaml records it; the accumulation steps follow from the
    layout. Returns the start-up line when the layout alone would have given another batch, else None."""
    t, saved_batch = cfg.train, saved.global_batch_size
    if saved_batch is None or t.global_batch_size is not None or t.num_accumulation_steps is not None:
        return None
    micro, dp = t.train_micro_batch_size, data_parallel_size
    per_step = micro * dp
    if saved_batch % per_step:
        if saved_batch % dp == 0:
            fit = max(m for m in range(1, min(micro, saved_batch // dp) + 1) if (saved_batch // dp) % m == 0)
            fix = f"set train.train_micro_batch_size={fit} (micro x dp must divide {saved_batch})"
        else:
            fix = f"use a data_parallel_size that divides {saved_batch}"
        raise ConfigError(
            f"resuming {saved.path}: train.global_batch_size is unset, so the run keeps the checkpoint's global "
            f"batch of {saved_batch}, but train_micro_batch_size {micro} x data_parallel_size {dp} = {per_step} "
            f"does not divide it. To keep it, {fix}; to train on with another global batch, set "
            "train.global_batch_size=N and add --override-saved train.global_batch_size.")
    t.global_batch_size = saved_batch
    if per_step == saved_batch:
        return None
    return (f"global batch {saved_batch} kept from checkpoint {saved.path.name} (train.global_batch_size is unset): "
            f"micro {micro} x dp {dp} x accumulation {saved_batch // per_step} in this layout")


def check_saved_settings(cfg, saved: SavedRun, batch_sizes: tuple[int, int, int], data_parallel_size: int,
                         request: ResumeRequest) -> list[str]:
    """Refuse a change of the schedule, global batch or data against the saved run unless ``request`` overrides
    it; return the start-up lines naming what was overridden (and what could not be compared)."""
    check_override_keys(request.override_saved)
    changes = []  # (key, old, new, what)
    notes = []
    if saved.config is None:
        notes.append(f"checkpoint {saved.path.name} holds no config.yaml: the learning-rate schedule and the data "
                     "could not be compared with the saved run's")
    else:
        new = flatten(yaml.safe_load(LazyConfig.to_yaml(cfg)) or {})
        for key in sorted(set(saved.config) | set(new)):
            what = _kind(key)
            old_value, new_value = saved.config.get(key, _UNSET), new.get(key, _UNSET)
            if what and old_value != new_value:
                changes.append((key, old_value, new_value, what))
    micro, global_batch, accum = batch_sizes
    if saved.global_batch_size is None:
        notes.append(f"checkpoint {saved.path.name} does not record its global batch size: not compared")
    elif global_batch != saved.global_batch_size:
        changes.append((GLOBAL_BATCH_KEY, saved.global_batch_size, global_batch,
                        f"global batch; here micro {micro} x dp {data_parallel_size} x accumulation {accum}"))
    described = [f"{key} {_show(old)} -> {_show(new)} ({what})" for key, old, new, what in changes]
    refused = [(c, text) for c, text in zip(changes, described) if not request.overrides(c[0])]
    if refused:
        flags = " ".join(f"--override-saved {c[0]}" for c, _ in refused)
        raise ConfigError(
            f"resuming {saved.path} would change what the saved run trains with: "
            f"{'; '.join(text for _, text in refused)}. Set {'it' if len(refused) == 1 else 'them'} back to the saved "
            f"value{'s' if len(refused) > 1 else ''}, or, to change {'it' if len(refused) == 1 else 'them'} on "
            f"purpose from step {saved.manifest.get('step', '?')}, add {flags}.")
    if described:
        notes.append(f"--override-saved: {'; '.join(described)}, from step {saved.manifest.get('step', '?')} on")
    return notes


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _plain(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def check_model_shapes(model, saved: SavedRun, cfg, delta: bool) -> None:
    """The model ``cfg`` builds (``model``, on the meta device, unsplit) has the checkpoint's parameter names and
    full shapes, else one error naming them and the model settings that differ from the saved run's. A delta run's
    checkpoint holds only the delta: only its shapes are compared."""
    stored = saved.model_shapes()
    expected = {_plain(k): tuple(v.shape) for k, v in model.state_dict().items()}
    aliases = {}
    for a, b in contract_of(model).tied_parameter_names.items():
        aliases[a], aliases[b] = b, a

    def has(key, pool):  # under its own name or its tied twin's
        return key in pool or any(n in key and key.replace(n, t) in pool for n, t in aliases.items())

    differ = [(k, stored[k], shape) for k, shape in expected.items() if k in stored and stored[k] != shape]
    missing = [] if delta else [k for k in expected if not has(k, stored)]
    extra = [] if delta else [k for k in stored if not has(k, expected)]
    if not (differ or missing or extra):
        return
    parts = []
    if differ:
        shown = "; ".join(f"{k} saved {_shape(a)}, this model {_shape(b)}" for k, a, b in differ[:_SHOWN])
        parts.append(f"{len(differ)} parameter{'s differ' if len(differ) > 1 else ' differs'} in shape: {shown}"
                     f"{_more(differ)}")
    if missing:
        parts.append(f"the checkpoint lacks {len(missing)} of this model's: {', '.join(missing[:_SHOWN])}"
                     f"{_more(missing)}")
    if extra:
        parts.append(f"this model lacks {len(extra)} of the checkpoint's: {', '.join(extra[:_SHOWN])}{_more(extra)}")
    raise CheckpointError(f"checkpoint {saved.path} holds a different model than this config builds: "
                          f"{'; '.join(parts)}. {_model_settings(saved, cfg)}")


def _shape(shape: tuple) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _more(items: list) -> str:
    return f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""


def _model_settings(saved: SavedRun, cfg) -> str:
    """Which model settings probably explain a mismatch: those that differ from the saved run's config."""
    if saved.config is None:
        return "Resume it with the model settings of the run that wrote it (model.*), or start a new run."
    new = flatten(yaml.safe_load(LazyConfig.to_yaml(cfg)) or {})
    keys = sorted(k for k in set(saved.config) | set(new) if re.match(r"(model|delta)\.", k)
                  and saved.config.get(k, _UNSET) != new.get(k, _UNSET))
    if not keys:
        return ("model.* and delta.* equal the saved run's, so the model code differs from the one that wrote the "
                "checkpoint; resume it with that version, or start a new run.")
    changed = "; ".join(f"{k} {_show(saved.config.get(k, _UNSET))} -> {_show(new.get(k, _UNSET))}"
                        for k in keys[:_SHOWN])
    return (f"The model settings that differ from the saved run's: {changed}{_more(keys)}. "
            "Set them back to resume it, or train this model as a new run (another train.output_dir).")
