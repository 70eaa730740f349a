"""Turn a sharded dufu checkpoint into a single file or a Hugging Face model directory, in one process.

Works whatever layout and number of processes wrote the checkpoint: DCP's metadata
describes every shard, and the full tensors are assembled here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dufu.config import LazyConfig, instantiate
from dufu.engine.checkpoint import Checkpointer
from dufu.errors import CheckpointError, DufuError


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run's output_dir / checkpoints dir (its latest complete checkpoint)."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        latest = Checkpointer(root).latest() if root.is_dir() else None
        if latest is not None and not (path / "manifest.json").exists():
            return latest
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist. Give a checkpoint directory (…/checkpoints/step_N) "
                              "or a run's output_dir.")
    return path


def to_torch(checkpoint: str | Path, out: str | Path) -> Path:
    ckpt = resolve_checkpoint(checkpoint)
    state = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out)
    return out


def to_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors that transformers' Auto classes load (every family with a
    Hugging Face mapping in dufu.models.hub)."""
    ckpt = resolve_checkpoint(checkpoint)
    cfg_path = ckpt / "config.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no config.yaml, so its model cannot be identified.")
    cfg = LazyConfig.load(str(cfg_path))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    from dufu.models import hub

    try:
        hub.adapter_for_model(model)
    except DufuError as e:
        raise DufuError(f"--to-hf: {e} Use --to-torch for a consolidated state dict.") from None
    state = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    out_dir = Path(out_dir)
    hub.save_pretrained(model, out_dir, state_dict=state)
    hf_config = json.loads((out_dir / "config.json").read_text())
    tokenizer = ckpt.parent.parent / "tokenizer.json"  # saved by the trainer in output_dir
    hf_config["bos_token_id"] = hf_config["eos_token_id"] = None
    if tokenizer.is_file():
        from dufu.data import Tokenizer

        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
        hf_config["bos_token_id"] = hf_config["eos_token_id"] = Tokenizer.from_file(str(tokenizer)).eod_id
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out_dir
