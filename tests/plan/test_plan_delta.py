"""Delta runs (dufu.delta: LoRA, adapters, BitFit, freezing) are planned with the config's delta applied: every
parameter is held, but gradients and AdamW's moments exist for the parameters that train only, as the trainer's
optimizer takes them (``requires_grad``). tests/plan/test_plan_fsdp_measured.py checks a LoRA run's peak against a
measured one."""

from __future__ import annotations

import pytest

from plan_testing import load
from dufu.plan import estimate
from dufu.plan.search import model_info

# llama_lora: rank-16 factors beside the 4 attention projections of Llama 2 7B's 32 layers, each (16 x 4096) +
# (4096 x 16): 16,777,216 parameters (the recipe says 16.8M of 6.76B)
FACTORS = 4 * 32 * 2 * 16 * 4096
ZERO3 = ("dataloader.train.seq_length=512", "train.dist.data_parallel_size=8", "train.zero_optimization.enabled=True",
         "train.zero_optimization.stage=3", "train.global_batch_size=16", "train.train_micro_batch_size=2")


def test_a_lora_run_holds_gradients_and_moments_of_its_factors_only():
    lora_cfg, full_cfg = load("llama_lora", *ZERO3), load("llama2_7b", *ZERO3)
    info = model_info(lora_cfg)
    assert info.trainable == FACTORS and info.num_params == model_info(full_cfg).num_params + FACTORS
    lora, full = estimate(lora_cfg, 8, "a100-80gb"), estimate(full_cfg, 8, "a100-80gb")
    assert lora.model_states["parameters"] == pytest.approx(4 * info.num_params / 8, rel=1e-9)  # all, sharded
    assert lora.model_states["gradients"] == pytest.approx(4 * FACTORS / 8, rel=1e-9)
    assert lora.model_states["optimizer"] == pytest.approx(8 * FACTORS / 8, rel=1e-9)
    assert full.model_states["gradients"] == pytest.approx(4 * (info.num_params - FACTORS) / 8, rel=1e-9)
    assert any("16,777,216 of 6,755,192,832 parameters train" in n for n in lora.notes), lora.notes
    # of the 12 B a trained parameter adds (its fp32 gradient shard and AdamW's two moments, over 8 ranks), the peak
    # keeps at least half: the two peaks also differ in what is in flight (the full run's gradients are reduced
    # from bf16 buffers, gathered in bf16 under FSDP's mixed-precision policy)
    assert lora.memory_per_gpu_bytes < full.memory_per_gpu_bytes - 6 * (info.num_params - FACTORS) / 8
    # the frozen base's weight gradients are never computed (the traced backward has no such matmuls)
    assert lora.time["compute"] < 0.8 * full.time["compute"]
    # AdamW and the clip stream the factors' state only (0.25% of the model's; what is left is per-launch overhead),
    # and ZeRO reduce-scatters the factors' gradients only, while it still gathers every parameter, frozen ones too,
    # for the forward and for the backward: of the full run's one reduce-scatter and two all-gathers of the same
    # bytes (one micro-batch per step), two thirds remain
    assert lora.time["optimizer"] < 0.05 * full.time["optimizer"]
    assert lora.time["dp_comm"] == pytest.approx(full.time["dp_comm"] * 2 / 3, rel=0.02)


def test_frozen_parameters_and_trained_heads_are_counted_where_they_are(test_cpu):
    # bert_classify_lora: LoRA beside the attention's projections, and the new classification head in full
    cfg = load("bert_classify_lora")
    info = model_info(cfg)
    head = sum(p.numel() for n, p in info.model.named_parameters() if n.startswith("classifier"))
    lora = sum(p.numel() for n, p in info.model.named_parameters() if "lora_" in n)
    assert head > 0 and info.trainable == head + lora == info.model.delta_info.trainable_count
    est = estimate(cfg, 1, test_cpu)
    assert est.model_states["gradients"] == 4 * info.trainable and est.model_states["optimizer"] == 8 * info.trainable
    assert est.model_states["parameters"] == 4 * info.num_params
