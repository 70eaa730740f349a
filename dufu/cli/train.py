"""`dufu train [CONFIG] [--nproc N] [key=value ...]`: load the config, let the planner fill the layout values left
``auto``, then train in this process or check the config once and start the workers through torchrun."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

from dufu.cli.config_args import load_train_config, parse_config_args
from dufu.cli.workers import start_worker_server
from dufu.config import LazyConfig
from dufu.errors import DufuError

# The imports inside the functions below all import torch (about 2 s): `dufu train --help`, --show-config and a
# config error answer without it, and the launcher imports the checks it runs, not the trainer.


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu train", description="Train a model from a config. Started by srun (a Slurm job step), it reads the "
        "launch from Slurm: one task per node runs dufu's launcher (--nproc: the node's GPUs), one task per GPU runs "
        "one process each; the options below, when given, win over Slurm's values (docs/cluster.md).")
    parser.add_argument("config", nargs="?", default=None,
                        help="a .py or .yaml config, or a packaged recipe name (see `dufu configs`); default: default")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.output_dir")
    parser.add_argument("--resume-if-exists", action="store_true",
                        help="resume when train.output_dir holds a checkpoint, else start fresh (used for restarts)")
    parser.add_argument("--resume-step", type=int, default=None, metavar="N",
                        help="continue from the step-N checkpoint of train.output_dir (e.g. when a newer one is "
                             "damaged); later checkpoints there are moved aside")
    parser.add_argument("--resume-from", default=None, metavar="CHECKPOINT_DIR",
                        help="continue from this checkpoint directory (e.g. RUN/checkpoints/step_0000100), possibly "
                             "of another run, writing to train.output_dir")
    parser.add_argument("--override-saved", action="append", default=[], metavar="KEY",
                        help="on resume, let KEY (or a group, e.g. train.scheduler) differ from the saved run: the "
                             "learning-rate schedule (train.train_iter, train.scheduler.*, optim.lr), the global batch "
                             "(train.global_batch_size) or the data (train.seed, dataloader.*, tokenization.*), "
                             "which a resume otherwise refuses to change; repeatable")
    parser.add_argument("--show-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                        help="processes per node; dufu starts them through torchrun (under srun with one task per "
                             "node: default the node's GPUs)")
    parser.add_argument("--nnodes", default=None, help="number of nodes (torchrun --nnodes; under srun: the step's)")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank (torchrun --node-rank; under srun: SLURM_NODEID)")
    parser.add_argument("--master-addr", default=None,
                        help="address of node 0 (torchrun --master-addr; under srun: MASTER_ADDR, else the first "
                             "host of the step's node list)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0 (torchrun --master-port; under srun: MASTER_PORT, else 20000 + the job "
                             "id %% 20000)")
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="HOST:PORT of the rendezvous of an elastic job (torchrun's c10d rendezvous); with "
                             "--nnodes MIN:MAX nodes may leave and join, the job restarts at the new world size")
    parser.add_argument("--rdzv-id", default=None, help="the job's id at the rendezvous (the same on every node)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="restart a failed job up to N times, resuming from the last complete checkpoint")
    parser.add_argument("--dry-run", action="store_true",
                        help="rehearse the run on this machine, with no GPU: build the ranks' parts of the layout for "
                             "--world-size processes on the meta device and report what each holds and every "
                             "collective it issues, beside `dufu plan`'s prediction (see docs/plan.md)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N", help="--dry-run: processes of the run")
    parser.add_argument("--rank", type=int, action="append", default=None, metavar="R",
                        help="--dry-run: the rank to build (repeatable; default: first and last pipeline ranks)")
    parser.add_argument("--json", action="store_true", help='--dry-run: print {"ranks": [...]} as JSON')
    parser.add_argument("--gpu", default="h100-80gb",
                        help="--dry-run: the device the planner's activation estimate is for (default h100-80gb)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.train_iter=100 optim.lr=1e-3")
    args, config, overrides = parse_config_args(parser, argv, "train")
    check_resume_options(args)
    slurm_notice = from_slurm(args)  # under srun: the launch Slurm's environment describes
    if args.nproc is not None and "LOCAL_RANK" not in os.environ and not (args.dry_run or args.show_config):
        # the workers' imports start now, beside this process's own and its checks (dufu.cli.workers)
        if slurm_notice:
            # Slurm signals every process of a step (srun forwards USR1 to the whole process tree), the fork
            # server too, whose death would reach the workers as SIGINT (torch sets it as their parent-death
            # signal) and make them abandon the save that USR1 asked for. The server inherits an ignored signal
            # (it survives exec); the workers install their own handler for it (dufu.engine.resilience.preemption).
            with _ignored(signal.SIGUSR1):
                start_worker_server(args.nproc)
        else:
            start_worker_server(args.nproc)
    cfg = load_train_config(config, overrides)
    if args.dry_run or args.world_size is not None or args.rank or args.json:
        from dufu.plan.rehearsal import dry_run  # imports torch: not for --help

        return dry_run(cfg, args.dry_run, args.world_size, args.rank, args.json, args.gpu, resume_request(args))
    launching = args.nproc is not None and "LOCAL_RANK" not in os.environ
    nnodes = int(str(args.nnodes).split(":")[-1]) if args.nnodes else 1
    world_size = args.nproc * nnodes if launching else int(os.environ.get("WORLD_SIZE", 1))
    notice = os.environ.get("DUFU_PLAN_NOTICE") or resolve_auto(cfg, world_size)  # `auto` layout values
    if launching:
        if notice:  # the workers run the chosen layout, and say why in their start-up summary
            from dufu.plan.auto import resolved_overrides  # imports torch: not for --help

            overrides = overrides + resolved_overrides(cfg)
            os.environ["DUFU_PLAN_NOTICE"] = notice
        return launch(args, config, overrides, cfg)
    if args.show_config:
        with tempfile.TemporaryDirectory() as d:
            LazyConfig.save(cfg, os.path.join(d, "config.yaml"))
            print(open(os.path.join(d, "config.yaml")).read())
        return 0
    from dufu.engine.resilience.preemption import exit_code  # imports torch: not for --help
    from dufu.engine.trainer import Trainer  # imports torch: not for --help
    from dufu.parallel.launch import finish_distributed  # imports torch: not for --help

    trainer = Trainer(cfg, resume=resume_request(args), notices=[n for n in (slurm_notice, notice) if n],
                      memory_plan=memory_plan(cfg, world_size) if cfg.train.plan_memory else None)
    trainer.train()
    # a scheduler requeues a preempted job; Ctrl-C is a person's stop (dufu.engine.resilience.preemption)
    code = exit_code(trainer.preempted) if trainer.preempted else 0
    finish_distributed(code)
    return code


@contextlib.contextmanager
def _ignored(sig):
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, previous)


def from_slurm(args) -> str | None:
    """In a task that ``srun`` started (dufu.parallel.slurm): make this task its node's launcher (``--nproc``,
    ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port`` filled in from Slurm where not given) or one
    process of the run (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set from
    Slurm), and say which on stderr (once per job: task 0, or node 0's launcher). Returns that line for the
    start-up summary, or None when this is no Slurm step's task: outside Slurm, in a batch or salloc shell (no
    ``SLURM_STEP_ID``), in a worker torchrun started (``LOCAL_RANK`` set), or for --show-config / --dry-run."""
    if (os.environ.get("SLURM_STEP_ID") is None or "LOCAL_RANK" in os.environ or args.show_config or args.dry_run
            or args.world_size is not None or args.rank or args.json):
        return None
    from dufu.parallel.slurm import SlurmError, plan_launch, read_step  # imports torch (dufu.parallel): srun only

    step = read_step()
    if step is None:
        return None
    plan = plan_launch(step, args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    if plan.mode == "process":
        for flag, value in (("--max-restarts", args.max_restarts), ("--rdzv-endpoint", args.rdzv_endpoint)):
            if value is not None:
                raise SlurmError(
                    f"{flag} with one process per Slurm task: there is no torchrun agent to restart or re-form the "
                    f"group. Give srun one task per node (--ntasks-per-node=1) and dufu's launcher uses {flag}; "
                    "or let Slurm requeue the job (dufu slurm ... writes such a job script).")
        os.environ.update(plan.worker_env())
    elif plan.world_size > 1:
        args.nproc, args.node_rank = plan.nproc_per_node, plan.node_rank
        args.nnodes = args.nnodes if args.nnodes is not None else str(plan.nnodes)
        if args.rdzv_endpoint is None:  # an elastic rendezvous names its own host and port
            args.master_addr, args.master_port = plan.master_addr, plan.master_port
    line = plan.describe()
    if (plan.rank if plan.mode == "process" else plan.node_rank) == 0:
        print(f"dufu: {line}", file=sys.stderr, flush=True)
    return line


def check_resume_options(args) -> None:
    """The resume options make sense together (before the config is loaded: nothing else depends on them)."""
    if args.resume_step is not None and args.resume_from is not None:
        raise DufuError("--resume-step and --resume-from both name a checkpoint to resume; give one of them.")
    if args.resume_step is not None and args.resume_step < 0:
        raise DufuError(f"--resume-step {args.resume_step}: a step is a non-negative number, e.g. --resume-step 100.")
    named = "--resume-step" if args.resume_step is not None else "--resume-from" if args.resume_from else None
    if named and args.max_restarts:
        raise DufuError(
            f"{named} with --max-restarts: a restarted job would begin again at that checkpoint, not at its own "
            f"latest. Start from it once without --max-restarts; continue with --resume --max-restarts "
            f"{args.max_restarts}.")
    if args.override_saved and not (args.resume or args.resume_if_exists or named or args.max_restarts):
        raise DufuError(f"--override-saved {' '.join(args.override_saved)} applies to a resume: add --resume (or "
                        "--resume-step N / --resume-from CHECKPOINT_DIR).")


def resume_request(args, restarts: bool = False):
    """False (a new run) or the ResumeRequest the options make: ``--resume-if-exists`` (and a job that
    ``restarts``) takes the newest checkpoint when there is one, else starts at step 0."""
    if_exists = (args.resume_if_exists or restarts) and not args.resume
    if not (args.resume or if_exists or args.resume_step is not None or args.resume_from):
        return False
    from dufu.engine.weights.resume_checks import ResumeRequest  # imports torch: not for --help

    return ResumeRequest(if_exists=if_exists, step=args.resume_step,
                         path=Path(args.resume_from).absolute() if args.resume_from else None,
                         override_saved=tuple(args.override_saved))


def resume_flags(args) -> list[str]:
    """The resume options as the workers get them (and a restarted worker group again)."""
    flags = []
    if args.resume or args.resume_step is not None or args.resume_from:
        flags.append("--resume")
    elif args.max_restarts:  # a restarted worker group continues from the last complete checkpoint
        flags.append("--resume-if-exists")
    if args.resume_step is not None:
        flags += ["--resume-step", str(args.resume_step)]
    if args.resume_from:
        flags += ["--resume-from", str(os.path.abspath(args.resume_from))]
    for key in args.override_saved:
        flags += ["--override-saved", key]
    return flags


def resolve_auto(cfg, world_size: int):
    """Let the planner choose the layout values left ``auto`` (dufu.plan.auto), in ``cfg``; returns the start-up
    summary's line about it, or None when the config sets every value (the planner is then not imported)."""
    from dufu.engine.schema import auto_layout_keys  # imports torch: not for --help

    if not auto_layout_keys(cfg):
        return None
    from dufu.plan.auto import resolve_auto_layout  # imports torch: not for --help

    return resolve_auto_layout(cfg, world_size)


def launch(args, config, overrides, cfg) -> int:
    """Check the config for the requested world size here, once, then start the workers through torchrun."""
    from dufu.cli.torchrun import run_torchrun  # imports torch: not for --help
    # imports torch: not for --help
    from dufu.engine.resilience.preemption import exit_code, read_marker, resume_command
    from dufu.engine.preflight import preflight  # imports torch: not for --help
    from dufu.parallel.launch import torchrun_command  # imports torch: not for --help

    nodes = [int(n) for n in str(args.nnodes).split(":")] if args.nnodes else [1]
    nnodes = nodes[-1]
    if args.max_restarts and not cfg.train.checkpointer.period:
        raise DufuError(
            f"--max-restarts {args.max_restarts} with periodic checkpoints turned off "
            f"(train.checkpointer.period={cfg.train.checkpointer.period!r}): a restarted job resumes from the "
            "last checkpoint, and there would be none, so every restart would begin again at step 0. Set "
            "train.checkpointer.period to a number of steps (e.g. train.checkpointer.period=100).")
    resume = resume_request(args, restarts=bool(args.max_restarts))
    if len(nodes) > 1 and nodes[0] != nodes[-1]:  # elastic: the layout is derived again at every world size
        from dufu.engine.resilience.elastic import check_elastic_range  # imports torch: not for --help

        check_elastic_range(cfg, args.nproc, nodes[0], nodes[-1], resume)
    else:
        preflight(cfg, world_size=args.nproc * nnodes, resume=resume)
    # A restarted worker group must continue from the last complete checkpoint, not start over.
    argv = ([config] if config else []) + overrides + resume_flags(args)
    cmd = torchrun_command(args.nproc, argv, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, master_port=args.master_port,
                           max_restarts=args.max_restarts, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                           shutdown_timeout=cfg.train.preemption.grace_seconds)
    code = run_torchrun(cmd)
    preempted = read_marker(cfg.train.output_dir)
    if code != 0 and preempted is not None:
        # the job as it was started: --nproc N and the other launcher options
        again = resume_command(cfg.train.output_dir, args.nproc, launcher_args(args))
        print(f"stopped by {preempted['signal']} at step {preempted['step']}: the checkpoint is complete; "
              f"continue with: {again}", file=sys.stderr)
        return exit_code(preempted["signal"])
    return code


def launcher_args(args) -> list[str]:
    """The launcher options given besides --nproc (--nnodes 2 --master-addr node0 ...), as a command line."""
    names = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id", "max_restarts")
    return [item for name in names if getattr(args, name) is not None
            for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def memory_plan(cfg, world_size: int):
    """The planner's peak memory for this run, as the start-up summary and the end summary show it beside the
    measured one: a function of the precision the run chose (dufu.engine.reporting.memory.planned_memory)."""
    import functools

    from dufu.engine.reporting.memory import planned_memory  # imports torch: not for --help
    from dufu.parallel.env import pick_device
    from dufu.plan.search import estimate_peak_memory

    peak = functools.partial(estimate_peak_memory, device_type=pick_device().type)
    return functools.partial(planned_memory, cfg, world_size, peak)
