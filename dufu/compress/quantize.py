"""Post-training weight quantization of a dufu model on torchao: ``quantize_model(model, scheme)``.

torchao does the work: ``quantize_(model, config, filter_fn)`` swaps a layer's weight for a quantized tensor
subclass (``Int8Tensor``, ``Int4OpaqueTensor``) whose ``F.linear`` runs the quantized kernel. dufu's
:class:`dufu.layers.Linear` is an ``nn.Linear`` subclass, so torchao's module handlers apply to it as they
are; this module only decides *which* weights get *which* config, and checks the combination first.

Schemes (:data:`SCHEMES`):

* ``int8-weight``  -- ``Int8WeightOnlyConfig``: int8 weights, one scale per output row; activations stay in
  floating point (the weight is widened inside the matmul).
* ``int8-dynamic`` -- ``Int8DynamicActivationInt8WeightConfig``: int8 weights as above, and each token's
  activations quantized to int8 on the fly (symmetric, per token), so the matmul runs in int8
  (``torch._int_mm``, oneDNN's int8 GEMM on the CPU). On an x86 CPU without an int8 dot-product instruction
  as oneDNN sees it (none of avx512_vnni / avx_vnni / amx_int8, or ``ONEDNN_MAX_CPU_ISA`` capped below them)
  that GEMM multiplies with ``vpmaddubsw``: the activations shifted to uint8 times the int8 weights, two
  products summed into an int16 that saturates (255 * 127 * 2 > 32767), so the int32 results are wrong (15-19%
  relative error on random int8 matrices; up to 22% on the test models' logits). There, and only there, dufu
  takes torchao's ``reduce_range``: weights and activations in [-64, 63], so a pair sums to at most
  255 * 64 * 2 = 32640 and the matmul is exact again, for one bit less of precision (:func:`int8_matmul_saturates`
  decides; the choice is a note of the report and an attribute of the saved tensors). A full-range model
  reloaded on such a CPU is refused (:func:`check_int8_matmuls`).
* ``int4-weight``  -- 4-bit weights in groups of :data:`INT4_GROUP_SIZE` inputs with a scale and zero point
  each (asymmetric, tinygemm's layout). torchao 0.18's ``Int4WeightOnlyConfig`` has no CPU packing format
  (its "plain" format needs the ``mslk`` GPU kernels, "tile_packed_to_4d" CUDA, "plain_int32" XPU/NPU); the
  CPU path is ``torchao.prototype.quantization.int4.PrototypeInt4WeightOnlyConfig`` (``Int4OpaqueTensor``,
  ``aten._weight_int4pack_mm_for_cpu``), so this scheme runs on the CPU only. That kernel is fast with bf16
  activations and 30-60x slower than an fp32 matmul with fp32 ones (measured on a Zen 4 core, 256 x 1024
  weights), so the int4 layers are quantized from bf16 weights (bf16 scales and zero points) and compute in
  bf16: two hooks per layer cast the input to bf16 and the output back to the input's dtype
  (:func:`run_int4_in_bf16`); the rest of the model keeps its dtype.

Which weights (the same rule for every family):

* every ``nn.Linear`` of the network (attention, MLP, poolers, the masked-LM transform, Swin's patch merging)
  takes the scheme;
* the token embedding (:class:`dufu.layers.VocabEmbedding`) and the vocabulary output head (``lm_head``) take
  ``int8-weight`` per row in every scheme. A tied head *is* the embedding's tensor: quantized once, row by
  row, the same ``Int8Tensor`` serves the lookup (torchao implements ``aten.embedding`` for it) and the head's
  matmul, so the tie stays one tensor in memory and on disk. ``Int4OpaqueTensor`` has no embedding op, and
  the head writes the logits directly, where 4-bit errors cost the most, hence int8 there for ``int4-weight``
  too. These tables are a large share of small models' bytes (half of MiniLM's), so they are not left
  in fp32;
* kept in full precision: task heads (``classifier``: a few outputs, tiny, and their errors are the
  prediction), position / token-type / relative-position tables, norms, biases and convolutions (ViT's and
  Swin's patch embedding), as transformers' torchao integration leaves them too.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from dufu.delta import lora_layers
from dufu.errors import DufuError
from dufu.layers import VocabEmbedding
from dufu.models.base import contract_of, tied_names

SCHEMES = ("int8-weight", "int8-dynamic", "int4-weight")
INT4_GROUP_SIZES = (32, 64, 128)  # what the CPU int4 kernel accepts
INT4_GROUP_SIZE = 32  # the most accurate of them; 64 / 128 save 0.125 / 0.19 bytes per weight in fp32 scales
VOCAB_HEAD = "lm_head"  # the vocabulary output head of every dufu family that has one
TASK_HEADS = ("classifier",)  # module names (first component) kept in full precision


# torchao warns, on import, about each CUDA-only extension of its wheel it cannot load on a machine without CUDA;
# none of those kernels is used by the CPU schemes, so only its errors are shown (unless the user set a level).
if logging.getLogger("torchao").level == logging.NOTSET:
    logging.getLogger("torchao").setLevel(logging.ERROR)


class QuantizationError(DufuError):
    """A scheme that does not exist, or that cannot apply to this model (family, shapes, device)."""


@dataclass
class QuantizationInfo:
    """What :func:`quantize_model` did, kept as ``model.quantization_info``: per module the torchao tensor
    type of its weight, what stayed in full precision and why, and the bytes before and after."""

    scheme: str
    group_size: Optional[int]
    quantized: dict[str, str]                   # module name -> torchao tensor type of its weight
    kept: dict[str, str]                        # module name -> why it stays in full precision
    tied: dict[str, str]                        # parameter name -> the parameter whose tensor it is
    bytes_before: int = 0                       # all weights and buffers, in memory
    bytes_after: int = 0
    linear_bytes_before: int = 0                # only the weights that took the scheme
    linear_bytes_after: int = 0
    notes: list[str] = field(default_factory=list)
    reduce_range: Optional[bool] = None         # int8-dynamic: weights and activations in [-64, 63]


# oneDNN's ONEDNN_MAX_CPU_ISA values (DNNL_MAX_CPU_ISA its older name), lower case, and the CPU flags under which
# the ISA they cap oneDNN at has an int8 dot-product instruction: () = none, so its int8 GEMM saturates. A value
# oneDNN does not know it ignores, as "all" (checked with torch 2.13's oneDNN: an unknown value gives exact sums).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
_AVX512_DOT = ("avx512_vnni", "amx_int8")
ONEDNN_ISA_INT8_DOT = {
    "sse41": (), "avx": (), "avx2": (), "avx512_core": (),
    "avx2_vnni": ("avx_vnni",), "avx2_vnni_2": ("avx_vnni",),
    **{isa: _AVX512_DOT for isa in ("avx512_core_vnni", "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx",
                                    "avx512_core_amx_fp16", "avx10_1_512", "avx10_1_512_amx",
                                    "avx10_1_512_amx_fp16", "avx10_2_512", "avx10_2_512_amx_2")},
}


def onednn_isa_limit() -> tuple[Optional[str], Optional[str]]:
    """``(variable, value)`` of the ISA limit oneDNN obeys (``ONEDNN_MAX_CPU_ISA`` before ``DNNL_MAX_CPU_ISA``,
    as oneDNN reads them), or ``(None, None)``."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if os.environ.get(var):
            return var, os.environ[var]
    return None, None


def int8_matmul_saturates() -> Optional[str]:
    """Why this CPU's int8 GEMM (``torch._int_mm`` through oneDNN) saturates with full-range int8 operands,
    or None where it is exact: an x86 CPU without an int8 dot-product instruction as oneDNN sees it (the CPU's
    flags, read by torch's cpuinfo, and oneDNN's ISA limit if set). Other architectures: None."""
    caps = torch.cpu.get_capabilities()
    if caps.get("architecture") not in ("x86_64", "x86"):
        return None
    flags = [f for f in INT8_DOT_FLAGS if caps.get(f)]
    var, value = onednn_isa_limit()
    needs = ONEDNN_ISA_INT8_DOT.get((value or "").lower())
    if needs is None:  # no limit, or one oneDNN ignores
        if flags:
            return None
        return f"this CPU has no int8 dot-product instruction (none of {', '.join(INT8_DOT_FLAGS)})"
    if any(caps.get(f) for f in needs):
        return None
    if not needs:
        return f"{var}={value} limits oneDNN to an ISA without an int8 dot-product instruction"
    return (f"{var}={value} limits oneDNN to an ISA whose int8 dot product needs {' or '.join(needs)}, "
            f"which this CPU lacks")


SATURATION = ("its int8 matmul (oneDNN, vpmaddubsw) sums pairs of uint8 x int8 products into int16, which "
              "saturates with the full int8 range")


def saturating_layers(model: nn.Module) -> list[str]:
    """Module names whose weight is an int8-dynamic ``Int8Tensor`` with the full int8 range."""
    return [n for n, m in model.named_modules() if type(getattr(m, "weight", None)).__name__ == "Int8Tensor"
            and m.weight.act_quant_kwargs is not None and not m.weight.reduce_range]


def check_int8_matmuls(model: nn.Module) -> None:
    """Refuse a model whose int8-dynamic layers use the full int8 range on a CPU where that saturates."""
    why = int8_matmul_saturates()
    layers = saturating_layers(model) if why else []
    if layers:
        raise QuantizationError(
            f"this model's int8-dynamic layers ({layers[0]} ...) use the full int8 range, but {why}, and there "
            f"{SATURATION}: its logits would be wrong (by up to 22% on dufu's test models). Quantize the source "
            "again on this machine (dufu then takes the reduced range, weights and activations in [-64, 63]) or "
            "anywhere with quantize_model(model, 'int8-dynamic', reduce_range=True), or use int8-weight, whose "
            "matmul is in floating point.")


def torchao_config(scheme: str, group_size: Optional[int] = None, reduce_range: Optional[bool] = None):
    """The torchao config object of ``scheme`` for the network's linear layers (``reduce_range``: int8-dynamic's
    weights and activations in [-64, 63], see the module docstring)."""
    # here, not at the top: torchao is optional
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    # set_inductor_config=False: torchao would otherwise change torch._inductor's global settings for the
    # whole process as a side effect of quantizing; nothing here compiles.
    if scheme == "int8-weight":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False, reduce_range=bool(reduce_range))
    if scheme == "int4-weight":
        # here, not at the top: torchao is optional
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size or INT4_GROUP_SIZE, set_inductor_config=False)
    raise QuantizationError(f"unknown quantization scheme {scheme!r}; the schemes are {', '.join(SCHEMES)}.")


INT4_COMPUTE_DTYPE = torch.bfloat16


def _int4_input_to_bf16(module: nn.Module, args):
    # remembered for the forward hook, which sees only the cast input: the output goes back to this dtype
    module._int4_input_dtype = args[0].dtype
    return (args[0].to(INT4_COMPUTE_DTYPE), *args[1:])


def _int4_output_back(module: nn.Module, args, output):
    return output.to(module._int4_input_dtype)


def run_int4_in_bf16(module: nn.Module) -> None:
    """Make an int4 linear layer compute in bf16 whatever its input's dtype (see the module docstring: the CPU
    int4 kernel is fast in bf16 only); :func:`dufu.compress.quantize_io.load_quantized` attaches them again."""
    module.register_forward_pre_hook(_int4_input_to_bf16)
    module.register_forward_hook(_int4_output_back)


def vocab_config():
    """The config of the token embedding and the vocabulary head in every scheme: int8 per row."""
    return torchao_config("int8-weight")


def is_quantized_tensor(t) -> bool:
    from torchao.utils import TorchAOBaseTensor  # here, not at the top: torchao is optional

    return isinstance(t, TorchAOBaseTensor)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor subclass counts its inner tensors (int data, scales, zero
    points), found through ``__tensor_flatten__``, not the float shape it presents."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)


def unique_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, each shared tensor once (a tied head is counted with its embedding)."""
    seen, out = set(), {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of all the model's weights and buffers in memory, shared tensors once."""
    return sum(tensor_bytes(t) for t in unique_tensors(model).values())


def check_quantizable(model: nn.Module, scheme: str) -> None:
    """The errors :func:`quantize_model` raises before touching the model."""
    if scheme not in SCHEMES:
        raise QuantizationError(f"unknown quantization scheme {scheme!r}; the schemes are {', '.join(SCHEMES)}.")
    if importlib.util.find_spec("torchao") is None:
        raise QuantizationError("quantization runs on torchao, which is not installed: "
                                "pip install torchao torch==2.13.0")
    declared = contract_of(model)
    if declared.hf_mapping is not None:  # a class carrying its own mapping: dufu.models.hf_auto.HFAutoModel
        raise QuantizationError(
            f"{type(model).__name__} is a transformers model run as-is (hf_auto), not a dufu family, so dufu has no "
            "quantized format for it. Quantize it with transformers itself: AutoModel.from_pretrained(DIR, "
            "quantization_config=TorchAoConfig(Int8WeightOnlyConfig())).")
    if declared.delta_info is not None or lora_layers(model):
        raise QuantizationError(
            "the model carries a delta (LoRA, adapters, prefix or prompt tuning); quantize the merged model: "
            "`dufu convert RUN --to-hf DIR --merge`, then `dufu quantize DIR ...`.")
    tensors = unique_tensors(model)
    already = [f"{n} is a {type(t).__name__}" for n, t in tensors.items() if is_quantized_tensor(t)]
    if already:
        raise QuantizationError(f"the model is already quantized ({already[0]}); quantize the full-precision model.")
    devices = {t.device.type for t in tensors.values()}
    if "meta" in devices:
        raise QuantizationError("the model is on the meta device; load its weights before quantizing.")
    if scheme == "int4-weight" and devices != {"cpu"}:
        raise QuantizationError(
            f"int4-weight is torchao's CPU int4 format (Int4OpaqueTensor, packed for the CPU kernel), but the model "
            f"is on {', '.join(sorted(devices))}. Quantize it on the CPU (model.cpu()), or use int8-weight / "
            "int8-dynamic, which run on every device.")


def plan(model: nn.Module, scheme: str, group_size: Optional[int] = None) -> tuple[list[str], list[str], dict]:
    """``(linears, vocab, kept)``: module names that take the scheme, those that take int8 per row (the token
    embedding and the vocabulary head, a tied head not listed: it is the embedding's tensor), and the
    linear / embedding modules kept in full precision with the reason."""
    tied = tied_names(model)
    linears, vocab, kept = [], [], {}
    for name, module in model.named_modules():
        top = name.split(".", 1)[0]
        if isinstance(module, VocabEmbedding) or (name == VOCAB_HEAD and isinstance(module, nn.Linear)):
            if f"{name}.weight" in tied:
                continue  # the embedding's tensor, quantized with it
            vocab.append(name)
        elif isinstance(module, nn.Linear):
            if top in TASK_HEADS:
                kept[name] = "task head: few outputs, and its errors are the prediction"
            else:
                linears.append(name)
        elif isinstance(module, nn.Embedding):
            kept[name] = "position / type / relative-position table: small"
    if scheme == "int4-weight":
        g = group_size or INT4_GROUP_SIZE
        if g not in INT4_GROUP_SIZES:
            raise QuantizationError(f"int4-weight group size {g} is not supported; the CPU kernel takes "
                                    f"{', '.join(map(str, INT4_GROUP_SIZES))}.")
        modules = dict(model.named_modules())
        misfits = [f"{n} (in_features {modules[n].in_features})" for n in linears if modules[n].in_features % g]
        if misfits:
            raise QuantizationError(
                f"int4-weight does not work for this {type(model).__name__}: torchao's int4 kernel groups {g} "
                f"inputs per scale, and these layers' input sizes are not multiples of {g}: "
                f"{', '.join(misfits[:4])}{' ...' if len(misfits) > 4 else ''}. Use int8-weight or int8-dynamic"
                + (", or a smaller group size." if g > INT4_GROUP_SIZES[0] else "."))
    elif group_size is not None:
        raise QuantizationError(f"a group size applies to int4-weight only, not {scheme}.")
    return linears, vocab, kept


def choose_range(model: nn.Module, scheme: str, reduce_range: Optional[bool]) -> tuple[Optional[bool], list[str]]:
    """int8-dynamic's ``reduce_range`` (None for the other schemes) and the note that says why: ``None`` asks
    dufu, which reduces the range exactly where the model's int8 matmuls would saturate (a CPU model on a CPU
    :func:`int8_matmul_saturates` names); True / False are the caller's."""
    if scheme != "int8-dynamic":
        if reduce_range is not None:
            raise QuantizationError(f"reduce_range applies to int8-dynamic only (its int8 matmuls), not {scheme}.")
        return None, []
    on_cpu = {t.device.type for t in unique_tensors(model).values()} == {"cpu"}
    why = int8_matmul_saturates() if on_cpu else None
    if reduce_range is None:
        if why is None:
            return False, []
        return True, [f"int8-dynamic weights and activations in [-64, 63] (torchao's reduce_range), not the full "
                      f"int8 range: {why}, and {SATURATION} (255 * 127 * 2 > 32767); in [-64, 63] a pair sums to at "
                      "most 255 * 64 * 2 = 32640, exact, for one bit less of precision"]
    if reduce_range:
        return True, ["int8-dynamic weights and activations in [-64, 63] (reduce_range=True asked for): exact int8 "
                      "matmuls on CPUs without an int8 dot-product instruction too, for one bit less of precision"]
    if why is None:
        return False, []
    return False, [f"full int8 range (reduce_range=False asked for) although {why}: {SATURATION}, so this model's "
                   "int8 matmuls are wrong on this CPU (and dufu refuses to load it here); run it on a CPU with "
                   "avx512_vnni, avx_vnni or amx_int8, or on a GPU"]


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, group_size: Optional[int] = None,
                   reduce_range: Optional[bool] = None) -> QuantizationInfo:
    """Quantize ``model`` in place with torchao (see the module docstring for which weights get what) and
    return what was done (also kept as ``model.quantization_info``). The model is put in eval mode: a
    quantized model is for inference (its weights no longer train). ``reduce_range`` (int8-dynamic only):
    None lets dufu choose (:func:`choose_range`)."""
    from torchao.quantization import quantize_  # here, not at the top: torchao is optional

    check_quantizable(model, scheme)
    linears, vocab, kept = plan(model, scheme, group_size)
    reduce_range, range_notes = choose_range(model, scheme, reduce_range)
    tied = tied_names(model)
    modules = dict(model.named_modules())
    before = model_bytes(model)
    linear_before = sum(tensor_bytes(modules[n].weight) for n in linears)
    model.eval()
    notes = list(range_notes)
    if contract_of(model).fused_loss:
        # The fused head + loss multiplies by lm_head.weight itself (a transpose torchao's tensors lack);
        # without it the loss is computed from the logits: the same numbers, more memory.
        model.fused_loss = False
        notes.append("fused_loss turned off: the loss is computed from the logits (the same value)")
    chosen_linears, chosen_vocab = set(linears), set(vocab)
    if scheme == "int4-weight":
        for n in linears:  # weights, scales, zero points and bias in bf16: the dtype the CPU kernel is fast in
            modules[n].to(INT4_COMPUTE_DTYPE)
            run_int4_in_bf16(modules[n])
        notes.append("int4 layers compute in bf16 (the CPU int4 kernel is fast with bf16 activations only)")
    quantize_(model, torchao_config(scheme, group_size, reduce_range), filter_fn=lambda m, fqn: fqn in chosen_linears)
    quantize_(model, vocab_config(), filter_fn=lambda m, fqn: fqn in chosen_vocab)
    for alias, owner in tied.items():  # quantize_ replaced the owner's Parameter: point its aliases at the new one
        owner_module, owner_attr = owner.rpartition(".")[0], owner.rpartition(".")[2]
        alias_module, alias_attr = alias.rpartition(".")[0], alias.rpartition(".")[2]
        setattr(modules[alias_module], alias_attr, getattr(modules[owner_module], owner_attr))
    quantized = {n: type(modules[n].weight).__name__ for n in [*linears, *vocab]}
    not_done = [n for n, kind in quantized.items() if not is_quantized_tensor(modules[n].weight)]
    if not_done:  # torchao skips a weight it cannot quantize with only a log line; dufu does not
        raise QuantizationError(f"torchao left {', '.join(not_done[:4])} unquantized under {scheme}; "
                                "use another scheme for this model.")
    info = QuantizationInfo(
        scheme=scheme, group_size=(group_size or INT4_GROUP_SIZE) if scheme == "int4-weight" else None,
        quantized=quantized, kept=kept, tied=tied, bytes_before=before, bytes_after=model_bytes(model),
        linear_bytes_before=linear_before,
        linear_bytes_after=sum(tensor_bytes(modules[n].weight) for n in linears), notes=notes,
        reduce_range=reduce_range)
    model.quantization_info = info
    return info
