"""Qwen3 (LlamaModel with qk_norm) and Qwen3-MoE (MoEModel with qk_norm): transformers parity both ways (logits
at 1e-5 in fp32 with eager attention, greedy and beam generation token for token), refusals, and the published
sizes of the qwen3_8b and qwen3_30b_a3b recipes, counted on the meta device and by the planner."""

from __future__ import annotations

import json

import pytest
import torch

import dufu
from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.errors import DufuError
from dufu.layers.attention import HeadRMSNorm
from dufu.models.hub import build_from_hf_config
from dufu.models.llama import LlamaModel
from dufu.models.moe import MoEModel

transformers = pytest.importorskip("transformers")

V, H, L, NH, NKV, HD, FFN, P = 256, 64, 2, 4, 2, 32, 96, 64  # head_dim 32: 4 x 32 != hidden 64, as in Qwen3-MoE
ATOL = 1e-5  # fp32
ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NKV,
              head_dim=HD, max_position_embeddings=P, bos_token_id=None, eos_token_id=None)


def scaled(model):
    """Norms (q_norm and k_norm too) and biases away from their 1 / 0 init, so their mapping is tested, and the
    other weights 3x the default init: far-from-uniform predictions, so generation meets no near-ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(3.0)
    return model.eval()


def hf_model(kind: str):
    """A tiny random transformers Qwen3 (head tied, as the small Qwen3 sizes) or Qwen3-MoE (block 0 dense by
    mlp_only_layers, block 1 a mixture of 8 experts, top-2 renormalised; Q/K/V/O biases by attention_bias)."""
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**COMMON, intermediate_size=FFN, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=FFN, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                          attention_bias=True, router_aux_loss_coef=0.01)
        cls = transformers.Qwen3MoeForCausalLM
    cfg._attn_implementation = "eager"
    return scaled(cls(cfg))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (transformers model, its directory, the directory imported into dufu)."""
    out = {}
    for kind in ARCH:
        path = tmp_path_factory.mktemp(kind)
        hf = hf_model(kind)
        hf.save_pretrained(path)
        out[kind] = (hf, path, dufu.from_pretrained(path).eval())
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(ARCH))
def test_import_gives_transformers_logits_and_loss(pairs, ids, kind):
    hf, _, ours = pairs[kind]
    attn = ours.blocks["0"].attn
    assert isinstance(attn.q_norm, HeadRMSNorm) and attn.q_norm.weight.shape == attn.k_norm.weight.shape == (HD,)
    assert (ours.head_dim, attn.q_proj.weight.shape) == (HD, (NH * HD, H))
    if kind == "qwen3":
        assert type(ours) is LlamaModel and ours.qk_norm and ours.lm_head.weight is ours.wte.weight
        assert attn.q_proj.bias is None and attn.out_proj.bias is None
    else:
        assert type(ours) is MoEModel and ours.qk_norm and ours.norm_topk_prob and not ours.tie_word_embeddings
        assert list(ours.moe_layers()) == ["1"] and ours.shared_ffn_hidden_size is None
        assert (ours.num_experts, ours.top_k, ours.moe_ffn_hidden_size, ours.ffn_hidden_size) == (8, 2, 32, FFN)
        assert attn.q_proj.bias is not None and attn.out_proj.bias is not None  # attention_bias: all four
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        out = ours(ids, labels=ids)
    assert ref.logits.abs().max() > 1.0
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    plain = dufu.from_pretrained(pairs[kind][1]).eval()  # the norms' weights matter: left at 1, logits are off
    for block in plain.blocks.values():
        block.attn.q_norm.weight.data.fill_(1.0)
    with torch.no_grad():
        assert (plain(ids).logits - ref.logits).abs().max() > 1e-2


def dufu_model(kind: str):
    torch.manual_seed(3)
    kw = dict(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, num_key_value_heads=NKV,
              head_dim=HD, ffn_hidden_size=FFN, max_position_embeddings=P, rope_theta=1e6, qk_norm=True)
    if kind == "qwen3":
        return scaled(LlamaModel(**kw))
    return scaled(MoEModel(**kw, num_experts=8, top_k=2, moe_ffn_hidden_size=32, norm_topk_prob=False,
                           moe_layer_freq=2, tie_word_embeddings=True))


@pytest.mark.parametrize("kind", list(ARCH))
def test_export_loads_in_transformers_auto_class(tmp_path, ids, kind):
    ours = dufu_model(kind)
    dufu.save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == kind and config["head_dim"] == HD and config["attention_bias"] is False
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ARCH[kind]
    if kind == "qwen3_moe":  # decoder_sparse_step 2: block 0 dense, block 1 sparse
        assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
        assert not hf.config.norm_topk_prob and hf.config.num_experts == 8
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=ATOL)
    back = dufu.from_pretrained(tmp_path).eval()
    assert type(back) is type(ours) and back.qk_norm
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", list(ARCH))
def test_imported_model_exports_back_to_the_same_transformers_tensors(pairs, tmp_path, kind):
    hf, path, ours = pairs[kind]
    dufu.save_pretrained(ours, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(again) is type(hf)
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for key in ("head_dim", "attention_bias", "tie_word_embeddings", "rms_norm_eps", "num_key_value_heads",
                *(("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                   "decoder_sparse_step", "router_aux_loss_coef") if kind == "qwen3_moe" else ())):
        assert getattr(again.config, key) == getattr(hf.config, key), key


PROMPTS = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
NEW = 12


@pytest.mark.parametrize("kind", list(ARCH))
def test_greedy_and_beam_generation_equal_transformers(pairs, kind):
    from dufu.engine.inference.generate import generate

    hf, _, ours = pairs[kind]
    for kw in (dict(), dict(num_beams=3), dict(num_beams=4, length_penalty=0.5, early_stopping=True)):
        expected = hf.generate(PROMPTS, attention_mask=torch.ones_like(PROMPTS), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, **kw)
        got = generate(ours, PROMPTS, NEW, temperature=0, **kw)
        assert got.shape == (2, 6 + NEW) and torch.equal(got, expected), kw
    # the cache holds normalised, rotated keys: without it the tokens are the same
    assert torch.equal(generate(ours, PROMPTS, NEW, temperature=0, use_cache=False),
                       generate(ours, PROMPTS, NEW, temperature=0))


BASE = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=NH, intermediate_size=48,
            hidden_act="silu")


@pytest.mark.parametrize("hf_config,match", [
    (dict(model_type="qwen3", use_sliding_window=True), "use_sliding_window"),
    (dict(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]), r"layers \[1\]"),
    (dict(model_type="qwen3_moe", use_sliding_window=True), "Qwen3-MoE with use_sliding_window"),
    (dict(model_type="qwen3_moe", num_experts=0), "num_experts=0"),
])
def test_sliding_window_and_no_experts_are_refused(hf_config, match):
    base = dict(BASE, num_experts=4, moe_intermediate_size=32) if hf_config["model_type"] == "qwen3_moe" else BASE
    with pytest.raises(DufuError, match=match):
        build_from_hf_config({**base, **hf_config})
    model = build_from_hf_config({**base, "model_type": hf_config["model_type"]})  # the same without it builds
    assert model.qk_norm and model.head_dim == (128 if hf_config["model_type"] == "qwen3" else H // NH)


@pytest.mark.parametrize("cls,kw,match", [
    (LlamaModel, dict(qkv_bias=True), "Qwen3's attention_bias"),
    (LlamaModel, dict(mlp_bias=True), "without MLP biases"),
    (MoEModel, dict(shared_ffn_hidden_size=32, shared_expert_gate=True), "Qwen3-MoE has none"),
    (MoEModel, dict(qkv_bias=True), "Q/K/V biases without an output-projection bias"),
])
def test_models_transformers_cannot_describe_are_refused_on_export(tmp_path, cls, kw, match):
    with torch.device("meta"):
        model = cls(vocab_size=V, hidden_size=H, num_layers=2, num_attention_heads=NH, num_key_value_heads=NKV,
                    ffn_hidden_size=48, qk_norm=True, **({"num_experts": 4} if cls is MoEModel else {}), **kw)
    with pytest.raises(DufuError, match=match):
        dufu.save_pretrained(model, tmp_path, state_dict={})


# (recipe, parameters, matmul parameters a token uses (dufu's MFU N: all but the input embedding, experts at
# top_k / E), the embedding table, the model card's (parameters, non-embedding parameters) in billions).
# huggingface.co/Qwen/Qwen3-8B: "Number of Parameters: 8.2B; Number of Paramaters (Non-Embedding): 6.95B";
# huggingface.co/Qwen/Qwen3-30B-A3B: "30.5B in total and 3.3B activated; (Non-Embedding): 29.9B".
PUBLISHED = [
    ("qwen3_8b", 8_190_735_360, 7_568_405_504, 151936 * 4096, ("8.2", "6.95")),
    ("qwen3_30b_a3b", 30_532_122_624, 3_041_867_776, 151936 * 2048, ("30.5", "29.9")),
]


def qwen3_parameters(vocab, hidden, layers, heads, kv_heads, head_dim, ffn, experts=0, top_k=0) -> tuple:
    """(all, per token) parameters of an untied Qwen3 / Qwen3-MoE (every block a MoE block when experts) by hand."""
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 2 * head_dim  # + q/k norms
    mlp = experts * (3 * hidden * ffn + hidden) if experts else 3 * hidden * ffn  # experts and router
    used = top_k * 3 * hidden * ffn + experts * hidden if experts else mlp
    per_block = attention + 2 * hidden
    return (2 * vocab * hidden + layers * (per_block + mlp) + hidden,
            2 * vocab * hidden + layers * (per_block + used) + hidden)


@pytest.mark.parametrize("recipe,total,active_matmul,embedding,card", PUBLISHED)
def test_recipes_have_the_published_sizes_and_plan(recipe, total, active_matmul, embedding, card):
    from dufu.engine.reporting.flops import count_matmul_params
    from dufu.plan import estimate
    from dufu.plan.search import model_info

    shapes = {"qwen3_8b": (151936, 4096, 36, 32, 8, 128, 12288),
              "qwen3_30b_a3b": (151936, 2048, 48, 32, 4, 128, 768, 128, 8)}[recipe]
    by_hand, per_token = qwen3_parameters(*shapes)
    assert by_hand == total and per_token - embedding == active_matmul
    for count, published in zip((total, total - 2 * embedding), card):  # the card's figures, to their digits
        assert f"{count / 1e9:.{len(published.split('.')[1])}f}" == published
    if recipe == "qwen3_30b_a3b":  # the card's "3.3B activated": embedding and head included, cut to 3.3
        assert per_token == 3_353_032_704
    cfg = LazyConfig.load(str(resolve_config_path(recipe)))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    assert model.qk_norm and sum(p.numel() for p in model.parameters()) == total
    assert count_matmul_params(model) == active_matmul
    # the planner (dufu plan) counts the same: every parameter held, N in 6 N + 12 L H T per token
    info = model_info(cfg)
    assert info.num_params == total
    layers, hidden, seq = model.num_layers, model.hidden_size, cfg.dataloader.train.seq_length
    heads, head_dim = shapes[3], shapes[5]  # attention over heads x head_dim features (30B-A3B: 4096, hidden 2048)
    assert info.flops_per_token == pytest.approx(6 * active_matmul + 12 * layers * heads * head_dim * seq, rel=1e-12)
    # a layout of the recipe on H100s, ZeRO-3 over all ranks: the dense model on 8, the MoE one on 64 with the
    # experts split 64 ways (2 per rank; the planner's trace then loops over 2 experts, not 128: seconds, not
    # a minute), without activation checkpointing (its trace costs twice the time)
    world, ep = (8, 1) if recipe == "qwen3_8b" else (64, 64)
    est = estimate(LazyConfig.apply_overrides(cfg, [
        f"train.dist.data_parallel_size={world}", f"train.dist.expert_parallel_size={ep}",
        "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
        "train.activation_checkpoint.enabled=False"]), world, "h100-80gb")
    assert est.fits and est.model_flops_per_step == pytest.approx(info.flops_per_token * est.tokens_per_step, rel=1e-9)
    assert est.model_states["parameters"] == pytest.approx(4 * total / world, rel=1e-9)  # fp32, 1 / world each
