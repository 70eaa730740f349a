"""`dufu convert CKPT (--to-hf DIR | --to-torch FILE.pt)`: the command line of :mod:`dufu.engine.weights.convert`, which
writes a sharded checkpoint as a Hugging Face directory or one consolidated file."""

from __future__ import annotations

import argparse

from dufu.errors import DufuError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dufu convert", description="Convert a dufu checkpoint, in one process.")
    parser.add_argument("checkpoint", help="a checkpoint directory (.../checkpoints/step_N) or a run's output_dir")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--to-hf", metavar="DIR", help="write config.json + model.safetensors for transformers")
    group.add_argument("--to-torch", metavar="FILE", help="write one consolidated state dict (torch.save)")
    parser.add_argument("--merge", action="store_true",
                        help="with --to-hf, for a LoRA delta run (written as a PEFT adapter naming its base): write "
                        "the model with the LoRA updates merged into the weights instead")
    args = parser.parse_args(argv)
    from dufu.engine.weights import convert  # imports torch: not for --help

    if args.merge and not args.to_hf:
        raise DufuError("--merge applies to --to-hf (a LoRA delta run written as the merged model).")
    if args.to_hf:
        out = convert.to_hf(args.checkpoint, args.to_hf, merge=args.merge)
    else:
        out = convert.to_torch(args.checkpoint, args.to_torch)
    print(f"wrote {out}")
    return 0
