"""`dufu generate CHECKPOINT_OR_HF_DIR --prompt "..."`: continue a prompt with a trained or imported model.

The source is either a dufu run (its ``output_dir``, ``output_dir/checkpoints`` or one
``checkpoints/step_N``: the model comes from the checkpoint's ``config.yaml`` and weights, the tokenizer
from ``output_dir/tokenizer.json``) or a Hugging Face directory (``config.json`` + weights +
``tokenizer.json``). Runs in one process; decoding uses a KV cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dufu.errors import DataError

USAGE_EPILOG = """examples:
  dufu generate output/default --prompt "The "
  dufu generate output/llama_debug/checkpoints/step_0000020 --prompt "A class " --greedy
  dufu generate path/to/hf_dir --prompt "Hello" --max-new-tokens 32 --top-p 0.9
"""


def load_for_generation(path: str | Path, device: str = "cpu"):
    """(model in eval mode, tokenizer, end-of-text id or None) from a dufu run/checkpoint or an HF directory."""
    from dufu.data import build_tokenizer
    from dufu.engine.pretrained import from_pretrained, pretrained_model
    from dufu.models.hub import read_hf_config

    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a dufu run's output_dir (or one of its checkpoints) or a "
                        "Hugging Face model directory.")
    if (path / "config.json").is_file():
        model = from_pretrained(path)
        tokenizer = build_tokenizer("pretrained", path=path)
        eos = read_hf_config(path).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        eos = eos if eos is not None else tokenizer.eod_id
    else:
        from dufu.config import LazyConfig, instantiate
        from dufu.engine.convert import resolve_checkpoint

        from dufu.engine.delta_run import is_delta_checkpoint, load_delta_run

        ckpt = resolve_checkpoint(path)
        model = load_delta_run(ckpt) if is_delta_checkpoint(ckpt) else pretrained_model(ckpt)  # delta: base + delta
        saved = ckpt.parent.parent / "tokenizer.json"  # written by the trainer into output_dir
        if saved.is_file():
            tokenizer = build_tokenizer("pretrained", path=saved)
        else:
            tokenizer = instantiate(LazyConfig.load(str(ckpt / "config.yaml")).tokenization.tokenizer)
        eos = tokenizer.eod_id
    return model.to(device).eval(), tokenizer, eos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu generate", description="Continue a prompt with a dufu checkpoint or a Hugging Face model.",
        epilog=USAGE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="a dufu run's output_dir, a checkpoint directory, or a Hugging Face directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token (temperature 0)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0:
        parser.error("--max-new-tokens and --temperature must not be negative")

    from dufu.engine.generate import generate

    model, tokenizer, eos = load_for_generation(args.source, args.device)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        parser.error("--prompt is empty after tokenization; give some text")
    prompt = torch.tensor([ids], device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = generate(
        model, prompt, args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k, top_p=args.top_p, eos_id=eos,
        max_context=getattr(model, "max_position_embeddings", None), generator=generator,
    )
    new = out[0, prompt.shape[1]:].tolist()
    if eos is not None and eos in new:
        new = new[:new.index(eos)]
    print(args.prompt + tokenizer.decode(new))
    return 0
