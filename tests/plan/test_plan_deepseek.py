"""The planner on DeepSeek-V3 and Qwen3: the recipes' parameters and the FLOPs per token of their active parameters
(the published counts), multi-head latent attention's and Qwen3's head widths, the MTP module counted, and both
DeepSeek recipes planned at full size (high expert parallelism: one expert per rank keeps the trace small)."""

from __future__ import annotations

import pytest

from plan_testing import load
from dufu.plan import estimate
from dufu.plan.search import model_info

T = 256  # the trace runs on fake tensors; a short sequence keeps it quick, the FLOPs formula takes any


def test_deepseek_v3_recipes_have_the_published_counts_and_their_flops_per_token():
    # Moonlight-16B-A3B: 15,960,108,544 parameters; per token 2,914,774,528 with the input embedding (a lookup,
    # 163,840 x 2048, no FLOPs). Attention per layer and token: 6 T (q.k: 16 heads x (128 + 64), values 16 x 128).
    lite = model_info(load("deepseek_v3_16b", f"dataloader.train.seq_length={T}"))
    assert lite.num_params == 15_960_108_544
    assert lite.flops_per_token == 6 * (2_914_774_528 - 163_840 * 2048) + 6 * T * 27 * 16 * (192 + 128)
    # DeepSeek-V3: 671,026,404,352 without the MTP module, 37B active (36,625,603,584 without the embedding)
    v3 = model_info(load("deepseek_v3_671b", f"dataloader.train.seq_length={T}", "model.mtp_depth=0"))
    assert v3.num_params == 671_026_404_352
    attention = 6 * T * 128 * (192 + 128)
    assert v3.flops_per_token == 6 * 36_625_603_584 + 61 * attention
    # with its MTP depth (11,610,067,968 parameters of its own): a token also passes through its projection
    # (2 x 7168 -> 7168), one MoE block (MLA, 1 shared + 8 of 256 routed experts, router) and the shared head again
    mtp = model_info(load("deepseek_v3_671b", f"dataloader.train.seq_length={T}"))
    assert mtp.num_params == 671_026_404_352 + 11_610_067_968
    h, expert = 7168, 3 * 7168 * 2048
    mla = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * h
    norms = 1536 + 512 + 2 * h + 3 * h  # MLA's two, the block's two, the MTP's enorm, hnorm and final norm
    block = mla + 9 * expert + 256 * h + norms
    assert mtp.flops_per_token == v3.flops_per_token + 6 * (2 * h * h + block + 129_280 * h) + attention


def test_qwen3_counts_its_heads_width_not_its_hidden_size():
    # Qwen3-30B-A3B: hidden 2048 but 32 query heads x 128 = 4096 features per attention (12 L H T would say 2048)
    info = model_info(load("qwen3_30b_a3b", f"dataloader.train.seq_length={T}"))
    model = info.model
    attn = next(m for m in model.modules() if hasattr(m, "head_dim") and hasattr(m, "q_proj"))
    assert attn.num_heads * attn.head_dim == 4096 != model.hidden_size
    from dufu.engine.reporting.flops import count_matmul_params

    assert info.flops_per_token == 6 * count_matmul_params(model) + 6 * T * model.num_layers * 2 * 4096


@pytest.mark.parametrize("recipe, world, ep", [("deepseek_v3_16b", 64, 64), ("deepseek_v3_671b", 256, 256)])
def test_the_deepseek_recipes_are_planned_at_full_size(recipe, world, ep):
    est = estimate(load(recipe, f"dataloader.train.seq_length={T}", "train.train_micro_batch_size=1",
                        f"train.global_batch_size={world}", f"train.dist.expert_parallel_size={ep}",
                        "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"), world, "h100-80gb")
    info = model_info(load(recipe, f"dataloader.train.seq_length={T}"))
    # ZeRO-3: every rank owns 1 / world of the dense parameters and its 1 / ep of the experts (over dp / ep = 1)
    experts = sum(p.experts for p in info.parts)
    owned = (info.num_params - experts) / world + experts / ep
    assert est.model_states["parameters"] == pytest.approx(4 * owned, rel=1e-6)
    assert est.model_states["optimizer"] == pytest.approx(8 * owned, rel=1e-6)
    assert est.fits and 0.0 < est.mfu < 0.6
    assert est.model_flops_per_step == info.flops_per_token * T * world
    if recipe == "deepseek_v3_671b":  # bf16 on an H100: (512 + 64) x 2 B against 128 x (192 + 128) x 2 B
        assert any("KV cache keeps 1,152 B per token and layer in bf16" in n and "81,920 B" in n for n in est.notes)
