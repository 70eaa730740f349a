"""Delta tuning on one process: what a delta adds, what trains, LoRA's arithmetic, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dufu.config import LazyConfig, instantiate
from dufu.config.packaged import resolve_config_path
from dufu.delta import BitFit, Freeze, LoRA, LoraLinear, apply_delta, matches, merge_lora_
from dufu.errors import ConfigError


def build(name: str = "llama_debug") -> nn.Module:
    cfg = LazyConfig.load(resolve_config_path(name))
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    model.init_weights()
    return model


def test_patterns_follow_peft_target_modules():
    # a list: exact names or suffixes after a dot; wildcards; a string: a regular expression of the whole name
    assert matches("blocks.0.attn.q_proj", ["q_proj"])
    assert not matches("blocks.0.attn.q_proj_extra", ["q_proj"])
    assert matches("blocks.1.attn.v_proj", ["blocks.*.attn.v_proj"])
    assert matches("blocks.1.attn.v_proj", r"blocks\.1\..*_proj")
    assert not matches("blocks.0.attn.v_proj", r"blocks\.1\..*_proj")
    assert not matches("x", None)


def test_lora_starts_at_the_base_and_merges_exactly():
    model = build()
    tokens = torch.randint(0, 257, (2, 16))
    before = model(input_ids=tokens).logits
    info = apply_delta(model, LoRA(targets=["q_proj", "v_proj", "out_proj", "down_proj"], rank=4, alpha=8))
    lora = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(lora) == 8  # 4 targets x 2 layers
    for m in lora:  # B starts at zero, A does not (PEFT's default initialisation)
        assert torch.count_nonzero(m.lora_B.weight) == 0 and torch.count_nonzero(m.lora_A.weight) > 0
        assert m.lora_scaling == 2.0
    torch.testing.assert_close(model(input_ids=tokens).logits, before, rtol=0, atol=0)
    for m in lora:
        nn.init.normal_(m.lora_B.weight, std=0.1)
    unmerged = model(input_ids=tokens).logits
    assert (unmerged - before).abs().max() > 1e-3
    merge_lora_(model)
    torch.testing.assert_close(model(input_ids=tokens).logits, unmerged, rtol=1e-5, atol=1e-5)
    merge_lora_(model, unmerge=True)
    torch.testing.assert_close(model(input_ids=tokens).logits, unmerged, rtol=1e-5, atol=1e-5)
    # only the factors train; the count is theirs
    expected = sum(m.lora_A.weight.numel() + m.lora_B.weight.numel() for m in lora)
    assert info.trainable_count == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(info.trainable)
    assert all(".lora_" in n for n in info.trainable) and info.added == info.trainable
    assert "LoRA" in info.summary() and f"{expected:,} of" in info.summary()


def test_rank_stabilised_scaling():
    model = build()
    apply_delta(model, LoRA(targets=["q_proj"], rank=4, alpha=8, rslora=True))
    m = model.get_submodule("blocks.0.attn.q_proj")
    assert m.lora_scaling == pytest.approx(8 / math.sqrt(4))


def test_bitfit_and_freeze_select_what_trains():
    model = build("gpt_debug")
    info = apply_delta(model, [BitFit(), Freeze(unfreeze=["ln_f"], freeze=["blocks.0.attn.q_proj"])])
    trainable = set(info.trainable)
    assert "ln_f.weight" in trainable and "ln_f.bias" in trainable
    assert "blocks.0.attn.q_proj.bias" not in trainable  # freeze wins over BitFit
    assert "blocks.1.attn.q_proj.bias" in trainable
    assert all(n.endswith("bias") or n.startswith("ln_f") for n in trainable)
    # Freeze alone: partial fine-tuning, everything but the frozen part trains
    model = build("gpt_debug")
    info = apply_delta(model, Freeze(freeze=["wte", "wpe", "blocks.0"]))
    names = {n for n, _ in model.named_parameters()}
    assert set(info.trainable) == {n for n in names if not n.startswith(("wte", "wpe", "blocks.0."))}


def test_errors_say_what_is_wrong():
    with pytest.raises(ConfigError, match=r"matches no module.*Closest module names: .*q_proj"):
        apply_delta(build(), LoRA(targets=["q_prj"]))
    with pytest.raises(ConfigError, match="rank 512 does not fit a 64 -> 64 layer"):
        apply_delta(build(), LoRA(targets=["q_proj"], rank=512))
    with pytest.raises(ConfigError, match="applies to linear layers"):
        apply_delta(build(), LoRA(targets=["attn"]))
    with pytest.raises(ConfigError, match="no bias to train"):
        apply_delta(build(), BitFit())  # LLaMA's layers have no biases


def test_tensor_parallel_plan_places_the_factors_with_their_layer():
    from dufu.delta.lora import LoraColwiseParallel, LoraRowwiseParallel
    from dufu.parallel.tensor_parallel import tensor_parallel_plan

    model = build()
    apply_delta(model, LoRA(targets=["q_proj", "out_proj"], rank=2))
    plan = tensor_parallel_plan(model)
    assert type(plan["blocks.0.attn.q_proj"]) is LoraColwiseParallel
    assert type(plan["blocks.0.attn.out_proj"]) is LoraRowwiseParallel
    assert not any(".lora_" in name for name in plan)  # the factors are placed by their layer's style


def test_dora_decomposes_the_weight_as_the_paper_says():
    model = build()
    tokens = torch.randint(0, 257, (2, 16))
    before = model(input_ids=tokens).logits
    info = apply_delta(model, LoRA(targets=["q_proj", "out_proj"], rank=4, alpha=8, dora=True))
    m = model.get_submodule("blocks.0.attn.q_proj")
    # m starts as the row norms of W, so the model starts as the base
    torch.testing.assert_close(m.lora_magnitude_vector.weight, torch.linalg.vector_norm(m.weight, dim=1))
    torch.testing.assert_close(model(input_ids=tokens).logits, before, rtol=1e-5, atol=1e-5)
    assert "blocks.0.attn.q_proj.lora_magnitude_vector.weight" in info.trainable
    # y = m * (W + s B A) x / ||W + s B A||_row + b, for B != 0 and m != ||W||
    nn.init.normal_(m.lora_B.weight, std=0.1)
    with torch.no_grad():
        m.lora_magnitude_vector.weight.mul_(1.5)
    x = torch.randn(3, 64)
    merged = m.weight + m.lora_scaling * m.lora_B.weight @ m.lora_A.weight
    expected = (x @ merged.t()) * (m.lora_magnitude_vector.weight / torch.linalg.vector_norm(merged, dim=1))
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
    m(x).sum().backward()
    assert m.lora_magnitude_vector.weight.grad is not None and m.weight.grad is None


def test_adapters_start_as_the_identity_and_train_alone():
    from dufu.delta import Adapter

    model = build("gpt_debug")
    tokens = torch.randint(0, 257, (2, 16))
    before = model(input_ids=tokens).logits
    info = apply_delta(model, Adapter(placement="houlsby", bottleneck=8))
    adapters = [n for n, _ in model.named_modules() if n.endswith(".delta_adapter")]
    assert adapters == ["blocks.0.attn.delta_adapter", "blocks.0.mlp.delta_adapter",
                        "blocks.1.attn.delta_adapter", "blocks.1.mlp.delta_adapter"]
    torch.testing.assert_close(model(input_ids=tokens).logits, before, rtol=0, atol=0)
    assert info.trainable_count == 4 * (2 * 64 * 8 + 8 + 64)
    model = build("gpt_debug")
    apply_delta(model, Adapter(placement="pfeiffer", reduction_factor=8))
    assert [n for n, _ in model.named_modules() if n.endswith(".delta_adapter")] == \
        ["blocks.0.mlp.delta_adapter", "blocks.1.mlp.delta_adapter"]
    with pytest.raises(ConfigError, match="placement 'parallel'"):
        apply_delta(build("gpt_debug"), Adapter(placement="parallel"))


@pytest.mark.parametrize("name", ["llama_debug", "bert_debug", "t5_debug"])
def test_prefix_tuning_puts_learned_keys_before_every_self_attention(name):
    from dufu.delta import PrefixTuning
    from dufu.layers.attention import Attention

    model = build(name)
    info = apply_delta(model, PrefixTuning(num_virtual_tokens=3))
    prefixed = [n for n, m in model.named_modules() if isinstance(m, Attention) and hasattr(m, "delta_prefix")]
    assert prefixed and not any(n.endswith("cross_attn") for n in prefixed)
    assert all(".delta_prefix." in n for n in info.trainable)
    tokens = torch.randint(0, 200, (2, 12))
    inputs = {"input_ids": tokens}
    if name == "t5_debug":
        inputs["decoder_input_ids"] = tokens
    if name == "bert_debug":
        inputs["attention_mask"] = torch.ones_like(tokens).index_fill_(1, torch.tensor([10, 11]), 0)
    out = model(**inputs).logits
    assert out.shape[:2] == (2, 12)
    out.float().pow(2).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if ".delta_prefix." in n]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_prefix_attention_equals_attention_over_prepended_keys():
    from dufu.delta.prefix import add_prefix
    from dufu.layers.attention import Attention

    torch.manual_seed(0)
    attn = Attention(32, 4, causal=True, qkv_bias=False)
    prefix = add_prefix(attn, 2)
    x = torch.randn(1, 5, 32)
    q = attn.q_proj(x).view(1, 5, 4, 8).transpose(1, 2)
    k = torch.cat([prefix.key[None], attn.k_proj(x).view(1, 5, 4, 8).transpose(1, 2)], dim=2)
    v = torch.cat([prefix.value[None], attn.v_proj(x).view(1, 5, 4, 8).transpose(1, 2)], dim=2)
    allowed = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)  # all of the prefix, then causal
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    expected = attn.out_proj(y.transpose(1, 2).reshape(1, 5, 32))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama_debug", "gpt_debug"])
def test_prompt_tuning_prepends_virtual_tokens_and_serves_with_a_cache(name):
    from dufu.delta import PromptTuning
    from dufu.layers.attention import KVCache

    model = build(name)
    info = apply_delta(model, PromptTuning(num_virtual_tokens=3))
    assert info.trainable == ["blocks.0.delta_prompt.weight"] and info.trainable_count == 3 * 64
    model.eval()
    tokens = torch.randint(0, 200, (2, 10))
    full = model(input_ids=tokens).logits  # (B, T, V): the head sees the sequence's positions only
    assert full.shape[:2] == (2, 10)
    # the same as the base model run on [prompt embeddings; token embeddings] (LLaMA: positions 0..n+T-1)
    cache = KVCache()
    first = model(input_ids=tokens[:, :7], kv_cache=cache).logits
    step = model(input_ids=tokens[:, 7:8], kv_cache=cache).logits
    torch.testing.assert_close(first, full[:, :7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[:, -1], full[:, 7], rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="decoder-only"):
        apply_delta(build("bert_debug"), PromptTuning())
