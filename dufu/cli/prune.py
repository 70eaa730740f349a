"""`dufu prune SOURCE OUTPUT_DIR --heads-keep F --ffn-keep F [--importance magnitude|first-order]`: a trained run
or a Hugging Face directory, structurally pruned (:mod:`dufu.compress.prune`) and written as a dufu model
directory that everything loading a run loads.

The source is a dufu run (its ``output_dir``, ``output_dir/checkpoints`` or one ``checkpoints/step_N``) or a
Hugging Face directory of a family dufu prunes (GPT-2, LLaMA / Qwen2, BERT / RoBERTa). ``first-order``
importance from a run takes its gradients on the first ``--batches`` x ``--batch-size`` samples of the run's
validation split, built from the run's own config and tokenizer; from a Hugging Face directory it needs
``batches`` given to :func:`prune_run` (the command line offers ``magnitude`` there).

``OUTPUT_DIR`` is shaped like a run's output::

    OUTPUT_DIR/checkpoints/step_0000000/   the pruned weights (torch.distributed.checkpoint, with a manifest) and
                                           a config.yaml whose ``model`` is the family's class with the smaller
                                           sizes, e.g. ``num_attention_heads: 2, head_dim: 64, ffn_hidden_size: 512``
    OUTPUT_DIR/config.yaml                 the source run's config with ``model = L(pretrained_model)(path=OUTPUT_DIR)``
                                           and ``train.output_dir = OUTPUT_DIR-finetune``: ``dufu train
                                           OUTPUT_DIR/config.yaml train.train_iter=50`` fine-tunes the pruned model
    OUTPUT_DIR/tokenizer.json              the source's tokenizer
    OUTPUT_DIR/prune.json                  what was done: source, fractions, importance, sizes and parameter counts
                                           before and after, the kept heads and neurons of every block

So ``dufu generate OUTPUT_DIR``, ``model = L(dufu.engine.weights.pretrained.pretrained_model)(path=OUTPUT_DIR)`` and
``dufu convert OUTPUT_DIR --to-hf DIR`` (LLaMA; GPT-2 and BERT configs cannot express fewer heads than
``hidden_size / head_dim``) take it like any run.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch

from dufu.compress.prune import apply_plan, count_parameters, plan_pruning
from dufu.compress.prune_families import family_of
from dufu.config import ConfigDict, LazyCall, LazyConfig, instantiate
from dufu.data import build_tokenizer, collate
from dufu.engine.batch import to_model_inputs
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.convert import resolve_checkpoint
from dufu.engine.delta_run import is_delta_checkpoint
from dufu.engine.preflight import with_kwargs
from dufu.engine.weights.pretrained import from_pretrained, pretrained_model
from dufu.errors import CheckpointError, DataError, DufuError

USAGE_EPILOG = """examples:
  dufu prune output/default output/default-pruned --heads-keep 0.5 --ffn-keep 0.5
  dufu prune output/default output/default-p75 --heads-keep 0.75 --ffn-keep 0.75 --importance first-order
  dufu prune path/to/hf_llama out/llama-half --heads-keep 0.5 --ffn-keep 0.5
  dufu train out/llama-half/config.yaml train.train_iter=50      # fine-tune a pruned run's model
"""


def load_source(source: str | Path):
    """``(model, run config or None, tokenizer.json path or None, description)`` of a run or Hugging Face dir."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a dufu run's output_dir (or one of its checkpoints) or a "
                        "Hugging Face model directory.")
    if (path / "config.json").is_file():
        tokenizer = path / "tokenizer.json"
        return from_pretrained(path), None, tokenizer if tokenizer.is_file() else None, f"Hugging Face {path}"
    ckpt = resolve_checkpoint(path)
    if not (ckpt / "config.yaml").is_file():
        raise CheckpointError(f"{ckpt} is not a dufu checkpoint with a config.yaml. Give a run's output_dir, a "
                              "checkpoints/step_N directory or a Hugging Face directory.")
    if is_delta_checkpoint(ckpt):
        raise DufuError(f"{ckpt} is a delta run's checkpoint (only the delta): convert it to a merged model first "
                        "(dufu convert SOURCE --to-hf DIR --merge) and prune DIR.")
    tokenizer = ckpt.parent.parent / "tokenizer.json"  # written by the trainer into output_dir
    return (pretrained_model(ckpt), LazyConfig.load(str(ckpt / "config.yaml")),
            tokenizer if tokenizer.is_file() else None, f"dufu checkpoint {ckpt}")


def validation_batches(cfg, tokenizer_file: Optional[Path], num_batches: int = 4,
                       batch_size: int = 8) -> list[dict]:
    """The first ``num_batches`` x ``batch_size`` samples of a run's validation split, as model inputs with labels
    (what the trainer's evaluation feeds the model)."""
    if cfg is None or "dataloader" not in cfg or "train" not in cfg.dataloader:
        raise DataError("first-order importance needs data: this source has no run config with "
                        "dataloader.train. Pass batches to prune_run(..., batches=[...]) or use --importance "
                        "magnitude.")
    if num_batches < 1 or batch_size < 1:
        raise DufuError(f"--batches {num_batches} --batch-size {batch_size}: both must be at least 1.")
    tokenizer = (build_tokenizer("pretrained", path=tokenizer_file) if tokenizer_file is not None
                 else instantiate(cfg.tokenization.tokenizer))
    _, valid = instantiate(with_kwargs(cfg.dataloader.train, tokenizer=tokenizer))
    if valid is None or len(valid) == 0:
        raise DataError("the run's data has no validation split (dataloader.train.valid_fraction=0), which "
                        "first-order importance takes its gradients on. Use --importance magnitude, or pass "
                        "batches to prune_run.")
    n = min(num_batches * batch_size, len(valid))
    return [to_model_inputs(collate(valid, list(range(s, min(s + batch_size, n))))) for s in range(0, n, batch_size)]


def write_pruned(model, kwargs: dict, output_dir: str | Path, cfg=None, tokenizer_file: Optional[Path] = None,
                 record: Optional[dict] = None) -> Path:
    """Write ``model`` (built by ``type(model)(**kwargs)``) as the model directory the module docstring
    describes. ``cfg``: the source run's config (its data, optimizer and train settings are kept)."""
    out = Path(output_dir)
    if (out / "checkpoints").exists() or (out / "config.yaml").exists():
        raise DufuError(f"{out} already holds a model directory or run; give a new output directory (or delete "
                        "that one).")
    out.mkdir(parents=True, exist_ok=True)
    own = copy.deepcopy(cfg) if cfg is not None else ConfigDict()
    own["model"] = LazyCall(type(model))(**kwargs)  # every size explicit: the checkpoint describes itself
    # No optimizer state: an optimizer without parameters makes the checkpointer save the model alone.
    nothing = torch.optim.SGD([{"params": []}], lr=0.0)
    Checkpointer(out / "checkpoints").save(0, model, nothing, {"step": 0}, extra_meta={"pruned": record or {}},
                                           config_text=LazyConfig.to_yaml(own))
    top = copy.deepcopy(own)
    top["model"] = LazyCall(pretrained_model)(path=str(out))
    if "train" in top:
        top.train.output_dir = str(out) + "-finetune"
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        if "tokenization" not in top:
            top["tokenization"] = ConfigDict(tokenizer=LazyCall(build_tokenizer)(kind="pretrained",
                                                                                path=str(out / "tokenizer.json")))
    LazyConfig.save(top, out / "config.yaml")
    # one line per entry: the kept indices stay readable as lists
    lines = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in (record or {}).items())
    (out / "prune.json").write_text("{\n" + lines + "\n}\n")
    return out


def prune_run(source: str | Path, output_dir: str | Path, heads_keep: float, ffn_keep: float,
              importance: str = "magnitude", batches: Optional[Iterable[dict]] = None, num_batches: int = 4,
              batch_size: int = 8) -> Path:
    """Load ``source`` (a dufu run / checkpoint or a Hugging Face directory), prune it and write ``output_dir``
    (see the module docstring). ``batches``: the data of ``first-order`` importance; by default, for a run,
    ``num_batches`` batches of ``batch_size`` samples of its validation split."""
    model, cfg, tokenizer_file, what = load_source(source)
    if importance == "first-order" and batches is None:
        batches = validation_batches(cfg, tokenizer_file, num_batches, batch_size)
    model.eval()
    plan = plan_pruning(model, heads_keep, ffn_keep, importance, batches)
    small, kwargs = apply_plan(model, plan)
    original = family_of(model).kwargs(model)
    sizes = ("num_attention_heads", "num_key_value_heads", "head_dim", "ffn_hidden_size")
    record = {
        "source": what, "heads_keep": heads_keep, "ffn_keep": ffn_keep, "importance": importance,
        "model": type(model).__name__,
        "before": {**{k: original[k] for k in sizes if k in original}, "parameters": count_parameters(model)},
        "after": {**{k: kwargs[k] for k in sizes if k in kwargs}, "parameters": count_parameters(small)},
        "kept_heads": plan.heads, "kept_neurons": plan.neurons,
    }
    return write_pruned(small, kwargs, output_dir, cfg, tokenizer_file, record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu prune", description="Remove the least important attention heads and feed-forward neurons of a "
        "run's or Hugging Face model and write the smaller model as a dufu model directory (docs/pruning.md).",
        epilog=USAGE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="a dufu run's output_dir, a checkpoint directory, or a Hugging Face directory")
    parser.add_argument("output_dir", help="where the pruned model directory is written (must not hold one)")
    parser.add_argument("--heads-keep", type=float, required=True,
                        help="fraction of each layer's attention heads to keep, in (0, 1] (LLaMA: of its "
                        "key/value groups, each with its query heads)")
    parser.add_argument("--ffn-keep", type=float, required=True,
                        help="fraction of each layer's feed-forward neurons to keep, in (0, 1]")
    parser.add_argument("--importance", choices=("magnitude", "first-order"), default="magnitude",
                        help="magnitude: weight norms, no data; first-order: |sum of weight x gradient| on the "
                        "run's validation data (default: magnitude)")
    parser.add_argument("--batches", type=int, default=4, help="first-order: validation batches (default 4)")
    parser.add_argument("--batch-size", type=int, default=8, help="first-order: samples per batch (default 8)")
    args = parser.parse_args(argv)
    out = prune_run(args.source, args.output_dir, args.heads_keep, args.ffn_keep, args.importance,
                    num_batches=args.batches, batch_size=args.batch_size)
    record = json.loads((out / "prune.json").read_text())
    b, a = record["before"], record["after"]
    print(f"pruned {record['model']} ({record['importance']}): heads {b['num_attention_heads']} -> "
          f"{a['num_attention_heads']}, ffn {b['ffn_hidden_size']} -> {a['ffn_hidden_size']}, parameters "
          f"{b['parameters']:,} -> {a['parameters']:,}; wrote {out}")
    return 0


if __name__ == "__main__":  # python -m dufu.cli.prune SOURCE OUTPUT_DIR ...
    raise SystemExit(main())
