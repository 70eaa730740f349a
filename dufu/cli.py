"""`dufu` command line: train, eval, plan, generate, convert, configs, preprocess. Argument parsing and error presentation only."""

from __future__ import annotations

import argparse
import logging
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


def load_train_config(config: str | None, overrides: list[str]):
    from dufu.config import LazyConfig, resolve_config_path

    path = resolve_config_path(config or "default")
    cfg = LazyConfig.load(str(path))
    return LazyConfig.apply_overrides(cfg, overrides)


def parse_config_args(parser, argv: list[str], command: str):
    """(args, config or None, overrides) of a command taking ``CONFIG [key=value ...]``."""
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    # `dufu train train.train_iter=10` (no config): the first positional is an override, not a config.
    config = args.config
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    refuse_unknown_flags(overrides, command)
    return args, config, overrides


def refuse_unknown_flags(overrides: list[str], command: str) -> None:
    """argparse leaves flags it does not know among the key=value overrides: name them."""
    unknown_flags = [o for o in overrides if o.startswith("-")]
    if unknown_flags:
        raise DufuError(f"unknown option(s) {' '.join(unknown_flags)} for `dufu {command}`; see "
                        f"`dufu {command} --help`.")


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
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="HOST:PORT of the rendezvous of an elastic job (torchrun's c10d rendezvous); with "
                             "--nnodes MIN:MAX nodes may leave and join, the job restarts at the new world size")
    parser.add_argument("--rdzv-id", default=None, help="the job's id at the rendezvous (the same on every node)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="restart a failed job up to N times, resuming from the last complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.train_iter=100 optim.lr=1e-3")
    args, config, overrides = parse_config_args(parser, argv, "train")
    cfg = load_train_config(config, overrides)
    launching = args.nproc is not None and "LOCAL_RANK" not in os.environ
    nnodes = int(str(args.nnodes).split(":")[-1]) if args.nnodes else 1
    world_size = args.nproc * nnodes if launching else int(os.environ.get("WORLD_SIZE", 1))
    notice = os.environ.get("DUFU_PLAN_NOTICE") or resolve_auto(cfg, world_size)  # `auto` layout values
    if launching:
        if notice:  # the workers run the chosen layout, and say why in their start-up summary
            from dufu.plan.auto import resolved_overrides

            overrides = overrides + resolved_overrides(cfg)
            os.environ["DUFU_PLAN_NOTICE"] = notice
        return launch(args, config, overrides, cfg)
    if args.show_config:
        from dufu.config import LazyConfig
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            LazyConfig.save(cfg, os.path.join(d, "config.yaml"))
            print(open(os.path.join(d, "config.yaml")).read())
        return 0
    from dufu.engine.preemption import PREEMPTED_EXIT_CODE
    from dufu.parallel.launch import finish_distributed
    from dufu.engine.trainer import Trainer

    trainer = Trainer(cfg, resume="auto" if args.resume_if_exists else args.resume, notices=[notice] if notice else ())
    trainer.train()
    code = PREEMPTED_EXIT_CODE if trainer.preempted else 0  # a scheduler requeues the job (dufu.engine.preemption)
    finish_distributed(code)
    return code


def resolve_auto(cfg, world_size: int):
    """Let the planner choose the layout values left ``auto`` (dufu.plan.auto), in ``cfg``; returns the start-up
    summary's line about it, or None when the config sets every value (the planner is then not imported)."""
    from dufu.config.overrides import auto_layout_keys

    if not auto_layout_keys(cfg):
        return None
    from dufu.plan.auto import resolve_auto_layout

    return resolve_auto_layout(cfg, world_size)


def launch(args, config, overrides, cfg) -> int:
    """Check the config for the requested world size here, once, then start the workers through torchrun."""
    from dufu.parallel.launch import torchrun_command
    from dufu.engine.preflight import preflight

    nodes = [int(n) for n in str(args.nnodes).split(":")] if args.nnodes else [1]
    nnodes = nodes[-1]
    if args.max_restarts and not cfg.train.checkpointer.get("period"):
        raise DufuError(
            f"--max-restarts {args.max_restarts} with periodic checkpoints turned off "
            f"(train.checkpointer.period={cfg.train.checkpointer.get('period')!r}): a restarted job resumes from the "
            "last checkpoint, and there would be none, so every restart would begin again at step 0. Set "
            "train.checkpointer.period to a number of steps (e.g. train.checkpointer.period=100).")
    resume = True if args.resume else ("auto" if args.max_restarts else False)
    if len(nodes) > 1 and nodes[0] != nodes[-1]:  # elastic: the layout is derived again at every world size
        from dufu.engine.elastic import check_elastic_range

        check_elastic_range(cfg, args.nproc, nodes[0], nodes[-1], resume)
    else:
        preflight(cfg, world_size=args.nproc * nnodes, resume=resume)
    argv = ([config] if config else []) + overrides
    if args.resume or args.max_restarts:
        # A restarted worker group must continue from the last complete checkpoint, not start over.
        argv.append("--resume-if-exists" if not args.resume else "--resume")
    cmd = torchrun_command(args.nproc, argv, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, master_port=args.master_port,
                           max_restarts=args.max_restarts, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                           shutdown_timeout=cfg.train.preemption.get("grace_seconds", 120))
    code = run_torchrun(cmd)
    from dufu.engine.preemption import PREEMPTED_EXIT_CODE, read_marker

    preempted = read_marker(cfg.train.output_dir)
    if code != 0 and preempted is not None:
        print(f"preempted by {preempted['signal']} at step {preempted['step']}: the checkpoint is complete; "
              "continue with --resume", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return code


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
    watcher = _WorkerFailures()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addHandler(watcher)
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
    finally:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").removeHandler(watcher)
    return 0


class _WorkerFailures(logging.Handler):
    """Says in dufu's words which worker died and how, when torchrun's agent sees a worker group fail (before
    it restarts the group under --max-restarts, or gives up)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        import signal

        code, local_rank, pid = record.args[:3]
        how = f"exit code {code}"
        if isinstance(code, int) and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        node = os.environ.get("GROUP_RANK")
        print(f"dufu: worker local rank {local_rank}{f' of node {node}' if node else ''} (pid {pid}) died: {how}",
              file=sys.stderr)


def cmd_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu plan", description="Predict per-device peak memory and step time of a layout, or choose one: "
        "any of train.dist.{data,tensor,pipeline,context,expert}_parallel_size, sequence_parallel, "
        "virtual_pipeline_size, train.train_micro_batch_size, train.zero_optimization.stage, "
        "train.activation_checkpoint.enabled may be auto (train.dist.auto=True: all of them; context and expert "
        "parallelism where the model can take them). See docs/plan.md.")
    parser.add_argument("config", nargs="?", default=None, help="a .py or .yaml config, or a packaged recipe name")
    parser.add_argument("--gpus", type=int, default=1, help="devices (processes) the job runs on (default 1)")
    parser.add_argument("--gpu", default="cpu", help="device type: a100-40gb, a100-80gb, h100-80gb, h200, cpu (this "
                        "machine, measured) or one from --hardware-file (default cpu)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="devices per node (default: the device's, 8 for the GPUs in the catalog)")
    parser.add_argument("--hardware-file", action="append", default=[], metavar="FILE",
                        help="a YAML/JSON file adding devices (also $DUFU_HARDWARE)")
    parser.add_argument("--json", action="store_true", help='print {"layouts": [...], "best": {...}} as JSON')
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw the memory breakdown of the top layouts against the device limit")
    parser.add_argument("--top", type=int, default=10, help="layouts in the table (default 10)")
    parser.add_argument("--remeasure", action="store_true", help="measure this machine's CPU again (--gpu cpu)")
    parser.add_argument("overrides", nargs="*", help="config overrides, as for dufu train")
    args, config, overrides = parse_config_args(parser, argv, "plan")
    if args.gpus < 1:
        raise DufuError(f"--gpus {args.gpus}: give the number of devices the job runs on (1 or more).")
    cfg = load_train_config(config, overrides)
    from dataclasses import replace

    from dufu.plan import get_hardware, search
    from dufu.plan.report import breakdown, plot_memory, table, to_json

    hw = get_hardware(args.gpu, args.hardware_file, remeasure=args.remeasure)
    if args.gpus_per_node:
        hw = replace(hw, devices_per_node=args.gpus_per_node)
    plan = search(cfg, args.gpus, hw)
    if args.json:
        print(to_json(plan, hw))
    elif plan.auto:
        print(f"dufu plan: {args.gpus} x {hw.name}; searched {', '.join(plan.auto)}")
        print(table(plan, top=args.top))
        if plan.best is not None:
            print()
            print(breakdown(plan.best))
    else:
        print(breakdown(plan[0]))
    if args.plot:
        print(f"wrote {plot_memory(plan, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    if plan and plan.best is None:
        from dufu.errors import LayoutError

        closest = plan[0]
        over = closest.memory_per_gpu_bytes - closest.memory_limit_bytes
        what = "the config's layout" if not plan.auto else "no layout fits; the closest"
        raise LayoutError(
            f"{what} ({' '.join(closest.layout_summary().split())}) needs {closest.memory_per_gpu_bytes / 2**30:,.1f} "
            f"GiB per device, {over / 2**30:,.1f} GiB more than the {closest.memory_limit_bytes / 2**30:,.1f} GiB "
            f"{hw.name} leaves for tensors. Use more devices (--gpus), a device with more memory, ZeRO-3 "
            "(train.zero_optimization.stage=3), activation checkpointing, or a smaller micro-batch; or set them "
            "to auto and let dufu plan search."
        )
    if not plan:
        from dufu.errors import LayoutError

        reasons = "; ".join(sorted({why for _, why in plan.rejected})[:3])
        raise LayoutError(f"no layout of {args.gpus} devices is valid for this model: {reasons}")
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
    parser.add_argument("--merge", action="store_true",
                        help="with --to-hf, for a LoRA delta run (written as a PEFT adapter naming its base): write "
                        "the model with the LoRA updates merged into the weights instead")
    args = parser.parse_args(argv)
    from dufu.engine import convert

    if args.merge and not args.to_hf:
        raise DufuError("--merge applies to --to-hf (a LoRA delta run written as the merged model).")
    if args.to_hf:
        out = convert.to_hf(args.checkpoint, args.to_hf, merge=args.merge)
    else:
        out = convert.to_torch(args.checkpoint, args.to_torch)
    print(f"wrote {out}")
    return 0


def cmd_eval(argv: list[str]) -> int:
    from dufu.engine.eval_cli import build_parser

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    refuse_unknown_flags(overrides, "eval")
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        from dufu.engine.delta_run import is_delta_checkpoint
        from dufu.engine.eval_cli import prepare
        from dufu.engine.preflight import preflight
        from dufu.parallel.launch import torchrun_command

        if args.nproc < 1:
            raise DufuError(f"--nproc {args.nproc}: give 1 or more processes.")

        cfg, ckpt, _, _ = prepare(args.source, args.config, overrides, args.nproc)
        preflight(cfg, world_size=args.nproc,  # one clear error, before any worker starts
                  resume=ckpt if ckpt is not None and is_delta_checkpoint(ckpt) else False)
        forwarded = [args.source, *overrides]
        for flag, value in (("--config", args.config), ("--data", args.data), ("--eval-iter", args.eval_iter)):
            if value is not None:
                forwarded += [flag, str(value)]
        forwarded += ["--json"] if args.json else []
        return run_torchrun(torchrun_command(args.nproc, forwarded, command="eval"))
    import json

    from dufu.engine.eval_cli import evaluate_source, format_table
    from dufu.parallel.launch import finish_distributed

    result = evaluate_source(args.source, args.config, overrides, args.data, args.eval_iter)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result, indent=1) if args.json else format_table(result), flush=True)
    finish_distributed(0)
    return 0


def cmd_prune(argv: list[str]) -> int:
    from dufu.engine.prune_cli import main as prune_main

    return prune_main(argv)


def cmd_quantize(argv: list[str]) -> int:
    from dufu.engine.quantize_cli import main as quantize_main

    return quantize_main(argv)


def cmd_lighthouse(argv: list[str]) -> int:
    from dufu.engine.lighthouse_cli import main as lighthouse_main

    return lighthouse_main(argv)


def cmd_generate(argv: list[str]) -> int:
    from dufu.engine.generate_cli import main as generate_main

    return generate_main(argv)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "configs": cmd_configs, "preprocess": cmd_preprocess, "convert": cmd_convert,
            "generate": cmd_generate, "plan": cmd_plan, "prune": cmd_prune, "quantize": cmd_quantize,
            "lighthouse": cmd_lighthouse}


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
