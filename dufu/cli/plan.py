"""`dufu plan [CONFIG] --gpus N --gpu NAME [key=value ...]`: print the predicted per-device memory and step time of
the config's layout, or rank the layouts that fit when some of its values are ``auto`` (the work is dufu.plan's)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dufu.cli.config_args import load_train_config, parse_config_args
from dufu.errors import DufuError, LayoutError


def main(argv: list[str]) -> int:
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
    from dufu.plan import get_hardware, search  # imports torch: not for --help or a config error
    from dufu.plan.report import breakdown, plot_memory, table, to_json  # as above

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
        reasons = "; ".join(sorted({why for _, why in plan.rejected})[:3])
        raise LayoutError(f"no layout of {args.gpus} devices is valid for this model: {reasons}")
    return 0
