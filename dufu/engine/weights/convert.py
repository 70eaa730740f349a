"""Turn a sharded dufu checkpoint into a single file or a Hugging Face model directory (a delta run: a PEFT
adapter), in one process.

Works whatever layout and number of processes wrote the checkpoint: DCP's metadata
describes every shard, and the full tensors are assembled here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dufu.config import LazyConfig, instantiate
from dufu.data import Tokenizer
from dufu.delta import peft
from dufu.delta.base import base_fingerprint
from dufu.delta.lora import lora_layers
from dufu.delta.spec import apply_delta
from dufu.engine.delta_run import load_delta_run
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.pretrained import give_default_mode, save_pretrained
from dufu.errors import CheckpointError, DufuError
from dufu.models import hub


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


def to_hf(checkpoint: str | Path, out_dir: str | Path, merge: bool = False) -> Path:
    """Write config.json + model.safetensors that transformers' Auto classes load (every family with a
    Hugging Face mapping in dufu.models.hub). A delta run's checkpoint (only the delta) becomes a PEFT
    adapter, or with ``merge`` the merged model: see :func:`delta_to_hf`."""
    ckpt = resolve_checkpoint(checkpoint)
    cfg_path = ckpt / "config.yaml"
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no config.yaml, so its model cannot be identified.")
    cfg = LazyConfig.load(str(cfg_path))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    try:
        hub.adapter_for_model(model)
    except DufuError as e:
        raise DufuError(f"--to-hf: {e} Use --to-torch for a consolidated state dict.") from None
    if "delta" in Checkpointer.read_meta(ckpt):
        return delta_to_hf(ckpt, cfg, model, Path(out_dir), merge)
    state = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    out_dir = Path(out_dir)
    save_pretrained(model, out_dir, state_dict=state)
    _finish_hf_dir(ckpt, out_dir)
    return out_dir


def delta_to_hf(ckpt: Path, cfg, model, out_dir: Path, merge: bool = False) -> Path:
    """A delta run's checkpoint as PEFT's adapter (:mod:`dufu.delta.peft`), whose ``base_model_name_or_path``
    names a Hugging Face directory of the base: the one the run started from (``model.pretrained``), or, for a
    base dufu initialised (seeded) or a dufu run as the base, one written beside the adapter (``out_dir/base``).
    ``merge``: the merged model instead (also what a delta without LoRA, e.g. BitFit, always gives)."""
    saved = Checkpointer.read_meta(ckpt)["delta"]
    base = saved.get("base")  # the pretrained path the run started from; None: dufu's seeded initialisation
    apply_delta(model, instantiate(cfg.delta))  # on the meta device: the layers and their ranks
    peft.check_lora_only(model)  # adapters, prefix or prompt tuning: in neither format
    merge = merge or not lora_layers(model)
    if not merge and base is not None and (Path(base) / "config.json").is_file():
        if base_fingerprint(base, int(cfg.train.seed), cfg.model)["fingerprint"] != saved.get("fingerprint"):
            raise CheckpointError(f"{ckpt} holds a delta trained on {base}, but that directory has changed since "
                                  "(its fingerprint differs): the adapter would name another base.")
        state = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)  # the delta only
        peft.save_adapter(model, out_dir, state_dict=state, base=base)
        give_default_mode(out_dir / peft.ADAPTER_WEIGHTS)
    else:
        full = load_delta_run(ckpt)  # the base from its source or seed, the delta on top
        if merge:
            save_pretrained(full, out_dir, merge=True)
            _finish_hf_dir(ckpt, out_dir)
            return out_dir
        written = hub.write_hf_model(full, out_dir / "base", peft.base_state_dict(full))
        _finish_hf_dir(ckpt, written)
        peft.save_adapter(full, out_dir, base=written)
        give_default_mode(written / "model.safetensors", out_dir / peft.ADAPTER_WEIGHTS)
    tokenizer = ckpt.parent.parent / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return out_dir


def _finish_hf_dir(ckpt: Path, out_dir: Path) -> None:
    """The run's tokenizer beside the weights (the trainer saved it in output_dir), and its end-of-document id
    as BOS/EOS in config.json (none without a tokenizer: dufu's ids are not the family's defaults)."""
    hf_config = json.loads((out_dir / "config.json").read_text())
    tokenizer = ckpt.parent.parent / "tokenizer.json"
    hf_config["bos_token_id"] = hf_config["eos_token_id"] = None
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
        hf_config["bos_token_id"] = hf_config["eos_token_id"] = Tokenizer.from_file(str(tokenizer)).eod_id
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
