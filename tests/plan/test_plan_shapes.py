"""Shapes and FLOPs read from the real model of every family, built on the meta device and traced on fake tensors."""

from __future__ import annotations

import pytest

from plan_testing import load
from dufu.config import instantiate
from dufu.errors import LayoutError
from dufu.plan import estimate
from dufu.plan.search import model_info
from dufu.plan.trace import get_trace
from dufu.plan.timing import lin

FAMILIES = ["gpt_debug", "llama_debug", "bert_debug", "t5_debug", "vit_debug", "swin_debug", "bert_classify_debug",
            "hf_auto_gpt_neox_debug"]


def traced_matmul_flops(cfg, b: int = 1) -> float:
    info = model_info(cfg)
    trace = get_trace(info, "fp32", None)
    total = 0.0
    for p in range(len(info.parts)):
        for phase in ("fwd", "bwd"):
            ops = trace.ops.get((info.mapping[p], phase))
            for g in ops.gemms if ops else ():
                total += 2 * lin(g.m, b) * lin(g.n, b) * lin(g.k, b) * lin(g.batch, b)
    return total


@pytest.mark.parametrize("recipe", FAMILIES)
def test_every_family_is_planned(recipe, test_cpu):
    est = estimate(load(recipe), 1, test_cpu)
    info = model_info(load(recipe))
    assert all(p.is_meta for p in info.model.parameters())  # shapes only, no weights
    assert info.num_params == sum(p.numel() for p in {id(p): p for p in info.model.parameters()}.values())
    assert est.fits and est.memory["parameters"] == pytest.approx(4 * info.num_params, rel=1e-6)
    assert est.step_time_s > 0 and est.hardware_flops_per_gpu_step > 0


def test_matmul_flops_are_six_per_parameter_and_token():
    # GPT: every weight but the position table takes part in a matmul (the tied head once, as the head)
    cfg = load("gpt_debug", "train.train_micro_batch_size=4")
    info = model_info(cfg)
    n = info.num_params - 32 * 64  # the position table (32 x 64) is a lookup
    biases_and_norms = sum(p.numel() for name, p in info.model.named_parameters() if p.dim() == 1)
    tokens = 4 * 32
    # fused attention is recorded apart from the matmuls
    assert traced_matmul_flops(cfg, b=4) == pytest.approx(6 * (n - biases_and_norms) * tokens, rel=0.01)


def test_gqa_and_untied_heads_are_read_from_the_model():
    mha = traced_matmul_flops(load("llama_debug", "model.num_key_value_heads=4"))
    gqa = traced_matmul_flops(load("llama_debug"))  # 2 key/value heads of 4
    h, tokens = 64, 32
    # k and v projections shrink from h x h to h x h/2: 2 x (h x h/2) fewer weights, 6 FLOPs each per token
    assert mha - gqa == pytest.approx(2 * 2 * 6 * (h * h // 2) * tokens, rel=1e-6)
    tied = model_info(load("gpt_debug"))
    untied = model_info(load("gpt_debug", "model.tie_word_embeddings=False"))
    assert untied.num_params - tied.num_params == 384 * 64 and tied.tied and not untied.tied


def test_a_145b_gpt_is_read_without_weights():
    cfg = load("gpt2_small", "model.vocab_size=51200", "model.hidden_size=12288", "model.num_attention_heads=96",
               "model.num_layers=80", "model.max_position_embeddings=2048", "dataloader.train.seq_length=2048")
    info = model_info(cfg)
    assert info.num_params == pytest.approx(145.6e9, rel=0.005)
    assert info.num_layers == 80
    # only three blocks are traced: the first, one standing for the middle ones, the last
    assert info.mapping[1] == 1 and set(info.mapping[2:80]) == {2} and info.mapping[80] == 3


def test_encoder_decoder_and_image_models_count_their_sequences():
    t5 = model_info(load("t5_debug"))
    assert t5.num_layers == 2 * 2 and t5.tokens_per_sample == t5.seq_length  # encoder + decoder blocks
    vit = model_info(load("vit_debug"))
    assert vit.tokens_per_sample == 1  # image classifiers count samples


def test_a_transformers_model_run_as_is_is_planned_from_its_config(test_cpu):
    """HFAutoModel (dufu.models.hf_auto): built on the meta device from its Hugging Face config like any family;
    its decoder layers are the blocks (and ZeRO-3's units), what it declares no split for is refused as dufu
    train refuses it."""
    cfg = load("hf_auto_gpt_neox_debug", "train.train_micro_batch_size=4")
    info = model_info(cfg)
    real = instantiate(cfg.model)  # transformers' GPTNeoXForCausalLM with weights
    n = sum(p.numel() for p in real.parameters())
    assert info.num_params == n and info.num_layers == 2 and info.trainable == n
    # every matrix but the input embedding takes part in a matmul: 6 FLOPs per weight and token
    matrices = sum(p.numel() for name, p in real.named_parameters() if p.dim() == 2 and "embed_in" not in name)
    assert traced_matmul_flops(cfg, b=4) == pytest.approx(6 * matrices * 4 * 32, rel=0.01)
    zero3 = estimate(load("hf_auto_gpt_neox_debug", "train.dist.data_parallel_size=2",
                          "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"), 2, test_cpu)
    assert zero3.model_states == {"parameters": 4 * n / 2, "gradients": 4 * n / 2, "optimizer": 8 * n / 2}
    assert zero3.memory["communication"] > 0  # its layers gathered one at a time, the rest (the root) for the step
    with pytest.raises(LayoutError, match="tensor parallelism needs a model built from dufu layers"):
        estimate(load("hf_auto_gpt_neox_debug", "train.dist.tensor_parallel_size=2"), 2, test_cpu)
