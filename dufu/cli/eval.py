"""`dufu eval SOURCE [key=value ...]`: the validation loss, perplexity and (with class labels) accuracy of a run, a
checkpoint or a Hugging Face directory, in any layout (LiBai's ``--eval-only``).

The numbers come from the trainer's own evaluation (:func:`dufu.engine.evaluation.evaluate`), on the model built
and split as training builds it, so they are the ``eval_loss`` a run logs, and the same in every layout:

* a dufu run (``output_dir``, ``output_dir/checkpoints`` or one ``step_N``): its ``config.yaml``, with the
  checkpoint's weights read by DCP into whatever layout the evaluation runs in (``--nproc N``; the saved layout
  does not matter). A delta run's checkpoint is its base plus the delta, as in training;
* a Hugging Face directory (``config.json`` + weights + ``tokenizer.json``): the model is built from its config and
  weights (``L(pretrained_model)(path=DIR)``) and evaluated on the data of ``--config`` (default: the default
  recipe's built-in corpus), tokenized with the directory's tokenizer.

By default the validation split is evaluated as the run evaluates it while training: its first
``train.evaluation.eval_iter`` global batches (the config's value; a Hugging Face directory takes that of
``--config``), so a checkpoint's ``eval_loss`` is the one the run logged at its step. ``--eval-iter N`` evaluates N
batches instead, ``--whole-split`` every whole global batch of the split. ``--data FILE`` evaluates a text/jsonl
file or a preprocessed prefix instead, all of it (``--eval-iter`` caps it). Nothing is written to the run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from dufu.cli import require_package
from dufu.cli.config_args import refuse_unknown_flags
from dufu.cli.workers import start_worker_server
from dufu.config import LazyCall, LazyConfig, resolve_config_path
from dufu.errors import ConfigError, DataError, DufuError

# The imports inside the functions below import torch (about 2 s), which `dufu eval --help` and an argument error
# do without.

USAGE_EPILOG = """examples:
  dufu eval output/default
  dufu eval output/default/checkpoints/step_0000200 --nproc 2 train.dist.tensor_parallel_size=2
  dufu eval output/default --data notes.txt --json
  dufu eval path/to/hf_dir --config gpt_debug
"""

# Layout keys an evaluation starts from: one process, whatever the run trained in; the command's overrides and
# --nproc choose the layout (data parallelism takes the processes not given to tensor or pipeline parallelism).
_SINGLE_LAYOUT = ["train.dist.data_parallel_size=-1", "train.dist.tensor_parallel_size=1",
                  "train.dist.pipeline_parallel_size=1", "train.dist.sequence_parallel=False",
                  "train.dist.virtual_pipeline_size=1", "train.zero_optimization.enabled=False"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dufu eval", description="Validation loss, perplexity and accuracy of a dufu run/checkpoint or a "
        "Hugging Face directory, in any layout.", epilog=USAGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a dufu run's output_dir, a checkpoint directory, or a Hugging Face directory")
    parser.add_argument("--config", default=None,
                        help="the recipe/config whose data and batch sizes evaluate a Hugging Face directory "
                        "(default: default); a dufu run uses its own config.yaml")
    parser.add_argument("--data", default=None, metavar="FILE",
                        help="evaluate on this text/jsonl file (or preprocessed prefix), all of it, instead of the "
                        "config's validation split")
    how_much = parser.add_mutually_exclusive_group()
    how_much.add_argument("--eval-iter", type=int, default=None,
                          help="evaluate at most this many global batches (default: the config's "
                          "train.evaluation.eval_iter, the batches the run's logged eval_loss comes from)")
    how_much.add_argument("--whole-split", action="store_true",
                          help="evaluate every whole global batch of the validation split, not the first "
                          "train.evaluation.eval_iter")
    parser.add_argument("--nproc", type=int, default=None, help="processes; dufu starts them through torchrun")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.dist.tensor_parallel_size=2")
    return parser


def source_config(source: str, config: str | None, overrides: list[str]):
    """(config, checkpoint or None, kind) to evaluate ``source`` with: see the module docstring."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a dufu run's output_dir (or one of its checkpoints) or a "
                        "Hugging Face model directory.")
    from dufu.compress.quantize_io import is_quantized_dir  # imports torch: not for --help

    quantized = is_quantized_dir(path)
    if quantized:
        require_package("torchao", "eval")  # its tensors are torchao's
    if quantized or (path / "config.json").is_file():
        from dufu.data import build_tokenizer  # imports torch: not for --help
        from dufu.engine.weights.pretrained import pretrained_model  # imports torch: not for --help
        from dufu.models.hub import build_from_hf_config, read_hf_config  # imports torch: not for --help

        if not (path / "tokenizer.json").is_file():
            raise DataError(f"{path} has no tokenizer.json, so its data cannot be tokenized as the model was "
                            "trained; add the tokenizer the model was trained with to the directory.")
        cfg = LazyConfig.load(str(resolve_config_path(config or "default")))
        # a quantized model is built shaped like its config here; its quantized weights replace it later
        cfg.model = (LazyCall(build_from_hf_config)(hf_config=read_hf_config(path)) if quantized
                     else LazyCall(pretrained_model)(path=str(path)))
        cfg.tokenization.tokenizer = LazyCall(build_tokenizer)(kind="pretrained", path=str(path / "tokenizer.json"))
        # the quantized layers compute in their own precision (int4: bf16 inside, fp32 at the edges)
        fixed = ["train.amp.enabled=False"] if quantized else []
        cfg = LazyConfig.apply_overrides(cfg, _SINGLE_LAYOUT + overrides + fixed)
        return cfg, None, "quantized directory" if quantized else "Hugging Face directory"
    if config is not None:
        raise ConfigError(f"--config applies to a Hugging Face directory; {path} is a dufu run, which is evaluated "
                          "with its own config.yaml (change its keys with key=value overrides).")
    from dufu.engine.weights.convert import resolve_checkpoint  # imports torch: not for --help

    ckpt = resolve_checkpoint(path)
    if not (ckpt / "config.yaml").is_file():
        raise DataError(f"{ckpt} is not a dufu checkpoint with a config.yaml (nor a Hugging Face directory with a "
                        "config.json). Give a run's output_dir, a checkpoint directory or a Hugging Face directory.")
    from dufu.engine.weights.checkpoint import Checkpointer  # imports torch: not for --help

    cfg = LazyConfig.load(str(ckpt / "config.yaml"))
    # The run's global batch, whatever layout it had: evaluation covers the same samples in every layout.
    batch = Checkpointer.read_meta(ckpt).get("global_batch_size")
    same_batch = [f"train.global_batch_size={batch}", "train.num_accumulation_steps=None"] if batch else []
    cfg = LazyConfig.apply_overrides(cfg, _SINGLE_LAYOUT + same_batch + overrides)
    return cfg, ckpt, "dufu checkpoint"


def fit_micro_batch(cfg, overrides: list[str], world_size: int) -> list[str]:
    """Evaluation keeps the run's global batch in any layout; where the run's micro-batch times the data-parallel
    size no longer divides it, and the command did not set train.train_micro_batch_size, take the largest
    micro-batch that does (it changes no number, only how many samples go through at once). Returns the note."""
    from dufu.parallel.parallel_dims import ParallelDims  # imports torch: not for --help

    t = cfg.train
    if any(o.split("=", 1)[0] == "train.train_micro_batch_size" for o in overrides) or not t.global_batch_size:
        return []
    dp = ParallelDims.from_config(t.dist, world_size).data_parallel_size
    per_rank, micro = divmod(t.global_batch_size, dp)
    if micro or t.global_batch_size % (t.train_micro_batch_size * dp) == 0:
        return []  # divisible already, or not at all (the batch check says so)
    new = max(m for m in range(1, t.train_micro_batch_size + 1) if per_rank % m == 0)
    note = (f"micro-batch {new} instead of the run's {t.train_micro_batch_size}: {t.train_micro_batch_size} x dp "
            f"{dp} does not divide the global batch {t.global_batch_size}")
    t.train_micro_batch_size = new
    return [note]


def prepare(source: str, config: str | None, overrides: list[str], world_size: int):
    """(config, checkpoint or None, kind, notes) for evaluating ``source`` with ``world_size`` processes."""
    cfg, ckpt, kind = source_config(source, config, list(overrides))
    if kind == "quantized directory" and world_size > 1:
        raise ConfigError("a quantized model is evaluated in one process (its torchao tensors are not split "
                          "across ranks); leave out --nproc.")
    notes = fit_micro_batch(cfg, list(overrides), world_size)
    cfg.train.evaluation.enabled = True
    # never the run's own directory (its checks would refuse a directory holding a run; evaluation writes nothing)
    cfg.train.output_dir = str(Path(tempfile.gettempdir()) / f"dufu-eval-{os.getpid()}-unused")
    return cfg, ckpt, kind, notes


def check_amount(eval_iter: int | None, whole_split: bool, data: str | None) -> None:
    """Refuse a request for how many batches to evaluate that contradicts itself."""
    if eval_iter is not None and whole_split:
        raise ConfigError(f"--eval-iter {eval_iter} and --whole-split ask for two different amounts; give one.")
    if data is not None and whole_split:
        raise ConfigError("--whole-split applies to the validation split; --data FILE evaluates all of the file "
                          "already (--eval-iter caps it).")
    if eval_iter is not None and eval_iter < 1:
        raise ConfigError(f"--eval-iter {eval_iter}: give 1 or more global batches.")


def evaluate_source(source: str, config: str | None = None, overrides: list[str] = (), data: str | None = None,
                    eval_iter: int | None = None, whole_split: bool = False) -> dict:
    """Evaluate ``source`` in this process's layout (every rank of a job calls it); returns the metrics, with
    what was evaluated. Builds the run's :class:`~dufu.engine.runtime.Runtime` only: no optimizer, sampler or
    checkpointer. How many global batches: ``eval_iter``, else with ``whole_split`` (or ``data``) all of them,
    else the config's ``train.evaluation.eval_iter``, as the run evaluated while training."""
    from dufu.compress.quantize_io import load_quantized  # imports torch: not for --help
    from dufu.engine.weights.checkpoint import Checkpointer  # imports torch: not for --help
    from dufu.engine.delta_run import is_delta_checkpoint  # imports torch: not for --help
    from dufu.engine.evaluation import evaluate  # imports torch: not for --help
    from dufu.engine.runtime import Runtime  # imports torch: not for --help

    check_amount(eval_iter, whole_split, data)
    cfg, ckpt, kind, notes = prepare(source, config, list(overrides), int(os.environ.get("WORLD_SIZE", 1)))
    logged_iter = int(cfg.train.evaluation.eval_iter)  # what the run's own evaluation takes
    # A delta checkpoint holds the delta only: its base comes from its source as in training (the runtime starts
    # from it as from a resumed delta run). Any other checkpoint gives the model weights alone (it may hold no
    # optimizer state, e.g. a pruned model).
    delta = ckpt is not None and is_delta_checkpoint(ckpt)
    with tempfile.TemporaryDirectory(prefix="dufu-eval-") as scratch:
        cfg.train.output_dir = scratch  # nothing is written to the run
        cfg.train.evaluation.eval_iter = 10**9  # capped below, once the validation set is known
        rt = Runtime(cfg, resume=ckpt if delta else False, log=lambda *a, **k: None)
        valid_ds = whole_file_dataset(data, rt) if data is not None else rt.valid_ds
        if valid_ds is None:
            raise DataError("the config has no validation split (dataloader.train.valid_fraction=0); give one "
                            "with dataloader.train.valid_fraction=0.05, or evaluate a file with --data FILE.")
        batches = len(valid_ds) // rt.global_batch_size
        if batches == 0:
            raise DataError(f"the validation data has {len(valid_ds)} samples, fewer than one global batch "
                            f"({rt.global_batch_size}); lower train.global_batch_size (and "
                            "train.train_micro_batch_size) or give more data.")
        whole = batches
        if eval_iter is not None:
            batches, amount = min(batches, eval_iter), f"--eval-iter {eval_iter}"
        elif whole_split or data is not None:
            amount = "all of it"
        else:
            batches = min(batches, logged_iter)
            amount = (f"train.evaluation.eval_iter={logged_iter}, as training evaluates"
                      + (f"; --whole-split: {whole}" if whole > batches else ""))
        cfg.train.evaluation.eval_iter = batches
        if kind == "quantized directory":
            rt.replace_model(load_quantized(source).to(rt.device))
        step = None
        if ckpt is not None:  # each rank reads the chunks of its own shards (DCP), in this layout
            reader = Checkpointer(ckpt.parent, rank=rt.rank)
            if delta:
                reader.set_delta_only()
            reader.load_model(ckpt, rt.model_parts)
            step = int(Checkpointer.read_meta(ckpt).get("step", 0))
        metrics = evaluate(rt, valid_ds)
    return {"source": str(source), "kind": kind, "checkpoint": str(ckpt) if ckpt else None,
            "step": step, "model": rt.model_name,
            "parameters": rt.num_parameters, "world_size": rt.world_size,
            "layout": rt.dims.describe(),
            "dtype": str(rt.amp_dtype).replace("torch.", "") if rt.amp_dtype else "float32",
            "data": data or "validation split of the config's data", "global_batch_size": rt.global_batch_size,
            "seq_length": rt.seq_length,
            "batches": batches, "batches_chosen_by": amount, "notes": notes, **metrics}


def whole_file_dataset(data: str, runtime):
    """Every sample of ``data`` (text, jsonl or a preprocessed prefix), tokenized with the run's tokenizer."""
    from dufu.data import TokenDataset, build_lm_datasets  # as above: only when the subcommand runs

    if not isinstance(runtime.valid_ds, (TokenDataset, type(None))):
        raise ConfigError(f"--data evaluates language-model text; this run's validation data is a "
                          f"{type(runtime.valid_ds).__name__}. Change the run's dataloader.train.* keys instead.")
    whole, _ = build_lm_datasets(data, runtime.tokenizer, runtime.seq_length, valid_fraction=0.0)
    return whole


def format_table(r: dict) -> str:
    step = f", step {r['step']}" if r["step"] is not None else ""
    lines = [f"dufu eval: {r['source']} ({r['kind']}{step})",
             f"  model       {r['model']}, {r['parameters']:,} parameters, {r['dtype']}",
             f"  layout      {r['world_size']} process{'es' if r['world_size'] > 1 else ''}: {r['layout']}",
             f"  data        {r['data']}: {r['batches']} global batches x {r['global_batch_size']} = "
             f"{r['eval_samples']:,} samples ({r['batches_chosen_by']})",
             f"  eval_loss   {r['eval_loss']:.4f}",
             f"  eval_ppl    {r['eval_ppl']:.3f}"]
    if "eval_accuracy" in r:
        lines.append(f"  accuracy    {100 * r['eval_accuracy']:.2f}%")
    lines += [f"  note        {n}" for n in r.get("notes", ())]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    refuse_unknown_flags(overrides, "eval")
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        if args.nproc >= 1:  # the workers' imports start now, beside this process's checks (dufu.cli.workers)
            start_worker_server(args.nproc)
        from dufu.cli.torchrun import run_torchrun  # imports torch: not for --help
        from dufu.engine.delta_run import is_delta_checkpoint  # imports torch: not for --help
        from dufu.engine.preflight import preflight  # imports torch: not for --help
        from dufu.parallel.launch import torchrun_command  # imports torch: not for --help

        if args.nproc < 1:
            raise DufuError(f"--nproc {args.nproc}: give 1 or more processes.")
        check_amount(args.eval_iter, args.whole_split, args.data)

        cfg, ckpt, _, _ = prepare(args.source, args.config, overrides, args.nproc)
        preflight(cfg, world_size=args.nproc,  # one clear error, before any worker starts
                  resume=ckpt if ckpt is not None and is_delta_checkpoint(ckpt) else False)
        forwarded = [args.source, *overrides]
        for flag, value in (("--config", args.config), ("--data", args.data), ("--eval-iter", args.eval_iter)):
            if value is not None:
                forwarded += [flag, str(value)]
        forwarded += ["--whole-split"] if args.whole_split else []
        forwarded += ["--json"] if args.json else []
        return run_torchrun(torchrun_command(args.nproc, forwarded, command="eval"))
    from dufu.parallel.launch import finish_distributed  # imports torch: not for --help

    result = evaluate_source(args.source, args.config, overrides, args.data, args.eval_iter, args.whole_split)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result, indent=1) if args.json else format_table(result), flush=True)
    finish_distributed(0)
    return 0
