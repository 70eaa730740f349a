"""The directory of a quantized model: ``save_quantized``, ``load_quantized``, ``is_quantized_dir``.

A directory holds

* ``config.json`` -- the model's Hugging Face config (the family's mapping, as ``dufu.save_pretrained``
  writes it): what rebuilds the dufu model;
* the weights, in one of two forms:

  - ``model.safetensors`` with transformers' names, in the layout transformers itself writes for a torchao
    model (``torchao.prototype.safetensors.flatten_tensor_state_dict``: each quantized tensor stored as its
    inner tensors, ``<module>._weight_qdata`` / ``_weight_scale`` ..., its type and attributes in the file's
    metadata), and ``config.json`` carries a ``quantization_config`` of ``quant_method: torchao``.
    ``transformers.AutoModel*.from_pretrained(DIR)`` loads it as a quantized model with the same logits;
  - ``dufu_model.safetensors`` (same torchao layout) or ``dufu_model.pt`` (``torch.save``, loadable with
    ``weights_only=True``) with dufu's tensor names, where transformers cannot load the model (see
    :func:`transformers_layout_problem`); ``config.json`` then has no ``quantization_config``, so
    transformers fails at once ("no model.safetensors") instead of building a wrong model;

* ``dufu_quantization.json`` -- the manifest: scheme, group size, int8-dynamic's ``reduce_range``,
  torchao/torch versions, the weights file and its naming, which modules are quantized to which torchao type
  and which kept in full precision (and why), the tied parameters, bytes, and where the model came from;
* the source's tokenizer files (``tokenizer.json`` ...), copied by the caller (:mod:`dufu.cli.quantize`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from dufu.compress.quantize import (
    VOCAB_HEAD,
    QuantizationError,
    QuantizationInfo,
    check_int8_matmuls,
    is_quantized_tensor,
    run_int4_in_bf16,
    torchao_config,
    vocab_config,
)
from dufu.errors import CheckpointError, DataError
from dufu.layers import VocabEmbedding
from dufu.models.base import contract_of
from dufu.models.hub import adapter_for_model, build_from_hf_config, read_hf_config

MANIFEST = "dufu_quantization.json"
FORMAT = "dufu-quantized"
VERSION = 1
HF_WEIGHTS = "model.safetensors"
DUFU_SAFETENSORS = "dufu_model.safetensors"
DUFU_TORCH = "dufu_model.pt"


def is_quantized_dir(path) -> bool:
    """True when ``path`` is a directory written by :func:`save_quantized` (it holds the manifest)."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


# Families whose quantized directory transformers (5.24) cannot load, and why; the others (LLaMA / Qwen2,
# BERT / RoBERTa, T5) load with transformers' own torchao integration, tested in tests/compress/test_quantize.py.
TRANSFORMERS_CANNOT_LOAD = {
    "gpt2": "transformers' GPT-2 keeps q|k|v fused in one Conv1D (c_attn) and every projection transposed as "
            "(in, out); a quantized tensor cannot be concatenated or transposed into them, and Conv1D is not an "
            "nn.Linear that its torchao loader handles",
    "vit": "transformers 5 renames ViT's checkpoint keys on load (attention.attention.query -> attention.q_proj) "
           "and its torchao deserializer then looks the quantized tensors up under the new names, which the "
           "file's torchao metadata does not hold",
    "swin": "transformers 5 renames Swin's checkpoint keys on load (attention.self.query -> attention.q_proj) and "
            "its torchao deserializer then looks the quantized tensors up under the new names, which the file's "
            "torchao metadata does not hold",
}
INT4_CANNOT_LOAD = ("torchao 0.18 can neither write the CPU int4 tensor (Int4OpaqueTensor) to safetensors nor name "
                    "its config (torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig) in a "
                    "transformers quantization_config, and its other int4 formats need GPU kernels")


def transformers_layout_problem(model: nn.Module, scheme: str) -> Optional[str]:
    """Why transformers cannot load ``model`` quantized with ``scheme``, or None when it can."""
    if scheme == "int4-weight":
        return INT4_CANNOT_LOAD
    ad = adapter_for_model(model)
    if ad.model_type in TRANSFORMERS_CANNOT_LOAD:
        return TRANSFORMERS_CANNOT_LOAD[ad.model_type]
    if ad.transforms:
        return f"transformers' {ad.model_type} stores some weights fused or transposed, which a quantized tensor cannot be"
    return None


def _torchao_safetensors_types() -> set[str]:
    # here, not at the top: torchao is optional
    from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES

    return set(ALLOWED_TENSORS_SUBCLASSES)


def _hf_module(ad, model: nn.Module, module_name: str) -> str:
    return ad.hf_names(f"{module_name}.weight", model, ad.save_prefix(model))[0].rpartition(".")[0]


def _quantization_config(ad, model: nn.Module, info: QuantizationInfo) -> dict:
    """``config.json``'s ``quantization_config``: what ``transformers.TorchAoConfig(...).to_dict()`` gives for the
    same plan (written with torchao's own ``config_to_dict``, so saving needs no transformers). Every module is
    named with its own config (torchao deprecates the ``_default`` key): the scheme's for the network's linear
    layers, int8 per row for the embedding and the vocabulary head, None for the task heads kept as they are."""
    # here, not at the top: torchao is optional
    from torchao.core.config import config_to_dict
    from torchao.quantization import FqnToConfig  # as above

    fqn = {}
    for name in info.quantized:
        config = (vocab_config() if _is_vocab(model, name) else
                  torchao_config(info.scheme, info.group_size, info.reduce_range))
        fqn[_hf_module(ad, model, name)] = config
    kept = [_hf_module(ad, model, n) for n in info.kept if isinstance(model.get_submodule(n), nn.Linear)]
    fqn.update({name: None for name in kept})
    return {"quant_method": "torchao", "quant_type": {"default": config_to_dict(FqnToConfig(fqn))},
            "modules_to_not_convert": kept or None, "include_input_output_embeddings": True,
            "untie_embedding_weights": False}


def _is_vocab(model: nn.Module, name: str) -> bool:
    return name == VOCAB_HEAD or isinstance(model.get_submodule(name), VocabEmbedding)


def _architecture(ad, model: nn.Module) -> str:
    return ad.config_to_hf(model)["architectures"][0]


@torch.no_grad()
def save_quantized(model: nn.Module, scheme: str, source_info: dict, out_dir, extra_files: Iterable = ()) -> Path:
    """Write ``model`` (quantized by :func:`dufu.compress.quantize.quantize_model` with ``scheme``) to
    ``out_dir`` (see the module docstring); ``source_info``: where it came from, kept in the manifest;
    ``extra_files``: files copied as they are (the tokenizer's)."""
    info: Optional[QuantizationInfo] = contract_of(model).quantization_info
    if info is None:
        raise QuantizationError("the model is not quantized; run dufu.compress.quantize.quantize_model first.")
    if info.scheme != scheme:
        raise QuantizationError(f"the model was quantized with {info.scheme}, not {scheme}.")
    ad = adapter_for_model(model)
    hf_config = ad.config_to_hf(model)
    sd = {k: v for k, v in model.state_dict().items() if k not in info.tied}  # a tied alias is its twin's tensor
    problem = transformers_layout_problem(model, scheme)
    if problem is None:
        tensors = ad.state_dict_to_hf(sd, model)
        if hf_config.get("tie_word_embeddings", False):
            for k in ad.tied_hf_names(model):
                tensors.pop(k, None)
        hf_config["quantization_config"] = _quantization_config(ad, model, info)
    else:
        tensors = sd
    types = {type(t).__name__ for t in tensors.values() if is_quantized_tensor(t)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (HF_WEIGHTS, DUFU_SAFETENSORS, DUFU_TORCH):
        (out / stale).unlink(missing_ok=True)
    if types <= _torchao_safetensors_types():
        # here, not at the top: torchao is optional
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

        flat, metadata = flatten_tensor_state_dict(tensors)
        weights = HF_WEIGHTS if problem is None else DUFU_SAFETENSORS
        save_file({k: v.contiguous() for k, v in flat.items()}, str(out / weights),
                  metadata={"format": "pt", **metadata})
    else:  # torchao's safetensors support does not cover these types (the CPU int4 tensor): torch.save
        weights = DUFU_TORCH
        torch.save(tensors, out / weights)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    for f in extra_files:
        shutil.copyfile(f, out / Path(f).name)
    import torchao  # here, not at the top: torchao is optional

    manifest = {
        "format": FORMAT, "version": VERSION, "scheme": scheme, "group_size": info.group_size,
        "reduce_range": info.reduce_range,
        "torchao": torchao.__version__, "torch": torch.__version__,
        "model_type": ad.model_type, "architecture": _architecture(ad, model), "dufu_class": type(model).__name__,
        "weights": weights, "names": "transformers" if problem is None else "dufu",
        "transformers_loads": problem is None, "why_not_transformers": problem,
        "quantized": info.quantized, "vocab_tables": [n for n in info.quantized if _is_vocab(model, n)],
        "kept": info.kept, "tied": info.tied, "notes": info.notes,
        "bytes_in_memory": {"before": info.bytes_before, "after": info.bytes_after,
                            "quantized_weights_before": info.linear_bytes_before,
                            "quantized_weights_after": info.linear_bytes_after},
        "bytes_on_disk": (out / weights).stat().st_size,
        "source": source_info,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    return out


def read_manifest(path) -> dict:
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise DataError(f"{path} is not a quantized model directory: it has no {MANIFEST}. Write one with "
                        "`dufu quantize RUN_OR_DIR --scheme int8-weight --output DIR`.")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); write the directory again with dufu quantize.") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{file} is not a {FORMAT} manifest of version {VERSION} (format "
                              f"{manifest.get('format')!r}, version {manifest.get('version')!r}); write the "
                              "directory again with this dufu's `dufu quantize`.")
    return manifest


def _read_weights(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    file = path / manifest["weights"]
    if not file.is_file():
        raise CheckpointError(f"{path} lacks {manifest['weights']}, which its {MANIFEST} names; write the "
                              "directory again with dufu quantize.")
    if file.suffix == ".pt":
        try:  # torchao registers its tensor types as safe globals, so weights_only loading works
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {e}); write it again with dufu "
                                  f"quantize (torchao {manifest.get('torchao')} wrote it).") from None
    # here, not at the top: torchao is optional
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata() or {}
    tensors, leftover = unflatten_tensor_state_dict(load_file(str(file)), metadata)
    if leftover:
        raise CheckpointError(f"{file} holds tensors its torchao metadata does not describe: {sorted(leftover)[:4]}.")
    return tensors


def _stored_names(model: nn.Module, manifest: dict) -> tuple[dict[str, str], list[str]]:
    """For each of the model's state-dict names, the name it is stored under; and the regexes of names the
    file may lack (recomputed on load, e.g. rotary tables that transformers does not save)."""
    keys = list(model.state_dict())
    if manifest["names"] == "dufu":
        return {k: k for k in keys}, []
    ad = adapter_for_model(model)
    prefix = ad.save_prefix(model)
    return {k: ad.hf_names(k, model, prefix)[0] for k in keys if ad.hf_names(k, model, prefix)}, list(ad.not_saved)


@torch.no_grad()
def load_quantized(path) -> nn.Module:
    """The quantized model a :func:`save_quantized` directory holds, in eval mode on the CPU, with
    ``quantization_info``. It is built on the meta device from config.json and given the stored tensors as
    they are (no re-quantization); only what the file lacks by design (tables recomputed from the config)
    is allocated and initialised by the family's own rule. int8-dynamic weights of the full int8 range are
    refused on a CPU whose int8 matmul saturates with them (:func:`dufu.compress.quantize.check_int8_matmuls`)."""
    path = Path(path)
    manifest = read_manifest(path)
    with torch.device("meta"):
        model = build_from_hf_config(read_hf_config(path), manifest["architecture"])
    stored = _read_weights(path, manifest)
    names, may_lack = _stored_names(model, manifest)
    tied = manifest.get("tied", {})
    values, missing = {}, []
    for key in model.state_dict():
        if key in tied:
            continue
        where = names.get(key)
        if where in stored:
            values[key] = stored[where]
        elif not any(re.search(p, key) for p in may_lack):
            missing.append(key)
    if missing:
        raise CheckpointError(f"{path / manifest['weights']} lacks {', '.join(missing[:4])} of the "
                              f"{manifest['dufu_class']} its config.json describes; write the directory again.")
    _fill(model, values, set(tied))
    for name, kind in manifest["quantized"].items():
        if kind == "Int4OpaqueTensor":
            run_int4_in_bf16(model.get_submodule(name))
    for alias, owner in tied.items():
        owner_module, _, owner_attr = owner.rpartition(".")
        alias_module, _, alias_attr = alias.rpartition(".")
        setattr(model.get_submodule(alias_module), alias_attr, getattr(model.get_submodule(owner_module), owner_attr))
    model.eval()
    check_int8_matmuls(model)
    model.quantization_info = QuantizationInfo(
        scheme=manifest["scheme"], group_size=manifest.get("group_size"), quantized=manifest["quantized"],
        reduce_range=manifest.get("reduce_range"),
        kept=manifest["kept"], tied=tied, notes=manifest.get("notes", []),
        bytes_before=manifest["bytes_in_memory"]["before"], bytes_after=manifest["bytes_in_memory"]["after"],
        linear_bytes_before=manifest["bytes_in_memory"]["quantized_weights_before"],
        linear_bytes_after=manifest["bytes_in_memory"]["quantized_weights_after"])
    return model


def _fill(model: nn.Module, values: dict[str, torch.Tensor], tied: set[str]) -> None:
    """Give each module of the meta-built ``model`` its tensors from ``values`` (as they are); a module with a
    tensor ``values`` lacks (a non-persistent buffer) is allocated on the CPU and initialised by the family's
    ``init_module`` first, which touches only that module's own tensors."""
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        own = [n for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None]
        if any(prefix + n not in values and prefix + n not in tied for n in own):
            module.to_empty(device="cpu", recurse=False)
            model.init_module(mname, module)
        for n in own:
            value = values.get(prefix + n)
            if value is None:
                continue
            current = module._parameters.get(n, module._buffers.get(n))
            if tuple(value.shape) != tuple(current.shape):
                raise CheckpointError(f"{prefix + n} is stored with shape {tuple(value.shape)} but the model's "
                                      f"config.json gives {tuple(current.shape)}; write the directory again.")
            if n in module._parameters:
                module._parameters[n] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[n] = value
