"""`dufu generate CHECKPOINT_OR_HF_DIR --prompt "..."`: continue prompts with a trained or imported model.

The source is either a dufu run (its ``output_dir``, ``output_dir/checkpoints`` or one
``checkpoints/step_N``: the model comes from the checkpoint's ``config.yaml`` and weights, the tokenizer
from ``output_dir/tokenizer.json``) or a Hugging Face directory (``config.json`` + weights +
``tokenizer.json``). Runs in one process; decoding uses a KV cache.

Several prompts (``--prompt`` repeated, ``--prompts-file``) run as one left-padded batch. A causal LM prints
each prompt followed by its continuation; an encoder-decoder (T5) reads the prompt with its encoder, ended
by the end-of-sequence token as T5's tokenizer and dufu's span corruption end every input, and prints what
its decoder generates. With several prompts the results are separated by a blank line.

``--max-new-tokens`` is honoured as transformers' ``generate`` honours ``max_new_tokens``: every token asked for
is generated. Where the prompt and the new tokens pass the model's positions (``max_position_embeddings``), a
notice on stderr says so, and from there on the model sees the last ``max_position_embeddings`` tokens (a window
that slides with every new token; transformers would index past the position table or go on with positions the
model never trained on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dufu.cli import require_package
from dufu.cli.quantize import is_quantized_dir, load_quantized_for_generation
from dufu.config import LazyConfig, instantiate
from dufu.data import build_tokenizer
from dufu.engine.weights.convert import resolve_checkpoint
from dufu.engine.delta_run import is_delta_checkpoint, load_delta_run
from dufu.engine.inference.generate import StopStrings, continuation_text, generate, is_encoder_decoder
from dufu.engine.weights.pretrained import from_pretrained, pretrained_model
from dufu.engine.inference.streaming import load_streaming, parse_bytes
from dufu.errors import DataError
from dufu.models.hub import read_hf_config
from dufu.models.base import contract_of

USAGE_EPILOG = """examples:
  dufu generate output/default --prompt "The "
  dufu generate output/llama_debug/checkpoints/step_0000020 --prompt "A class " --greedy
  dufu generate path/to/hf_dir --prompt "Hello" --max-new-tokens 32 --top-p 0.9
  dufu generate path/to/hf_dir --prompt "Hello" --prompt "Once upon" --num-beams 4 --stop "."
  dufu generate path/to/t5_dir --prompts-file questions.txt --greedy --repetition-penalty 1.2
"""

DEFAULT_TEMPERATURE = 0.8


def load_for_generation(path: str | Path, device: str = "cpu", max_memory: int | None = None, prompts=(),
                        max_new_tokens: int = 0, batch_size: int = 1):
    """(model in eval mode, tokenizer, end-of-text id or None) from a dufu run/checkpoint or an HF directory.
    ``max_memory`` (bytes): keep at most that much of the model's tensors in memory and stream the other blocks
    from the memory-mapped safetensors (:mod:`dufu.engine.inference.streaming`), reserving room for ``batch_size`` rows of
    the longest of ``prompts`` plus ``max_new_tokens``."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a dufu run's output_dir (or one of its checkpoints) or a "
                        "Hugging Face model directory.")
    if is_quantized_dir(path):  # written by `dufu quantize`
        require_package("torchao", "generate")  # its tensors are torchao's
        if max_memory is not None:
            raise DataError(f"{path} is a quantized model directory; --max-memory streams fp32/bf16 safetensors "
                            "of a run or Hugging Face directory. Leave out one of the two.")
        return load_quantized_for_generation(path, device)
    if (path / "config.json").is_file():
        model = from_pretrained(path) if max_memory is None else None
        tokenizer = build_tokenizer("pretrained", path=path)
        eos = read_hf_config(path).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        eos = eos if eos is not None else tokenizer.eod_id
    else:
        ckpt = resolve_checkpoint(path)
        model = None if max_memory is not None else (  # a delta run: its base + the delta
            load_delta_run(ckpt) if is_delta_checkpoint(ckpt) else pretrained_model(ckpt))
        saved = ckpt.parent.parent / "tokenizer.json"  # written by the trainer into output_dir
        if saved.is_file():
            tokenizer = build_tokenizer("pretrained", path=saved)
        else:
            tokenizer = instantiate(LazyConfig.load(str(ckpt / "config.yaml")).tokenization.tokenizer)
        eos = tokenizer.eod_id
    if max_memory is not None:  # stream what does not fit, with room reserved for these prompts
        longest = max((len(tokenizer.encode(p)) for p in prompts), default=0)
        model = load_streaming(path, max_memory, device, batch_size=batch_size,
                               max_tokens=max(1, longest + max_new_tokens))
        print(model.streaming_plan.describe(), file=sys.stderr)
        return model, tokenizer, eos  # on its device already: streamed blocks stay on meta between forwards
    return model.to(device).eval(), tokenizer, eos


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """The epilog as written, and every option's default after its help, unless the help says it already or
    there is none to show (a flag off by default, an empty list, a value that depends on other options)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == [] or default == argparse.SUPPRESS:
            return text  # identity, not `in (None, False)`: a default of 0 is shown
        return f"{text} (default: %(default)s)" if action.option_strings else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dufu generate", description="Continue prompts with a dufu checkpoint or a Hugging Face model (an "
        "encoder-decoder such as T5 prints what it generates from each prompt).",
        epilog=USAGE_EPILOG, formatter_class=HelpWithDefaults,
    )
    parser.add_argument("source", help="a dufu run's output_dir, a checkpoint directory, or a Hugging Face directory")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a text to continue (repeat for several prompts, generated as one batch)")
    parser.add_argument("--prompts-file", metavar="FILE",
                        help="a text file with one prompt per line (empty lines are skipped), after any --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate after each prompt (fewer where a prompt ends with the end-of-text "
                        "token or a --stop text); past the model's positions the model sees the last ones only")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"sampling temperature; 0 is greedy (default: {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the K most likely tokens only (default: all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample among the most likely tokens whose probabilities add up to P (nucleus "
                        "sampling; default: all)")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token (temperature 0)")
    parser.add_argument("--num-beams", type=int, default=1,
                        help="beam search with this many beams (deterministic: no sampling options)")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="beam search: a finished sequence scores sum(log p) / length ** this")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 discourages tokens already in the prompt or the output (CTRL's penalty)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop a prompt's generation once its output contains TEXT, and print the output up "
                        "to it (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--max-memory", default=None, metavar="SIZE",
                        help="hold at most SIZE of the model's tensors (2GB, 512MiB, 1.5G); blocks that do not fit "
                        "are streamed from the memory-mapped safetensors (GPT, LLaMA, Qwen2; docs/inference.md; "
                        "default: the whole model in memory)")
    return parser


def read_prompts(args, parser: argparse.ArgumentParser) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise DataError(f"--prompts-file {path} does not exist or is not a file; give a text file with one "
                            "prompt per line.")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
        if not prompts:
            raise DataError(f"--prompts-file {path} has no prompt: write one prompt per line.")
    if not prompts:
        parser.error("give a prompt: --prompt TEXT (repeatable) or --prompts-file FILE")
    return prompts


def check_args(args, parser: argparse.ArgumentParser) -> None:
    if args.max_new_tokens < 0 or (args.temperature is not None and args.temperature < 0):
        parser.error("--max-new-tokens and --temperature must not be negative")
    if args.num_beams < 1:
        parser.error(f"--num-beams {args.num_beams}: give 1 or more (1 = no beam search)")
    if args.num_beams > 1:
        sampling = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                   ("--top-p", args.top_p)) if v is not None]
        if sampling:
            parser.error(f"--num-beams {args.num_beams} keeps the most likely sequences and samples nothing; "
                         f"drop {', '.join(sampling)} (or use --num-beams 1 to sample)")
    if not args.repetition_penalty > 0:
        parser.error(f"--repetition-penalty {args.repetition_penalty}: give a number > 0 (1 = no penalty)")
    if any(not s for s in args.stop):
        parser.error("--stop needs a non-empty text")


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of different lengths -> (ids, attention_mask), both (B, T), padding on the left."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), T), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            ids[i, T - len(r):] = torch.tensor(r, dtype=torch.long, device=device)
            mask[i, T - len(r):] = 1
    return ids, mask


def context_notice(prompt_tokens: int, max_new_tokens: int, positions: int | None) -> str | None:
    """What happens when the longest prompt and the new tokens need more than the model's ``positions``, or None
    when they fit. The last new token is predicted from ``prompt_tokens + max_new_tokens - 1`` tokens."""
    if positions is None or prompt_tokens + max_new_tokens - 1 <= positions:
        return None
    fits = positions - prompt_tokens + 1  # new tokens predicted with the whole sequence in view
    if fits < 1:
        return (f"the longest prompt has {prompt_tokens} tokens, more than the model's {positions} positions "
                f"(max_position_embeddings): the model sees only its last {positions} tokens, a window that moves "
                f"on with every new token. Shorten the prompt to see all of it.")
    return (f"the longest prompt ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} needs more than the "
            f"model's {positions} positions (max_position_embeddings): after {fits} new tokens the model sees only "
            f"the last {positions} tokens, a window that moves on with every new token (all {max_new_tokens} are "
            f"generated, as transformers' generate honours max_new_tokens). --max-new-tokens {fits} stays within "
            "the positions.")


def generate_texts(model, tokenizer, eos, prompts: list[str], args) -> list[str]:
    """The printed result of each prompt: prompt + continuation (causal LM) or the decoder's output (T5)."""
    seq2seq = is_encoder_decoder(model)
    rows = []
    for text in prompts:
        ids = tokenizer.encode(text)
        if not ids:
            raise DataError(f"the prompt {text!r} is empty after tokenization; give some text.")
        rows.append(ids + [eos] if seq2seq and eos is not None else ids)
    prompt, mask = left_padded(rows, eos if eos is not None else 0, args.device)
    positions = contract_of(model).max_position_embeddings
    notice = None if seq2seq else context_notice(prompt.shape[1], args.max_new_tokens, positions)
    if notice:
        print(f"notice: {notice}", file=sys.stderr)
    stop = StopStrings(tokenizer.decode, args.stop) if args.stop else None
    temperature = 0.0 if args.greedy else (args.temperature if args.temperature is not None else DEFAULT_TEMPERATURE)
    if args.num_beams > 1:
        temperature = 0.0  # check_args refused sampling options; beam search is deterministic
    out = generate(
        model, prompt, args.max_new_tokens, temperature=temperature, top_k=args.top_k, top_p=args.top_p,
        eos_id=eos, attention_mask=mask if not bool(mask.all()) else None,
        max_context=positions,
        generator=torch.Generator(device=args.device).manual_seed(args.seed),
        repetition_penalty=args.repetition_penalty, num_beams=args.num_beams, length_penalty=args.length_penalty,
        stop=stop, pad_id=eos if eos is not None else 0,
    )
    first = 1 if seq2seq else prompt.shape[1]  # after the decoder start token, or after the (padded) prompt
    texts = [continuation_text(row[first:].tolist(), tokenizer.decode, eos, stop) for row in out]
    return texts if seq2seq else [p + t for p, t in zip(prompts, texts)]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    prompts = read_prompts(args, parser)
    max_memory = parse_bytes(args.max_memory) if args.max_memory is not None else None
    model, tokenizer, eos = load_for_generation(args.source, args.device, max_memory=max_memory, prompts=prompts,
                                                max_new_tokens=args.max_new_tokens,
                                                batch_size=len(prompts) * (args.num_beams or 1))
    print("\n\n".join(generate_texts(model, tokenizer, eos, prompts, args)))
    return 0
