"""A delta run's model in one process: its base (pretrained weights or the seeded initialisation it trained
from) with the delta of one of its checkpoints on top. Used where a run is read back whole (generation)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dufu.config import LazyConfig, instantiate
from dufu.delta.base import base_fingerprint
from dufu.delta.lora import init_dora_magnitudes
from dufu.delta.spec import apply_delta
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.pretrained import pretrained_source
from dufu.errors import CheckpointError
from dufu.models.base import contract_of
from dufu.parallel.materialize import materialize_


def is_delta_checkpoint(ckpt: Path) -> bool:
    return "delta" in Checkpointer.read_meta(ckpt)


def load_delta_run(ckpt: Path) -> nn.Module:
    """The model of delta checkpoint ``ckpt`` on the CPU: its config's model and delta, the base filled from its
    source (checked against the fingerprint the checkpoint recorded), then the delta's tensors."""
    ckpt = Path(ckpt)
    cfg = LazyConfig.load(str(ckpt / "config.yaml"))
    saved = Checkpointer.read_meta(ckpt)["delta"]
    seed = int(cfg.train.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    base = contract_of(model).pretrained_path
    if base_fingerprint(base, seed, cfg.model)["fingerprint"] != saved.get("fingerprint"):
        raise CheckpointError(f"{ckpt} holds a delta trained on {saved.get('base') or 'a seeded initialisation'}, "
                              f"but that base has changed since (its fingerprint differs); the delta cannot be "
                              "applied to it")
    info = apply_delta(model, instantiate(cfg.delta))
    source = (lambda part: pretrained_source(part, base)) if base is not None else None
    materialize_(model, model, torch.device("cpu"), seed=seed, pretrained=source)
    init_dora_magnitudes([model])
    delta = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    missing = [n for n in info.trainable if n not in delta]
    unexpected = [n for n in delta if n not in set(info.trainable)]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt} does not hold this config's delta: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    model.load_state_dict(delta, strict=False)
    return model
