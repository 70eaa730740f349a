"""What a model is made of, read from the model itself: its parts and their parameters, and the records of one
traced training step (:mod:`dufu.plan.trace` makes them).

The planner never works from a formula of a family ("12 h^2 per layer"): it builds the config's model on the meta
device, as :func:`dufu.engine.preflight.plan_run` does (no weights, ~0.5 s for a 145B GPT), and reads its
parameters per part, in pipeline order: ``first`` (embeddings), every transformer block, ``last`` (final norm,
head), with how many of them tensor parallelism splits (:func:`dufu.parallel.tensor_parallel.tensor_parallel_plan`,
the plan dufu applies), which form FSDP units of their own under ZeRO-3
(:func:`dufu.parallel.data_parallel.end_units`) and which are the experts of mixture-of-experts layers (every
expert is counted: a rank holds all of them, or ``E / ep`` under expert parallelism; only the FLOPs are those of
the ``top_k`` experts a token uses, see :mod:`dufu.plan.experts`).

A delta run (the config's ``delta``: LoRA, adapters, BitFit, freezing) is planned on the model with its delta
applied, as :func:`dufu.engine.preflight.build_model` applies it: every part also counts the parameters that train
(``requires_grad``, what the trainer's optimizer takes), for which alone gradients and optimizer states exist. A
transformers model run as-is (:class:`dufu.models.hf_auto.HFAutoModel`) is planned from its Hugging Face config,
built on the meta device like any other: its decoder layers are the blocks, everything else is the first part
(it declares no ``pipeline_layout``, so tensor and pipeline parallelism, which ``dufu train`` refuses for it, are
not among its layouts either).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from dufu.config import instantiate
from dufu.data.span_corruption import compute_lengths
from dufu.delta import apply_delta
from dufu.engine.reporting.report import model_flops_per_token
from dufu.errors import ConfigError, DufuError
from dufu.models.base import contract_of
from dufu.optim.muon import muon_param_groups
from dufu.parallel.data_parallel import end_units
from dufu.parallel.expert_parallel import expert_modules
from dufu.parallel.parallelize_utils import transformer_blocks
from dufu.parallel.tensor_parallel import tensor_parallel_plan

# Ops that only describe existing storage (views) cost dispatch time and no memory traffic.
_SKIP = {"prim.device.default", "aten.detach.default", "aten.lift_fresh.default"}
_GEMMS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
          "aten._scaled_mm.default", "aten.addbmm.default"}
_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": "fwd",
    "aten._scaled_dot_product_flash_attention.default": "fwd",
    "aten._scaled_dot_product_efficient_attention.default": "fwd",
    "aten._scaled_dot_product_cudnn_attention.default": "fwd",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": "bwd",
    "aten._scaled_dot_product_flash_attention_backward.default": "bwd",
    "aten._scaled_dot_product_efficient_attention_backward.default": "bwd",
    "aten._scaled_dot_product_cudnn_attention_backward.default": "bwd",
}
# Ops that read a whole tensor in a way no fusion removes (lookups, the loss over the vocabulary).
_MATERIALIZING = {"aten.embedding.default", "aten.embedding_dense_backward.default", "aten._log_softmax.default",
                  "aten._log_softmax_backward_data.default", "aten.nll_loss_forward.default",
                  "aten.nll_loss_backward.default"}
# Ops that evaluate transcendentals or draw random numbers, by name fragment.
_HEAVY = ("gelu", "tanh", "exp", "log", "softmax", "layer_norm", "rms_norm", "silu", "sigmoid", "erf", "pow",
          "rsqrt", "sqrt", "sin", "cos", "bernoulli", "dropout", "div")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------------------------- model parts


@dataclass
class Part:
    """A contiguous part of the model in forward (= pipeline) order: ``first``, one block, or ``last``."""

    name: str
    kind: str  # "first" | "block" | "last"
    params: int = 0  # elements, a tied tensor counted once (in the part that owns it first)
    tp_split: int = 0  # of those, elements tensor parallelism splits over its ranks
    embedding_unit: int = 0  # elements in FSDP's embedding unit under ZeRO-3 (input embedding tables)
    last_unit: int = 0  # elements in FSDP's output-end unit under ZeRO-3 (final norm + head)
    last_unit_tp_split: int = 0
    trace_index: int = 0  # the traced part whose ops and memory this part repeats
    experts: int = 0  # of ``params``, elements of MoE experts (split over the expert-parallel ranks, not by TP)
    # of ``params``, elements that train (``requires_grad``; all but a delta run's frozen base), and of those the
    # ones tensor parallelism splits and the MoE experts': only they have gradients and optimizer states
    trainable: int = 0
    trainable_tp_split: int = 0
    trainable_experts: int = 0
    # of ``trainable``, the hidden 2-D matrices dufu.optim.Muon updates (dufu.optim.muon_param_groups): their
    # elements, of those the ones tensor parallelism splits and the MoE experts', and every matrix's (A, B), A <= B
    muon: int = 0
    muon_tp_split: int = 0
    muon_experts: int = 0
    muon_shapes: list = field(default_factory=list)


@dataclass
class LinearCall:
    """One call of a ``dufu.layers.Linear`` or vocabulary embedding in forward, for the collectives of TP."""

    part: int
    style: str  # "col" | "row" | "vocab"
    in_bytes: tuple[float, float]  # (at micro-batch 1, per extra sample): the input's bytes
    out_bytes: tuple[float, float]  # the output's bytes (before any reduction)
    grad_in_bytes: tuple[float, float]  # the input gradient's bytes (dtype of the input as the module sees it)
    head: bool = False  # the output head (ColwiseParallel with a sequence-sharded input under SP)
    gathers_input: bool = False  # first projection of a tensor_parallel_input="replicate" module (SP all-gather)
    recomputed: bool = False  # runs again in backward (full activation checkpointing)


@dataclass
class Gemm:
    """A matrix multiply: ``batch`` products of (m x k) by (k x n); each size (at micro-batch 1, per extra sample):
    the tokens are m in forward and in the input gradient, k in the weight gradient."""

    m: tuple[float, float]
    n: tuple[float, float]
    k: tuple[float, float]
    batch: tuple[float, float]
    dtype: str
    split: str  # "n" | "k" | "" : the dimension tensor parallelism divides
    phase: str


@dataclass
class Attention:
    """A fused attention call: (B, heads, T, Tk, head_dim); ``causal`` kernels skip the masked half."""

    batch: tuple[float, float]
    heads: int
    t: int
    tk: int
    d: int
    causal: bool
    dtype: str
    backward: bool
    split: bool  # heads divided by tensor parallelism


@dataclass
class PartOps:
    """The work of one traced part in one phase (forward or backward)."""

    gemms: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    # bytes read + written by every other op, by tensor-parallel kind: {kind: (at b=1, per extra sample)}
    traffic: dict = field(default_factory=lambda: {"rep": [0.0, 0.0], "feat": [0.0, 0.0], "seq": [0.0, 0.0]})
    # the same under torch.compile: inductor fuses chains of such ops, so only tensors that must exist in memory
    # (matmul inputs and outputs, tensors kept from forward for backward, gradients, weight copies) are moved
    fused: dict = field(default_factory=lambda: {"rep": [0.0, 0.0], "feat": [0.0, 0.0], "seq": [0.0, 0.0]})
    # of ``traffic``, the bytes of ops that evaluate transcendentals or draw random numbers (slower than memory
    # on a CPU)
    heavy: dict = field(default_factory=lambda: {"rep": [0.0, 0.0], "feat": [0.0, 0.0], "seq": [0.0, 0.0]})
    ops: int = 0  # ops that do work (each costs a dispatch)
    views: int = 0  # ops that only make views
    param_ops: int = 0  # ops that take a parameter (DTensor ops under tensor parallelism)


@dataclass
class Storage:
    """One storage's life in the trace."""

    nbytes: tuple[float, float]  # (at micro-batch 1, per extra sample)
    kind: str  # "rep" | "feat" | "seq"
    category: str  # "act" | "wcast" (autocast's weight copy) | "grad" (ends as a parameter's .grad)
    saved: bool = False  # alive at the end of forward: kept for backward
    gathered: bool = False  # a projection's input: under SP the gathered (whole-sequence) copy is what is kept
    expert: bool = False  # a gradient of MoE experts' weights (ZeRO shards it over dp / ep ranks, not dp)


@dataclass
class ExpertsCall:
    """One call of a MoE layer's experts module: the bytes of the token copies it takes (those an expert-parallel
    dispatch sends) and of its outputs (those the combine sends back), each (at micro-batch 1, per extra sample)."""

    part: int
    in_bytes: tuple[float, float]
    out_bytes: tuple[float, float]
    num_experts: int
    recomputed: bool = False  # runs again in backward (activation checkpointing)


@dataclass
class Trace:
    """One micro-batch's training step of the traced (shortened) model."""

    dtype: str
    checkpoint: Optional[str]
    parts: list[str]  # traced part names
    ops: dict  # (part index, phase) -> PartOps
    events: list  # (part index, phase, +1 alloc / -1 free, storage id), in order
    storages: dict  # storage id -> Storage
    linears: list  # LinearCall
    boundary: dict  # part index -> bytes of the hidden states it passes on (pipeline p2p), (b=1, per sample)
    logits_part: int = -1
    experts: list = field(default_factory=list)  # ExpertsCall of every MoE layer's experts
    expert_parallel_size: int = 1  # the experts of one rank of this many were traced (dufu.plan.experts)
    kv_gathers: list = field(default_factory=list)  # KVGather of every attention's all-gather (dufu.plan.context)
    context_parallel_size: int = 1  # the tokens of one rank of this many were traced


def lin(pair, b: int) -> float:
    """The value at micro-batch ``b`` of a traced size kept as (at micro-batch 1, per extra sample)."""
    return pair[0] + pair[1] * (b - 1)


@dataclass
class ModelInfo:
    """The config's model, built on the meta device, and what the planner reads from it."""

    model: nn.Module
    name: str
    parts: list[Part]
    num_params: int
    seq_length: int  # tokens per sample (image models: patches, for the activation sizes only)
    tokens_per_sample: int  # what throughput counts per sample (tokens; 1 for image classifiers)
    # model FLOPs per trained token, 6N + 12*L*H*T (dufu's MFU convention; N counts the top_k / E of MoE experts'
    # parameters one token uses)
    flops_per_token: float
    tied: bool  # an output head tied to the input embedding
    tied_elems: int  # elements of that shared table (the last pipeline stage keeps its own copy)
    inputs: object = None  # callable(batch) -> dict of fake inputs
    mapping: list = field(default_factory=list)  # for every part, the traced part it repeats (see shortening)
    reduced: Optional[nn.Module] = None  # the shortened copy that is traced
    traces: dict = field(default_factory=dict)
    expert_counts: tuple = ()  # num_experts of every MoE layer (empty: a dense model)
    trainable: int = 0  # parameters that train (``num_params`` but for a delta run's frozen base)
    tied_trainable: bool = True  # the tied embedding trains (a copy of it has a gradient and moments)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def blocks(self) -> list[Part]:
        return [p for p in self.parts if p.kind == "block"]

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def expert_parallel_sizes(self, dp: int) -> list[int]:
        """The expert-parallel sizes a layout with ``dp`` data-parallel ranks can take: those dividing ``dp`` and
        every MoE layer's experts ([1] for a dense model)."""
        if not self.expert_counts:
            return [1]
        return [e for e in range(1, dp + 1) if dp % e == 0 and all(n % e == 0 for n in self.expert_counts)]


# ------------------------------------------------------------------------------------------------ building


def sequence_lengths(cfg, model: nn.Module) -> tuple[int, Optional[int]]:
    """(encoder/decoder input length, decoder target length or None) of the config's training data."""
    train = cfg.get("dataloader", {}).get("train", {}) if hasattr(cfg, "get") else {}
    inputs_length = train.get("inputs_length") if hasattr(train, "get") else None
    if inputs_length is not None:  # T5 span corruption: the lengths it produces
        tokens, targets = compute_lengths(inputs_length, train.get("noise_density", 0.15),
                                          train.get("mean_noise_span_length", 3.0))
        del tokens
        return int(inputs_length), int(targets)
    seq = train.get("seq_length") if hasattr(train, "get") else None
    if seq is None:
        seq = contract_of(model).max_position_embeddings or 128
    return int(seq), None


def _input_builder(model: nn.Module, seq: int, target_len: Optional[int]):
    """A function (micro-batch) -> the keyword inputs of one training micro-batch, as dufu's data gives them."""
    params = inspect.signature(model.forward).parameters
    declared = contract_of(model)
    main = declared.main_input_name
    vocab = declared.vocab_size or 2

    def build(b: int) -> dict:
        if main == "pixel_values":
            size = declared.image_size or (224, 224)
            c = declared.num_channels or 3
            return {"pixel_values": torch.zeros(b, c, *size), "labels": torch.zeros(b, dtype=torch.long)}
        ids = torch.zeros(b, seq, dtype=torch.long)
        if "decoder_input_ids" in params:  # encoder-decoder: the decoder reads the labels shifted right
            return {"input_ids": ids, "labels": torch.zeros(b, target_len or max(1, seq // 4), dtype=torch.long)}
        if "shift_labels" in params:
            return {"input_ids": ids, "shift_labels": torch.zeros(b, seq, dtype=torch.long)}
        if "labels" in params:
            per_token = declared.output_head() is not None
            labels = torch.zeros(b, seq, dtype=torch.long) if per_token else torch.zeros(b, dtype=torch.long)
            return {"input_ids": ids, "labels": labels.clamp_max(max(vocab - 1, 0))}
        raise ConfigError(
            f"dufu plan cannot tell how {type(model).__name__} is trained: its forward takes neither labels nor "
            "shift_labels nor pixel_values. Plan a model of a dufu family (dufu/models)."
        )

    return build


def build_model_info(cfg) -> ModelInfo:
    """Build ``cfg.model`` on the meta device, with the config's ``delta`` applied, and read its parts (see the
    module docstring)."""
    try:
        with torch.device("meta"):
            model = instantiate(cfg.model)
            delta = cfg.get("delta") if hasattr(cfg, "get") else None
            if delta is not None:  # before any split, as dufu.engine.preflight.build_model applies it
                apply_delta(model, instantiate(delta))
    except (ValueError, TypeError) as e:
        if isinstance(e, DufuError):
            raise
        raise ConfigError(f"the model cannot be built from model.*: {e}. Fix those keys in the config.") from None
    if not transformer_blocks(model):
        raise ConfigError(
            f"dufu plan reads a model's transformer blocks (the children of a ModuleDict or ModuleList that carry a "
            f"layer_idx); {type(model).__name__} has none. Plan a dufu model family (GPT, LLaMA, BERT, T5, ViT, "
            "Swin) or a transformers model through dufu.models.hf_auto.HFAutoModel, which marks its layers."
        )
    seq, target = sequence_lengths(cfg, model)
    parts, tied_elems = _parts(model, transformer_blocks(model), end_units)
    num_params = sum(p.params for p in parts)
    trainable = sum(p.trainable for p in parts)
    wte = contract_of(model).token_embedding()
    tied_trainable = not tied_elems or wte is None or wte.weight.requires_grad
    tokens_per_sample = 1 if contract_of(model).main_input_name == "pixel_values" else seq
    flops_per_token = model_flops_per_token(model, seq) if tokens_per_sample > 1 else 0.0
    info = ModelInfo(model, type(model).__name__, parts, num_params, seq, tokens_per_sample, flops_per_token,
                     tied=tied_elems > 0, tied_elems=tied_elems, inputs=_input_builder(model, seq, target),
                     mapping=shortening(model)[1],
                     expert_counts=tuple(m.num_experts for _, m in expert_modules(model)), trainable=trainable,
                     tied_trainable=tied_trainable)
    return info


def _signature(block: nn.Module) -> tuple:
    return (type(block).__name__,) + tuple((n.split(".", 1)[-1], tuple(p.shape)) for n, p in block.named_parameters())


def shortening(model: nn.Module) -> tuple[dict, list[int]]:
    """Which blocks a trace keeps, and for every part of the model the traced part it repeats.

    Of every run of alike consecutive blocks in a stack (a whole stack, or DeepSeek's dense first blocks and its
    MoE blocks apart), three are kept: the first, the last but one (standing for every middle block) and the last
    (the blocks next to the embeddings and the head see their neighbours' tensors saved and freed differently). A
    ``ModuleList`` stack (a transformers model's layers) is traced whole: the trace removes blocks by key, which
    only a ``ModuleDict`` keeps. Returns ({container: [(key, block) removed]}, mapping)."""
    containers: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, b in transformer_blocks(model):
        containers.setdefault(name.rsplit(".", 1)[0], []).append((name.rsplit(".", 1)[1], b))
    removed: dict = {}
    kept_index = []  # for every block of the full model: the traced block it maps to
    traced = 0
    for cname, members in containers.items():
        listed = isinstance(model.get_submodule(cname), nn.ModuleList)
        if listed:
            kept_index.extend(traced + j for j in range(len(members)))
            traced += len(members)
            continue
        # runs of alike blocks (DeepSeek's dense first blocks, then its MoE blocks), each shortened on its own
        runs: list[list] = []
        for key, b in members:
            sig = _signature(b)
            if runs and runs[-1][0] == sig:
                runs[-1][1].append((key, b))
            else:
                runs.append([sig, [(key, b)]])
        for _, run in runs:
            n = len(run)
            if n <= 3:
                kept_index.extend(traced + j for j in range(n))
                traced += n
                continue
            for j, (key, b) in enumerate(run):
                kept_index.append(traced + (0 if j == 0 else 2 if j == n - 1 else 1))
                if 0 < j < n - 2:
                    removed.setdefault(cname, []).append((key, b))
            traced += 3
    return removed, [0] + [1 + i for i in kept_index] + [1 + traced]


def _parts(model: nn.Module, blocks: list, end_units) -> tuple[list[Part], int]:
    """The model's parts in forward order with their parameters (see :class:`Part`)."""
    declared = contract_of(model)
    head = declared.output_head()
    plan = tensor_parallel_plan(model, False, head=head)
    split: set[int] = set()
    for name, style in plan.items():
        module = model.get_submodule(name)
        kind = type(style).__name__
        for pname, p in module.named_parameters(recurse=False):
            if kind in ("ColwiseParallel",) or (kind == "RowwiseParallel" and pname == "weight"):
                split.add(id(p))
    experts = {id(p) for _, m in expert_modules(model) for p in m.parameters()}
    muon = {id(p) for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]}
    layout = declared.pipeline_layout or {}
    block_names = [n for n, _ in blocks]
    owner_block = {}
    for i, (n, b) in enumerate(blocks):
        for p in b.parameters():
            owner_block.setdefault(id(p), i)
    parts = [Part("first", "first")] + [Part(f"block {i}", "block") for i in range(len(blocks))] + \
            [Part("last", "last")]
    last_names = tuple(layout.get("last", ()))
    before = layout.get("before", {})
    after = layout.get("after", {})
    containers = {}
    for i, n in enumerate(block_names):
        containers.setdefault(n.rsplit(".", 1)[0], []).append(i)

    def part_of(param_name: str, p) -> int:
        if id(p) in owner_block:
            return 1 + owner_block[id(p)]
        for mod, container in before.items():
            if param_name.startswith(mod + ".") and container in containers:
                return 1 + containers[container][0]
        for mod, container in after.items():
            if param_name.startswith(mod + ".") and container in containers:
                return 1 + containers[container][-1]
        if any(param_name.startswith(m + ".") for m in last_names):
            return len(parts) - 1
        return 0

    seen: set[int] = set()
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        part = parts[part_of(pname, p)]
        part.params += p.numel()
        if id(p) in split:
            part.tp_split += p.numel()
        if id(p) in experts:
            part.experts += p.numel()
        if p.requires_grad:
            part.trainable += p.numel()
            part.trainable_tp_split += p.numel() if id(p) in split else 0
            part.trainable_experts += p.numel() if id(p) in experts else 0
        if id(p) in muon:
            part.muon += p.numel()
            part.muon_tp_split += p.numel() if id(p) in split else 0
            part.muon_experts += p.numel() if id(p) in experts else 0
            part.muon_shapes.append(tuple(sorted(p.shape)))
    embeddings, last = end_units(model)
    parts[0].embedding_unit = sum(p.numel() for m in embeddings for p in m.parameters())
    tied_elems = 0
    wte = declared.token_embedding()
    if declared.tie_word_embeddings and head is not None and wte is not None and head.weight is wte.weight:
        tied_elems = wte.weight.numel()
    for m in last:
        for p in m.parameters():
            parts[-1].last_unit += p.numel()
            if id(p) in split:
                parts[-1].last_unit_tp_split += p.numel()
    return parts, tied_elems


