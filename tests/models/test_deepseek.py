"""DeepSeek-V3 (MLA, DeepSeekMoE, multi-token prediction): transformers' DeepseekV3ForCausalLM imported with equal
logits (1e-5, fp32, eager) for a low-rank query, a plain query and YaRN rotary scaling without interleaving; the
export loaded back by transformers with equal logits; greedy and beam generation token for token equal to
transformers'; MLA's KV cache holding the compressed latent; the MTP loss and its gradient; the published
parameter counts of the recipes on the meta device; the layouts the model refuses."""

from __future__ import annotations

import json

import pytest
import torch

import dufu
from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.layers import MLA, KVCache, MoE
from dufu.models.deepseek import DeepseekV3Model
from dufu.models.deepseek.model import shifted_targets
from dufu.models.hub import adapter_for_model

transformers = pytest.importorskip("transformers")

V, H, NH = 256, 64, 4
ATOL = 1e-5  # fp32
SIZES = dict(vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=NH, num_key_value_heads=NH, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
             n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None)
VARIANTS = {
    "q_lora": dict(q_lora_rank=32),
    "plain_q": dict(q_lora_rank=None),  # DeepSeek-V2-Lite / Moonlight
    "yarn": dict(q_lora_rank=32, rope_interleave=False,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      original_max_position_embeddings=16, beta_fast=32, beta_slow=1, mscale=0.8,
                                      mscale_all_dim=1.0)),
}


def hf_model(variant: str):
    """A random DeepseekV3ForCausalLM whose norms and expert-choice biases are away from their 1 / 0 init (so
    their mapping is tested) and whose weights are scaled up (far-from-uniform predictions: no argmax ties)."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**SIZES, **VARIANTS[variant], attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(3.0)
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{variant: (transformers model, its directory, the same weights imported into dufu)}."""
    out = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        hf = hf_model(variant)
        hf.save_pretrained(path)
        out[variant] = (hf, path, dufu.from_pretrained(path).eval())
    return out


IDS = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_and_export_give_transformers_logits(pairs, variant, tmp_path):
    hf, _, ours = pairs[variant]
    assert isinstance(ours, DeepseekV3Model) and ours.mtp is None
    assert (ours.q_lora_rank, ours.first_k_dense, ours.n_group, ours.topk_group) == (
        VARIANTS[variant]["q_lora_rank"], 1, 2, 1)
    assert [type(b.mlp).__name__ for b in ours.blocks.values()] == ["GatedMLP", "MoE", "MoE"]
    assert ours.blocks["1"].mlp.score_bias.abs().max() > 0  # the choice bias was read
    with torch.no_grad():
        ref = hf(IDS, labels=IDS)
        out = ours(IDS, labels=IDS)
    assert ref.logits.abs().max() > 1.0
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    # and back: transformers loads the export with the same logits, dufu with the same tensors
    dufu.save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 0  # no MTP here
    back_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(back_hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back_hf(IDS).logits, ref.logits, rtol=0, atol=ATOL)
    back = dufu.from_pretrained(tmp_path)
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("variant", ["q_lora", "plain_q"])
def test_greedy_and_beam_generation_equal_transformers(pairs, variant):
    from dufu.engine.inference.generate import generate

    hf, _, ours = pairs[variant]
    prompts = IDS[:2, :6]
    for kw in (dict(), dict(num_beams=3), dict(num_beams=4, length_penalty=0.5, early_stopping=True)):
        expected = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False,
                               pad_token_id=0, **kw)
        got = generate(ours, prompts, 10, temperature=0, **kw)
        assert got.shape == (2, 16) and torch.equal(got, expected), kw
    assert torch.equal(generate(ours, prompts, 10, temperature=0, use_cache=False),
                       generate(ours, prompts, 10, temperature=0))
    if variant == "q_lora":  # a left-padded prompt: padding mask and positions through MLA's cache
        mask = torch.ones_like(prompts)
        mask[1, :2] = 0
        padded = prompts.masked_fill(mask == 0, 0)
        expected = hf.generate(padded, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(generate(ours, padded, 10, temperature=0, attention_mask=mask), expected)


def test_kv_cache_holds_the_compressed_latent(pairs):
    _, _, ours = pairs["q_lora"]
    with torch.no_grad():
        full = ours(IDS).logits
        cache = KVCache()
        parts = [ours(IDS[:, :5], kv_cache=cache).logits] + [ours(IDS[:, t:t + 1], kv_cache=cache).logits
                                                            for t in range(5, IDS.shape[1])]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5 * full.abs().max().item())
    attn = ours.blocks["0"].attn
    latent, k_rot = cache.get(attn)
    assert latent.shape == (3, 1, 20, 16) and k_rot.shape == (3, 1, 20, 8)  # kv_lora_rank, qk_rope_head_dim
    assert len(cache) == 3  # one entry per layer, nothing else
    # per token and layer: (kv_lora_rank + rope) values, against nh x (qk + v) for standard attention's K and V
    assert attn.cache_bytes_per_token(torch.float32) == (16 + 8) * 4
    # the 671B recipe's MLA in bf16: 1,152 bytes per token and layer against 81,920 (module docstring)
    with torch.device("meta"):
        big = MLA(7168, 128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128)
    assert big.cache_bytes_per_token() == 1152 and 128 * (192 + 128) * 2 == 81920


def debug_model(**overrides) -> DeepseekV3Model:
    cfg = LazyConfig.load(resolve_config_path("deepseek_v3_debug"))
    cfg.model.update(**overrides)
    torch.manual_seed(0)
    return instantiate(cfg.model)


def test_mtp_loss_is_its_own_part_and_trains_the_modules(tmp_path):
    model = debug_model()
    assert model.mtp_depth == 1 and model.mtp_loss_weight == 0.3
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(2))
    target = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    out = model(ids, shift_labels=target)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.3 * out.mtp_loss)
    # the MTP loss by hand: depth 1 reads h_i (before the final norm) and the embedding of token i + 1
    with torch.no_grad():
        h = model.wte(ids)
        for block in model.blocks.values():
            h = block(h)
        e = model.wte(torch.cat([ids[:, 1:], ids[:, :1] * 0], dim=1))
        mtp_h = model.mtp["0"](torch.cat([h, e], dim=0))
        logits = model.lm_head(mtp_h)
        expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())
    torch.testing.assert_close(out.mtp_loss, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(shifted_targets(target, 1)[:, -1], torch.full((2,), -100))
    out.loss.backward()
    mtp_grads = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert mtp_grads and all(g is not None for g in mtp_grads.values())
    assert mtp_grads["mtp.0.eh_proj.weight"].abs().max() > 0
    # without labels (generation) the MTP modules do not run
    with torch.no_grad():
        assert torch.equal(model(ids).logits, out.logits.detach())
    # the export writes the MTP depth as DeepSeek's checkpoints do: one more layer after the main model's
    hf_names = adapter_for_model(model).state_dict_to_hf(model.state_dict(), model)
    assert torch.equal(hf_names["model.layers.3.eh_proj.weight"], model.mtp["0"].eh_proj.weight)
    assert "model.layers.3.shared_head.norm.weight" in hf_names and "model.layers.3.mlp.gate.weight" in hf_names
    # loading builds no MTP depth unless asked (transformers' configs say 1 for models without one); asked, it
    # reads it back
    dufu.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert dufu.from_pretrained(tmp_path).mtp is None
    back = dufu.from_pretrained(tmp_path, mtp_depth=1)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


def built(config: str) -> DeepseekV3Model:
    cfg = LazyConfig.load(resolve_config_path(config))
    with torch.device("meta"):
        return instantiate(cfg.model)


def counts(model: DeepseekV3Model) -> dict:
    """Parameters of the main model, those a token uses (routed experts: top_k of num_experts), and the MTP's."""
    main = {n: p.numel() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()
                 for n, m in model.named_modules() if isinstance(m, MoE) and not n.startswith("mtp."))
    total = sum(main.values())
    active = total - routed + routed * model.top_k // model.num_experts
    embed = main["wte.weight"]
    return dict(total=total, active=active, embed=embed,
                mtp=sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp.")))


def test_recipes_have_the_published_sizes():
    v3 = counts(built("deepseek_v3_671b"))
    assert v3["total"] == 671_026_404_352  # "671B"
    # DeepSeek counts the activated parameters without the input embedding (a lookup): 36.6B, "37B"
    assert round((v3["active"] - v3["embed"]) / 1e9) == 37
    # the MTP module's own 11.6B, plus the embedding and head copies its released checkpoint stores: "14B"
    assert v3["mtp"] == 11_610_067_968 and 13.4e9 < v3["mtp"] + 2 * v3["embed"] < 14.5e9
    lite = counts(built("deepseek_v3_16b"))
    assert lite["total"] == 15_960_108_544 and round(lite["total"] / 1e9) == 16  # "16B"
    # Moonlight's paper counts without the embedding and the head: 15.29B total, 2.24B activated
    assert round((lite["total"] - 2 * lite["embed"]) / 1e7) == 1529
    assert round((lite["active"] - 2 * lite["embed"]) / 1e7) == 224 and round(lite["active"] / 1e9) == 3  # "A3B"


def test_context_parallel_is_refused_with_the_reason():
    model = debug_model()
    assert not model.supports_context_parallel and "mtp_depth" in model.context_parallel_unsupported_reason
    no_mtp = debug_model(mtp_depth=0)
    assert not no_mtp.supports_context_parallel and "seq_aux_loss_coeff" in no_mtp.context_parallel_unsupported_reason
    assert debug_model(mtp_depth=0, seq_aux_loss_coeff=0.0).supports_context_parallel


def test_a_run_logs_the_language_model_and_mtp_losses_beside_their_sum(tmp_path):
    """The training record carries the loss's named parts (the output's ``loss_parts``), reduced as the loss is:
    loss = lm_loss + mtp_loss_weight x mtp_loss at every logged step."""
    from dufu_testing import read_records, train

    run = train(tmp_path / "run", ["train.train_iter=2", "train.log_period=1"], recipe="deepseek_v3_debug")
    steps = [r for r in read_records(run.output_dir) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    weight = LazyConfig.load(str(resolve_config_path("deepseek_v3_debug"))).model.mtp_loss_weight
    for r in steps:
        assert r["lm_loss"] > 0 and r["mtp_loss"] > 0
        assert r["loss"] == pytest.approx(r["lm_loss"] + weight * r["mtp_loss"], rel=1e-6)
