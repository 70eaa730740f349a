"""Layout checks against the model, run at start-up before any work. Each error shows the arithmetic."""

from __future__ import annotations

from dufu.errors import LayoutError
from dufu.layers.attention import Attention
from dufu.layers.embedding import HeadwiseEmbedding
from dufu.models.base import contract_of
from dufu.parallel.expert_parallel import check_experts_divisible, expert_modules
from dufu.parallel.pipeline import (SCHEDULES, block_containers, check_pipeline_schedule, layer_stage_ids,
                                    pipeline_num_layers)
from dufu.parallel.tensor_parallel import tensor_parallel_plan


def validate_layout(dims, model, dist_cfg, zero_cfg, seq_length: int, num_microbatches: int) -> list[int] | None:
    """Raise LayoutError for a layout the model cannot take; return the layer -> stage ids under PP.

    ``dist_cfg`` and ``zero_cfg``: the validated ``train.dist`` and ``train.zero_optimization`` nodes (typed by
    ``dufu.engine.schema``, so every key is there with its schema default)."""
    tp = dims.tensor_parallel_size
    declared = contract_of(model)
    if tp > 1:
        if not tensor_parallel_plan(model, bool(dist_cfg.sequence_parallel), head=declared.output_head()):
            raise LayoutError(
                f"tensor parallelism needs a model built from dufu layers (they declare how they split), but "
                f"{type(model).__name__} declares no tensor-parallel style, so tensor_parallel_size {tp} would "
                "only replicate it. Use data parallelism / ZeRO for this model, or a dufu model family."
            )
        sizes = {
            "model.num_attention_heads": declared.num_attention_heads,
            "model.hidden_size": declared.hidden_size,
            "model.vocab_size (padded)": declared.vocab_size,
        }
        ffn = kv_heads = None
        replicated = [n for n, m in model.named_modules() if getattr(m, "tensor_parallel_replicated", False)]
        for name, m in model.named_modules():
            if any(name.startswith(r + ".") for r in replicated):
                continue  # replicated under tensor parallelism (a MoE layer's shared expert): nothing splits
            if ffn is None and hasattr(m, "fc1"):
                ffn = m.fc1.out_features
            if ffn is None and hasattr(m, "gate_proj"):
                ffn = m.gate_proj.out_features
            if kv_heads is None and hasattr(m, "num_key_value_heads"):
                kv_heads = m.num_key_value_heads
        sizes["model.ffn_hidden_size"] = ffn
        if kv_heads is not None and kv_heads != sizes["model.num_attention_heads"]:
            sizes["model.num_key_value_heads"] = kv_heads
        for name, m in model.named_modules():  # per module: Swin has a different head count per stage
            if isinstance(m, Attention):
                sizes.setdefault(f"heads of {name}", m.num_heads)
                sizes.setdefault(f"key/value heads of {name}", m.num_key_value_heads)
            elif isinstance(m, HeadwiseEmbedding):
                sizes.setdefault(f"heads of {name}", m.embedding_dim)
        for key, value in sizes.items():
            if value is not None and value % tp != 0:
                fix = (
                    f"pad the vocabulary to a multiple of {tp} (e.g. model.vocab_size={-(-value // tp) * tp})"
                    if "vocab" in key else f"choose a tensor_parallel_size that divides {value}"
                )
                raise LayoutError(
                    f"tensor parallelism splits {key} across ranks, but {value} / tensor_parallel_size {tp} = "
                    f"{value / tp:g} is not whole. Either {fix}, or change train.dist.tensor_parallel_size."
                )
    if dims.expert_parallel_size > 1:
        if not expert_modules(model):
            raise LayoutError(
                f"train.dist.expert_parallel_size = {dims.expert_parallel_size}, but {type(model).__name__} has no "
                "mixture-of-experts layer to split. Set train.dist.expert_parallel_size=1, or train a MoE model "
                "(e.g. dufu train moe_debug).")
        check_experts_divisible(model, dims.expert_parallel_size)
    # The model's own refusal first: an image model has no sequence length to check.
    if dist_cfg.sequence_parallel and declared.sequence_parallel_unsupported_reason:
        raise LayoutError(
            f"{type(model).__name__} does not support sequence parallelism: "
            f"{_sentence(declared.sequence_parallel_unsupported_reason)} Set train.dist.sequence_parallel=False "
            "(tensor parallelism alone works)."
        )
    if tp > 1 and dist_cfg.sequence_parallel and seq_length % tp != 0:
        raise LayoutError(
            f"sequence parallelism splits the sequence across tensor-parallel ranks, but seq_length "
            f"{seq_length} / {tp} is not whole. Use a sequence length divisible by {tp}."
        )
    if tp == 1 and dist_cfg.sequence_parallel:
        raise LayoutError(
            "train.dist.sequence_parallel=True needs tensor parallelism (it splits the sequence across the "
            "tensor-parallel ranks), but tensor_parallel_size is 1. Set train.dist.tensor_parallel_size > 1 or "
            "turn sequence_parallel off."
        )
    if dims.context_parallel_size > 1:
        check_context_parallel(dims.context_parallel_size, model, seq_length)
        check_context_parallel_heads(dims, model)
    zero = zero_cfg.enabled
    if zero and dims.data_axis_size == 1:
        raise LayoutError(
            f"ZeRO stage {zero_cfg.stage} shards state across data-parallel ranks, but data_parallel_size "
            "is 1, so there is nothing to shard. Use more data-parallel ranks (train.dist.data_parallel_size) or "
            "set train.zero_optimization.enabled=False."
        )
    if dims.hsdp_enabled and not zero:
        R = dims.data_parallel_replicate_size
        raise LayoutError(
            f"train.dist.data_parallel_replicate_size = {R} makes {R} replicas of dp {dims.data_parallel_size} / {R} "
            f"= {dims.data_parallel_size // R} shards, but ZeRO is off: without sharding every data-parallel rank "
            "already holds a whole replica. Turn ZeRO on (train.zero_optimization.enabled=True, stage 1, 2 or 3: "
            "hybrid sharding), or set train.dist.data_parallel_replicate_size=1."
        )
    pp = dims.pipeline_parallel_size
    schedule = dist_cfg.pipeline_schedule
    v = dist_cfg.virtual_pipeline_size or 1
    if pp == 1 or schedule not in SCHEDULES:  # an unknown name is refused in every layout
        check_pipeline_schedule(schedule, pp, v, 0, num_microbatches)
        return None
    if declared.pipeline_layout is None:
        raise LayoutError(
            f"{type(model).__name__} cannot be split into pipeline stages: "
            f"{_sentence(declared.pipeline_unsupported_reason)} "
            "Use data/tensor parallelism or ZeRO, i.e. pipeline_parallel_size=1."
        )
    model_layers = pipeline_num_layers(model)  # encoder + decoder blocks for an encoder-decoder
    num_layers = dist_cfg.pipeline_num_layers or model_layers
    if num_layers != model_layers:
        raise LayoutError(
            f"train.dist.pipeline_num_layers={num_layers} but the model has {model_layers} layers"
            f"{' (encoder plus decoder blocks)' if len(block_containers(declared.pipeline_layout)) > 1 else ''}; "
            "leave it None or make them equal."
        )
    check_pipeline_schedule(schedule, pp, v, num_layers, num_microbatches,
                            zero_stage=int(zero_cfg.stage) if zero_cfg.enabled else None)
    return layer_stage_ids(num_layers, pp * v, dist_cfg.custom_pipeline_stage_id)


def check_context_parallel(cp: int, model, seq_length: int) -> None:
    """The family can be split by sequence (it says so: ``supports_context_parallel``), and the sequence into
    2 x cp load-balanced chunks (:mod:`dufu.parallel.context_parallel`)."""
    declared = contract_of(model)
    if not declared.supports_context_parallel:
        raise LayoutError(
            f"{type(model).__name__} cannot be split by context parallelism: "
            f"{_sentence(declared.context_parallel_unsupported_reason)} "
            "Set train.dist.context_parallel_size=1 (data, tensor and pipeline parallelism work).")
    if seq_length % (2 * cp):
        step = 2 * cp
        below, above = seq_length // step * step, -(-seq_length // step) * step
        nearest = " or ".join(str(n) for n in (below, above) if n > 0)
        raise LayoutError(
            f"context parallelism cuts each sequence into 2 x cp = {step} chunks (two per rank, for balanced causal "
            f"work), but seq_length {seq_length} / {step} = {seq_length / step:g} is not whole. Use a sequence "
            f"length divisible by {step} (nearest: {nearest}), or another context_parallel_size.")


def check_context_parallel_heads(dims, model) -> None:
    """Under an all-to-all of heads (context_parallel_mode "all_to_all" or "hierarchical",
    :mod:`dufu.parallel.context_parallel`) the a2a size divides every attention's query heads on a tensor-parallel
    rank (key/value heads it does not divide are repeated, so they need nothing)."""
    A, cp, tp = dims.context_a2a_size, dims.context_parallel_size, dims.tensor_parallel_size
    if A == 1:
        return
    mode = dims.context_parallel_mode
    for name, m in model.named_modules():
        if not isinstance(m, Attention):
            continue
        heads = m.num_heads // tp
        if heads % A == 0:
            continue
        per_rank = f"{m.num_heads} / tensor_parallel_size {tp} = {heads}" if tp > 1 else f"{m.num_heads}"
        fits = [d for d in range(2, cp) if heads % d == 0 and cp % d == 0]  # hierarchical a2a sizes that work
        hierarchical = (f"train.dist.context_parallel_mode=hierarchical with context_parallel_a2a_size among "
                        f"{fits}, " if fits else "")
        if mode == "all_to_all":
            splits, fix = f"context_parallel_size {cp}", f"a context_parallel_size that divides {heads}, {hierarchical}"
        else:
            splits, fix = f"context_parallel_a2a_size {A}", hierarchical.replace(
                "train.dist.context_parallel_mode=hierarchical with ", "")
        raise LayoutError(
            f"context_parallel_mode={mode} splits the attention heads of each tensor-parallel rank over "
            f"{splits}, but {name or type(m).__name__} has {per_rank} query heads per rank, and {heads} / {A} = "
            f"{heads / A:g} is not whole. Use {fix}or train.dist.context_parallel_mode=all_gather (any head "
            "count).")


def _sentence(reason: str) -> str:
    """A model's reason (a clause, with or without a full stop) as a sentence ending in one."""
    reason = reason.strip()
    return reason if reason.endswith(".") else reason + "."
