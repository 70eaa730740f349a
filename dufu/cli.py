"""`dufu` command line: train, configs, preprocess. Argument parsing and error presentation only."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from dufu.errors import DufuError

USAGE = """dufu <command> [...]

commands:
  train [CONFIG] [--resume] [--nproc N] [--show-config] [key=value ...]
                      train; CONFIG is a .py/.yaml file or a packaged recipe name (default: "default");
                      --nproc N starts N processes through torchrun (multi-node: --nnodes, --node-rank,
                      --master-addr, --master-port)
  generate SOURCE --prompt TEXT
                      sample text from a run/checkpoint or a Hugging Face directory (dufu generate -h)
  configs             list the packaged recipes
  convert CKPT (--to-hf DIR | --to-torch FILE.pt)
                      a sharded checkpoint (or a run's output_dir) as a Hugging Face directory or one file
  preprocess ...      tokenize text/jsonl into a memory-mapped token file (dufu preprocess -h)
"""


def _print_error(err: BaseException) -> None:
    msg = " ".join(str(err).split())
    print("\n".join(textwrap.wrap(f"error: {msg}", width=100, break_long_words=False, break_on_hyphens=False)),
          file=sys.stderr)


def load_train_config(config: str | None, overrides: list[str]):
    from dufu.config import LazyConfig, resolve_config_path

    path = resolve_config_path(config or "default")
    cfg = LazyConfig.load(str(path))
    return LazyConfig.apply_overrides(cfg, overrides)


def cmd_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dufu train", description="Train a model from a config.")
    parser.add_argument("config", nargs="?", default=None,
                        help="a .py or .yaml config, or a packaged recipe name (see `dufu configs`); default: default")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.output_dir")
    parser.add_argument("--resume-if-exists", action="store_true",
                        help="resume when train.output_dir holds a checkpoint, else start fresh (used for restarts)")
    parser.add_argument("--show-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                        help="processes per node; dufu starts them through torchrun")
    parser.add_argument("--nnodes", default=None, help="number of nodes (torchrun --nnodes)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (torchrun --node-rank)")
    parser.add_argument("--master-addr", default=None, help="address of node 0 (torchrun --master-addr)")
    parser.add_argument("--master-port", type=int, default=None, help="port on node 0 (torchrun --master-port)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="restart a failed job up to N times, resuming from the last complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.train_iter=100 optim.lr=1e-3")
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    # `dufu train train.train_iter=10` (no config): the first positional is an override, not a config.
    config = args.config
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    unknown_flags = [o for o in overrides if o.startswith("-")]
    if unknown_flags:
        raise DufuError(f"unknown option(s) {' '.join(unknown_flags)} for `dufu train`; see `dufu train --help`.")
    cfg = load_train_config(config, overrides)
    launching = args.nproc is not None and "LOCAL_RANK" not in os.environ
    if launching:
        return launch(args, config, overrides, cfg)
    if args.show_config:
        from dufu.config import LazyConfig
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            LazyConfig.save(cfg, os.path.join(d, "config.yaml"))
            print(open(os.path.join(d, "config.yaml")).read())
        return 0
    from dufu.parallel.launch import finish_distributed
    from dufu.engine.trainer import Trainer

    Trainer(cfg, resume="auto" if args.resume_if_exists else args.resume).train()
    finish_distributed(0)
    return 0


def launch(args, config, overrides, cfg) -> int:
    """Check the config for the requested world size here, once, then start the workers through torchrun."""
    from dufu.parallel.launch import torchrun_command
    from dufu.engine.preflight import preflight

    nnodes = int(str(args.nnodes).split(":")[-1]) if args.nnodes else 1
    preflight(cfg, world_size=args.nproc * nnodes,
              resume=True if args.resume else ("auto" if args.max_restarts else False))
    argv = ([config] if config else []) + overrides
    if args.resume or args.max_restarts:
        # A restarted worker group must continue from the last complete checkpoint, not start over.
        argv.append("--resume-if-exists" if not args.resume else "--resume")
    cmd = torchrun_command(args.nproc, argv, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, master_port=args.master_port,
                           max_restarts=args.max_restarts)
    return run_torchrun(cmd)


def run_torchrun(cmd: list[str]) -> int:
    """Run the ``python -m torch.distributed.run ARGS`` command line ``cmd`` and return its exit code.

    The launcher has imported torch for its checks already, so torchrun's agent runs in this process
    (``torch.distributed.run.main(ARGS)``, the function behind the ``torchrun`` command) instead of a new
    interpreter that imports torch again before it starts any worker. Failures end as the command's do: the
    error and the failed ranks' summary on stderr, exit code 1."""
    import signal
    import traceback

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    if cmd[:3] != [sys.executable, "-m", "torch.distributed.run"]:
        raise DufuError(f"not a torchrun command line: {' '.join(cmd[:3])} ...")
    try:
        torchrun_main(cmd[3:])
    except SignalException as e:  # Ctrl-C or a termination signal: the agent has stopped the workers
        print("interrupted" if e.sigval == signal.SIGINT else f"stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except SystemExit as e:  # argument errors
        return e.code if isinstance(e.code, int) else 1
    except Exception:  # a failed worker group (ChildFailedError) or agent error, reported as torchrun reports it
        traceback.print_exc()
        return 1
    return 0


def cmd_configs(argv: list[str]) -> int:
    from dufu.config import list_recipes, resolve_config_path

    for name in list_recipes():
        first = ""
        for line in resolve_config_path(name).read_text().splitlines():
            if line.startswith("#"):
                first = line.lstrip("# ").strip()
                break
        print(f"  {name:<16} {first}")
    return 0


def cmd_preprocess(argv: list[str]) -> int:
    from dufu.data.preprocess import main as preprocess_main

    return preprocess_main(argv)


def cmd_convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dufu convert", description="Convert a dufu checkpoint, in one process.")
    parser.add_argument("checkpoint", help="a checkpoint directory (.../checkpoints/step_N) or a run's output_dir")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--to-hf", metavar="DIR", help="write config.json + model.safetensors for transformers")
    group.add_argument("--to-torch", metavar="FILE", help="write one consolidated state dict (torch.save)")
    args = parser.parse_args(argv)
    from dufu.engine import convert

    if args.to_hf:
        out = convert.to_hf(args.checkpoint, args.to_hf)
    else:
        out = convert.to_torch(args.checkpoint, args.to_torch)
    print(f"wrote {out}")
    return 0


def cmd_generate(argv: list[str]) -> int:
    from dufu.engine.generate_cli import main as generate_main

    return generate_main(argv)


COMMANDS = {"train": cmd_train, "configs": cmd_configs, "preprocess": cmd_preprocess, "convert": cmd_convert,
            "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        _print_error(DufuError(
            f"unknown command '{command}'{f'; did you mean {close[0]!r}?' if close else '.'} "
            f"Commands: {', '.join(COMMANDS)}."
        ))
        return 2
    try:
        return COMMANDS[command](rest) or 0
    except DufuError as err:
        from dufu.errors import DistributedFailure

        # In a multi-process job, one copy of a config error; but every rank's own view of a failure.
        if os.environ.get("RANK", "0") == "0" or isinstance(err, DistributedFailure):
            _print_error(err)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
