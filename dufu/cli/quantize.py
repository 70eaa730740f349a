"""`dufu quantize RUN_OR_DIR --scheme S --output DIR`: post-training quantization of a trained or imported model.

The source is a dufu run (its ``output_dir``, ``output_dir/checkpoints`` or one ``checkpoints/step_N``: the
model from the checkpoint's ``config.yaml`` and weights) or a Hugging Face directory (``config.json`` +
weights). The model is quantized on the CPU with torchao (:mod:`dufu.compress.quantize`), written with the
source's tokenizer files (:mod:`dufu.compress.quantize_io`), and a summary gives the bytes before and after,
in memory and on disk.

The readers of the written directory live here too, for ``dufu generate`` / ``dufu eval``:
:func:`is_quantized_dir`, :func:`load_quantized` (the model) and :func:`load_quantized_for_generation`
(model, tokenizer, end-of-text id).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dufu.cli import require_package
from dufu.compress.quantize import INT4_GROUP_SIZES, SCHEMES, quantize_model, unique_tensors
from dufu.compress.quantize_io import is_quantized_dir, load_quantized, read_manifest, save_quantized
from dufu.config import LazyConfig, instantiate
from dufu.data import build_tokenizer
from dufu.engine.weights.convert import resolve_checkpoint
from dufu.engine.delta_run import is_delta_checkpoint
from dufu.engine.weights.pretrained import from_pretrained, give_default_mode, pretrained_model
from dufu.errors import DataError, DufuError
from dufu.models.hub import read_hf_config

__all__ = ["main", "load_source", "is_quantized_dir", "load_quantized", "load_quantized_for_generation"]

USAGE_EPILOG = """schemes:
  int8-weight   int8 weights (one scale per output row), float activations
  int8-dynamic  int8 weights and per-token int8 activations, int8 matmuls
  int4-weight   4-bit weights in groups of 32 inputs (CPU only)
The token embedding and the vocabulary head take int8 per row in every scheme; task heads stay fp32.

examples:
  dufu quantize output/default --scheme int8-weight --output output/default-int8
  dufu quantize path/to/hf_dir --scheme int4-weight --output out/int4
"""

# A Hugging Face directory's files that describe its inputs: copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "spiece.model", "tokenizer.model", "added_tokens.json", "preprocessor_config.json",
                   "generation_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def load_source(path: str | Path):
    """``(fp32 model on the CPU, files to copy, source info)`` from a dufu run / checkpoint or an HF directory.
    The info holds the source's weights on disk (``disk_bytes``; for a dufu run, whose checkpoint also holds
    optimizer state, the bytes of the model's tensors) and the end-of-text id for generation."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist. Give a dufu run's output_dir (or one of its checkpoints) or a "
                        "Hugging Face model directory.")
    if is_quantized_dir(path):
        raise DufuError(f"{path} is already quantized ({read_manifest(path)['scheme']}); quantize the run or the "
                        "Hugging Face directory it came from.")
    if (path / "config.json").is_file():
        model = from_pretrained(path)
        files = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
        disk = sum(f.stat().st_size for f in path.iterdir() if f.name in WEIGHT_FILES or
                   (f.name.startswith("model-") and f.suffix == ".safetensors"))
        eos = read_hf_config(path).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if eos is None and (path / "tokenizer.json").is_file():
            eos = _tokenizer_eos(path / "tokenizer.json")
        info = {"kind": "huggingface", "path": str(path.resolve()), "disk_bytes": disk,
                "disk_what": "the source's weight files"}
    else:
        ckpt = resolve_checkpoint(path)
        if is_delta_checkpoint(ckpt):
            raise DufuError(f"{ckpt} is a delta run (LoRA, adapters ...); quantize the merged model: `dufu convert "
                            f"{path} --to-hf DIR --merge`, then `dufu quantize DIR ...`.")
        model = pretrained_model(ckpt)
        files, eos = [], None
        saved = ckpt.parent.parent / "tokenizer.json"  # written by the trainer into output_dir
        if saved.is_file():
            files, eos = [saved], _tokenizer_eos(saved)
        keys = set(model.state_dict())  # persistent tensors, a tied head once
        disk = sum(t.numel() * t.element_size() for k, t in unique_tensors(model).items() if k in keys)
        info = {"kind": "dufu checkpoint", "path": str(ckpt.resolve()), "disk_bytes": disk,
                "disk_what": "fp32 tensors; the checkpoint also holds optimizer state",
                "config_yaml": str(ckpt / "config.yaml")}
    info["eos_token_id"] = eos
    return model.cpu().eval(), files, info


def _tokenizer_eos(file: Path):
    return build_tokenizer("pretrained", path=file).eod_id


def _config_tokenizer(ckpt_config: Path, out: Path):
    """A run whose output_dir has no tokenizer.json: build its config's tokenizer and save it into ``out``
    (vision runs have none). Returns the end-of-text id, or None."""
    tokenization = LazyConfig.load(str(ckpt_config)).get("tokenization")
    node = tokenization.get("tokenizer") if tokenization is not None else None
    if node is None:
        return None
    tokenizer = instantiate(node)
    tokenizer.save(out / "tokenizer.json")
    return tokenizer.eod_id


def load_quantized_for_generation(path: str | Path, device: str = "cpu"):
    """(quantized model in eval mode, tokenizer, end-of-text id or None) from a ``dufu quantize`` directory."""
    path = Path(path)
    manifest = read_manifest(path)
    if not (path / "tokenizer.json").is_file():
        raise DataError(f"{path} has no tokenizer.json (its source had none: an image model?), so it cannot "
                        "generate text.")
    model = load_quantized(path)
    if device != "cpu" and manifest["scheme"] == "int4-weight":
        raise DufuError("int4-weight models run on the CPU only (torchao's CPU int4 format); use --device cpu.")
    tokenizer = build_tokenizer("pretrained", path=path)
    eos = manifest.get("source", {}).get("eos_token_id")
    return model.to(device).eval(), tokenizer, eos if eos is not None else tokenizer.eod_id


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def summary_lines(out: Path) -> list[str]:
    """The summary of a written directory, from its manifest."""
    m = read_manifest(out)
    mem, src = m["bytes_in_memory"], m["source"]
    vocab = set(m.get("vocab_tables", []))
    layers = {k for n, k in m["quantized"].items() if n not in vocab}
    n_layers = len(m["quantized"]) - len(vocab)
    weights_file = out / m["weights"]
    lines = [
        f"quantized {m['dufu_class']} from {src.get('path')} with {m['scheme']}"
        + (f" (groups of {m['group_size']})" if m.get("group_size") else "") + f" -> {out}",
        f"  quantized     {n_layers} linear layers ({', '.join(sorted(layers))}); "
        f"{', '.join(sorted(vocab)) or 'no vocabulary table'} as Int8Tensor per row"
        + "".join(f"; {a} is {b}" for a, b in m["tied"].items()),
        f"  kept as is    {', '.join(m['kept']) or 'no table or head'}; all norms, biases and convolutions",
        f"  in memory     {_mb(mem['before'])} -> {_mb(mem['after'])} ({_pct(mem['after'], mem['before'])}); "
        f"quantized weights {_mb(mem['quantized_weights_before'])} -> {_mb(mem['quantized_weights_after'])} "
        f"({_pct(mem['quantized_weights_after'], mem['quantized_weights_before'])})",
        f"  on disk       {_mb(src['disk_bytes'])} ({src['disk_what']}) -> {_mb(weights_file.stat().st_size)} "
        f"{m['weights']} ({_pct(weights_file.stat().st_size, src['disk_bytes'])}); directory "
        f"{_mb(sum(f.stat().st_size for f in out.iterdir() if f.is_file()))}",
        "  loads with    dufu (dufu.cli.quantize.load_quantized)"
        + ("; transformers AutoModel.from_pretrained (torchao quantization_config)" if m["transformers_loads"]
           else f"; not transformers: {m['why_not_transformers']}"),
    ]
    lines += [f"  note          {n}" for n in m.get("notes", [])]
    return lines


def quantize_to(source: str | Path, scheme: str, output: str | Path, group_size: int | None = None) -> Path:
    """Load ``source``, quantize it with ``scheme``, write ``output``; returns the output directory."""
    require_package("torchao", "quantize")  # before the model is loaded
    out = Path(output)
    if out.exists() and any(out.iterdir()) and not is_quantized_dir(out):
        raise DufuError(f"{out} exists and is not a quantized model directory; give an empty or new --output.")
    if scheme not in SCHEMES:  # before loading anything
        raise DufuError(f"unknown quantization scheme {scheme!r}; the schemes are {', '.join(SCHEMES)}.")
    model, files, info = load_source(source)
    quantize_model(model, scheme, group_size)
    out.mkdir(parents=True, exist_ok=True)
    if info["kind"] == "dufu checkpoint" and not files:
        info["eos_token_id"] = _config_tokenizer(Path(info["config_yaml"]), out)
    save_quantized(model, scheme, info, out, extra_files=files)
    give_default_mode(out / read_manifest(out)["weights"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dufu quantize", description="Quantize a dufu run or a Hugging Face model with torchao (CPU).",
        epilog=USAGE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="a dufu run's output_dir, a checkpoint directory, or a Hugging Face directory")
    parser.add_argument("--scheme", required=True, choices=SCHEMES, help="how to quantize (see below)")
    parser.add_argument("--output", required=True, help="the directory to write")
    parser.add_argument("--group-size", type=int, default=None, choices=INT4_GROUP_SIZES,
                        help="int4-weight only: inputs per scale (default 32)")
    args = parser.parse_args(argv)
    with torch.no_grad():
        out = quantize_to(args.source, args.scheme, args.output, args.group_size)
    print("\n".join(summary_lines(out)))
    return 0

