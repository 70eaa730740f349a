"""What structured pruning needs to know about each model family it supports: which classes, the complete
constructor arguments of a built model, and the blocks whose attention and feed-forward it cuts.

The three families share their building blocks: every block has ``attn`` (:class:`dufu.layers.Attention`:
separate Q/K/V projections, heads of ``head_dim`` rows each) and ``mlp`` (:class:`dufu.layers.MLP`, or
:class:`dufu.layers.GatedMLP` for LLaMA). So the cutting is one piece of code (:mod:`dufu.compress.prune`);
only the constructor arguments differ. They are read back from the modules because the constructors do not
keep every argument as an attribute (dropouts, epsilons, biases live in the layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from torch.distributed.tensor import DTensor

from dufu.errors import DufuError
from dufu.layers import Attention, GatedMLP, Linear, MLP
from dufu.models.bert.model import (BertForMaskedLM, BertForSequenceClassification, BertModel,
                                    RobertaForSequenceClassification)
from dufu.models.gpt.model import GPTModel
from dufu.models.llama.model import LlamaModel

SUPPORTED = ("GPT (GPTModel), LLaMA / Qwen2 (LlamaModel) and BERT / RoBERTa (BertModel, BertForMaskedLM, "
             "BertForSequenceClassification and the Roberta* classes)")


@dataclass(frozen=True)
class Family:
    name: str
    kwargs: Callable[[nn.Module], dict]  # the complete constructor arguments of a built model


def first_block(model: nn.Module) -> nn.Module:
    return next(iter(model.blocks.values()))


def mlp_projections(mlp: nn.Module) -> tuple[list[nn.Linear], nn.Linear]:
    """(the projections whose output rows are the hidden neurons, the one whose input columns are)."""
    if isinstance(mlp, GatedMLP):
        return [mlp.gate_proj, mlp.up_proj], mlp.down_proj
    return [mlp.fc1], mlp.fc2


def _gpt_kwargs(model: GPTModel) -> dict:
    b = first_block(model)
    a = b.attn
    return dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_layers=len(model.blocks),
        num_attention_heads=a.num_heads, head_dim=a.head_dim, ffn_hidden_size=b.mlp.fc1.out_features,
        max_position_embeddings=model.max_position_embeddings, embedding_dropout=model.drop.p,
        hidden_dropout=a.resid_dropout.p, attention_dropout=a.attention_dropout, layernorm_epsilon=model.ln_f.eps,
        activation=b.mlp.activation, bias=a.q_proj.bias is not None, tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.initializer_range, fused_loss=model.fused_loss,
    )


def _llama_kwargs(model: LlamaModel) -> dict:
    b = first_block(model)
    a = b.attn
    return dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_layers=len(model.blocks),
        num_attention_heads=a.num_heads, num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
        ffn_hidden_size=b.mlp.gate_proj.out_features, max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm.eps, rope_theta=model.rope_theta,
        rope_scaling=dict(model.rope_scaling) if model.rope_scaling else None,
        qkv_bias=a.q_proj.bias is not None, out_bias=a.out_proj.bias is not None,
        mlp_bias=b.mlp.gate_proj.bias is not None, embedding_dropout=model.drop.p, hidden_dropout=a.resid_dropout.p,
        attention_dropout=a.attention_dropout, tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.initializer_range, fused_loss=model.fused_loss,
        qk_norm=getattr(a, "q_norm", None) is not None,  # Qwen3: per-head norms of head_dim, which pruning keeps
    )


def _bert_kwargs(model: BertModel | BertForMaskedLM | BertForSequenceClassification) -> dict:
    b = first_block(model)
    a = b.attn
    kwargs = dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_layers=len(model.blocks),
        num_attention_heads=a.num_heads, head_dim=a.head_dim, ffn_hidden_size=b.mlp.fc1.out_features,
        max_position_embeddings=model.max_position_embeddings, type_vocab_size=model.type_vocab_size,
        hidden_dropout=model.drop.p, attention_dropout=a.attention_dropout, layernorm_epsilon=model.ln_emb.eps,
        activation=model.activation, pad_token_id=model.pad_token_id, initializer_range=model.initializer_range,
    )
    if isinstance(model, BertModel):
        kwargs["add_pooling_layer"] = model.pooler is not None
    elif isinstance(model, BertForMaskedLM):
        kwargs["tie_word_embeddings"] = model.tie_word_embeddings
    elif isinstance(model, BertForSequenceClassification):
        # BERT keeps its classifier dropout beside the classifier, RoBERTa's head holds its own
        roberta = isinstance(model, RobertaForSequenceClassification)
        drop = model.classifier.drop if roberta else model.classifier_dropout
        kwargs.update(num_labels=model.num_labels, classifier_dropout=drop.p)
    return kwargs


FAMILIES = (
    (GPTModel, Family("GPT", _gpt_kwargs)),
    (LlamaModel, Family("LLaMA", _llama_kwargs)),
    ((BertModel, BertForMaskedLM, BertForSequenceClassification), Family("BERT", _bert_kwargs)),
)


def family_of(model: nn.Module) -> Family:
    """The model's family, after checking that it is a whole, plain model on one device that pruning can cut;
    anything else is a DufuError saying what to do instead."""
    name = type(model).__name__
    family = next((f for classes, f in FAMILIES if isinstance(model, classes)), None)
    if family is None:
        raise DufuError(f"structured pruning supports {SUPPORTED}; got {name}. Other families (T5, ViT, Swin, "
                        "transformers models as-is) cannot be pruned by dufu.")
    if model.delta_info is not None:
        raise DufuError(f"{name} carries a delta (LoRA, adapters, prefixes ...): prune the base model, or merge "
                        "LoRA into the weights first (dufu.delta.lora.merge_lora_) and remove the delta.")
    if len(model.blocks) == 0 or model.token_embedding() is None:
        raise DufuError(f"{name} has no blocks or no embedding (a pipeline stage?): prune the whole model on one "
                        "device, before it is split.")
    for p in model.parameters():
        if p.is_meta:
            raise DufuError(f"{name} is on the meta device: pruning reads the weights, so materialise the model "
                            "(or load it with dufu.from_pretrained / pretrained_model) first.")
        if isinstance(p, DTensor):
            raise DufuError(f"{name} is parallelized (its parameters are DTensors): prune the single-device model "
                            "before dufu.parallel.parallelize, or load the run's checkpoint into one process.")
    for i, block in model.blocks.items():
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        if not isinstance(attn, Attention) or not isinstance(mlp, (MLP, GatedMLP)):
            raise DufuError(f"block {i} of {name} has no dufu Attention / MLP (attn={type(attn).__name__}, "
                            f"mlp={type(mlp).__name__}), so its heads and neurons cannot be cut.")
        ins, out = mlp_projections(mlp)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, *ins, out):
            if type(proj) not in (Linear, nn.Linear):
                raise DufuError(f"block {i} of {name} has a {type(proj).__name__} projection where a plain Linear "
                                "is expected (a delta or a quantized layer): prune the plain model.")
    return family
