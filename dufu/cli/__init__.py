"""`dufu <command> ...`: the usage text, the table of subcommands and ``main``, which runs one and presents its
errors. Each subcommand parses its own arguments in a module of this package (dufu.cli.train, dufu.cli.eval, ...)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import textwrap

from dufu.errors import DistributedFailure, DufuError

USAGE = """dufu <command> [...]

commands:
  train [CONFIG] [--resume] [--nproc N] [--show-config] [key=value ...]
                      train; CONFIG is a .py/.yaml file or a packaged recipe name (default: "default");
                      --nproc N starts N processes through torchrun (multi-node: --nnodes, --node-rank,
                      --master-addr, --master-port)
  plan [CONFIG] [key=value ...] --gpus N --gpu NAME [--gpus-per-node 8] [--json] [--plot FILE.png]
                      predict per-device peak memory and step time of the config's layout; with `auto` values
                      (e.g. train.dist.tensor_parallel_size=auto), rank the layouts that fit (dufu plan -h)
  eval SOURCE [--nproc N] [--data FILE] [--json] [key=value ...]
                      validation loss, perplexity and accuracy of a run/checkpoint or a Hugging Face directory,
                      in any layout (dufu eval -h)
  generate SOURCE --prompt TEXT [--prompt ...] [--num-beams K] [--stop S] [--max-memory SIZE]
                      generate text (several prompts, sampling or beams, stop strings, T5) from a run/checkpoint,
                      a Hugging Face directory or a quantized directory (dufu generate -h)
  prune SOURCE OUTPUT_DIR --heads-keep F --ffn-keep F [--importance magnitude|first-order]
                      structured pruning of attention heads and FFN neurons: a smaller model of the same family
                      (docs/pruning.md)
  quantize SOURCE --scheme int8-weight|int8-dynamic|int4-weight --output DIR
                      post-training quantization on torchao (docs/quantization.md)
  configs             list the packaged recipes
  convert CKPT (--to-hf DIR | --to-torch FILE.pt)
                      a sharded checkpoint (or a run's output_dir) as a Hugging Face directory or one file
  preprocess ...      tokenize text/jsonl into a memory-mapped token file (dufu preprocess -h)
  lighthouse [--bind [::]:29510] [--min-replicas N] [--join-timeout S]
                      the coordinator of fault-tolerant replica groups, train.fault_tolerance (docs/faults.md)
"""


def _print_error(err: BaseException) -> None:
    msg = " ".join(str(err).split())
    print("\n".join(textwrap.wrap(f"error: {msg}", width=100, break_long_words=False, break_on_hyphens=False)),
          file=sys.stderr)


# command -> the module whose ``main(argv)`` runs it, imported when that command runs: several import torch at
# their top (2-3 s), which `dufu --help` and every other command do without.
COMMANDS = {"train": "dufu.cli.train", "eval": "dufu.cli.eval", "configs": "dufu.cli.configs",
            "preprocess": "dufu.data.preprocess", "convert": "dufu.cli.convert", "generate": "dufu.cli.generate",
            "plan": "dufu.cli.plan", "prune": "dufu.cli.prune", "quantize": "dufu.cli.quantize",
            "lighthouse": "dufu.cli.lighthouse"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        _print_error(DufuError(
            f"unknown command '{command}'{f'; did you mean {close[0]!r}?' if close else '.'} "
            f"Commands: {', '.join(COMMANDS)}."
        ))
        return 2
    try:
        return importlib.import_module(COMMANDS[command]).main(rest) or 0
    except DufuError as err:
        # In a multi-process job, one copy of a config error; but every rank's own view of a failure.
        if os.environ.get("RANK", "0") == "0" or isinstance(err, DistributedFailure):
            _print_error(err)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
