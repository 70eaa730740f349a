"""MoEModel: transformers parity both ways for Mixtral and Qwen2-MoE (a gated shared expert, dense and MoE blocks
mixed by decoder_sparse_step and mlp_only_layers), checkpoints with one tensor per expert, greedy generation,
meta build, the auxiliary loss reaching the gradients, refusals, and the packaged sizes."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dufu
from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.errors import DufuError
from dufu.layers import MoE
from dufu.models.hub import adapter_for_model, build_from_hf_config
from dufu.models.llama import LlamaModel
from dufu.models.moe import MoEModel

transformers = pytest.importorskip("transformers")

V, H, NH, NKV, P = 256, 64, 4, 2, 64
ATOL = 1e-5  # fp32
COMMON = dict(vocab_size=V, hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=P,
              bos_token_id=None, eos_token_id=None)
# Qwen2-MoE: 4 blocks, (i + 1) % 2 == 0 -> 1 and 3 are MoE blocks, but 3 is in mlp_only_layers: only 1 is.
QWEN_MOE_LAYERS = ["1"]
ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def perturbed(model):
    """Norms and biases away from their 1 / 0 init, so their mapping is tested too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
                                         num_experts_per_tok=2, router_aux_loss_coef=0.02)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=40,
            num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
            router_aux_loss_coef=0.01)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    return perturbed(model).eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for kind in ("mixtral", "qwen2_moe"):
        path = tmp_path_factory.mktemp(kind)
        model = hf_model(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_import_gives_transformers_logits_and_loss(hf_dirs, ids, kind):
    path, hf = hf_dirs[kind]
    ours = dufu.from_pretrained(path).eval()
    assert isinstance(ours, MoEModel) and not isinstance(ours, LlamaModel)
    if kind == "mixtral":
        assert list(ours.moe_layers()) == ["0", "1"] and ours.norm_topk_prob and ours.shared_ffn_hidden_size is None
        assert (ours.num_experts, ours.moe_ffn_hidden_size, ours.aux_loss_coeff) == (4, 48, 0.02)
    else:
        assert list(ours.moe_layers()) == QWEN_MOE_LAYERS and not ours.norm_topk_prob
        assert (ours.moe_layer_freq, ours.mlp_only_layers, ours.shared_ffn_hidden_size) == (2, (3,), 40)
        assert ours.blocks["1"].mlp.shared_gate is not None and ours.blocks["0"].attn.q_proj.bias is not None
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        out = ours(ids, labels=ids)
    assert ref.logits.abs().max() > 0.1
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)  # transformers adds no aux loss here


def moe_kwargs(kind: str) -> dict:
    kw = dict(vocab_size=V, hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV,
              max_position_embeddings=P, num_experts=4, top_k=2, rope_theta=10000.0)
    if kind == "mixtral":
        return dict(kw, num_layers=2, ffn_hidden_size=48, tie_word_embeddings=True)
    return dict(kw, num_layers=4, ffn_hidden_size=96, moe_ffn_hidden_size=32, num_experts=8, qkv_bias=True,
                norm_topk_prob=False, shared_ffn_hidden_size=40, shared_expert_gate=True, moe_layer_freq=2,
                mlp_only_layers=[3])


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_export_loads_in_transformers_auto_class(tmp_path, ids, kind):
    torch.manual_seed(3)
    ours = perturbed(MoEModel(**moe_kwargs(kind))).eval()
    dufu.save_pretrained(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == kind
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ARCH[kind]
    if kind == "qwen2_moe":
        assert type(hf.model.layers[1].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
        assert [type(hf.model.layers[i].mlp).__name__ for i in (0, 2, 3)] == ["Qwen2MoeMLP"] * 3
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=ATOL)
    back = dufu.from_pretrained(tmp_path).eval()
    assert (back.tie_word_embeddings, list(back.moe_layers())) == (ours.tie_word_embeddings, list(ours.moe_layers()))
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


def per_expert(sd: dict, kind: str) -> dict:
    """transformers 5's grouped expert tensors -> one tensor per expert, as earlier versions stored them."""
    out = {}
    for key, t in sd.items():
        layer, _, leaf = key.partition(".mlp.experts.")
        if not leaf:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if kind == "mixtral" else key] = t
            continue
        prefix = layer + (".block_sparse_moe.experts." if kind == "mixtral" else ".mlp.experts.")
        names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(t.shape[0]):
            if leaf == "gate_up_proj":
                gate, up = t[e].chunk(2)  # (F, H) each
                out[f"{prefix}{e}.{names[0]}.weight"], out[f"{prefix}{e}.{names[1]}.weight"] = gate.clone(), up.clone()
            else:
                out[f"{prefix}{e}.{names[2]}.weight"] = t[e].clone()
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_checkpoints_with_one_tensor_per_expert_load_too(hf_dirs, ids, tmp_path, kind):
    from safetensors.torch import save_file

    path, hf = hf_dirs[kind]
    old = per_expert({k: v.contiguous() for k, v in hf.state_dict().items()}, kind)
    assert not any("gate_up_proj" in k for k in old)
    save_file(old, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = dufu.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)


def test_greedy_generation_equals_transformers(hf_dirs):
    from dufu.engine.inference.generate import generate

    path, hf = hf_dirs["qwen2_moe"]
    ours = dufu.from_pretrained(path).eval()
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)
    cached = generate(ours, prompt, 12, temperature=0)
    assert torch.equal(cached, expected)
    assert torch.equal(generate(ours, prompt, 12, temperature=0, use_cache=False), cached)


def test_moe_with_a_gated_shared_expert_equals_qwen2_moe_block():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    for norm in (False, True):
        cfg = transformers.Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                          num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm)
        torch.manual_seed(0)
        ref = Qwen2MoeSparseMoeBlock(cfg).eval()
        for p in ref.parameters():
            torch.nn.init.normal_(p, std=0.2)
        ours = MoE(32, 24, 6, top_k=2, norm_topk_prob=norm, shared_ffn_hidden_size=40, shared_expert_gate=True)
        ours.load_state_dict({
            "router.weight": ref.gate.weight, "experts.gate_up_proj": ref.experts.gate_up_proj,
            "experts.down_proj": ref.experts.down_proj, "shared_gate.weight": ref.shared_expert_gate.weight,
            **{f"shared.{n}.weight": getattr(ref.shared_expert, n).weight
               for n in ("gate_proj", "up_proj", "down_proj")},
        })
        x = torch.randn(3, 7, 32)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


def tiny(**kw) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(**{**moe_kwargs("qwen2_moe"), **kw})


def test_parameter_names_and_the_decoder_contract():
    model = tiny()
    sd = model.state_dict()
    for name in ("blocks.1.mlp.router.weight", "blocks.1.mlp.experts.gate_up_proj", "blocks.1.mlp.experts.down_proj",
                 "blocks.1.mlp.shared.gate_proj.weight", "blocks.1.mlp.shared.up_proj.weight",
                 "blocks.1.mlp.shared.down_proj.weight", "blocks.1.mlp.shared_gate.weight",
                 "blocks.0.mlp.gate_proj.weight", "blocks.3.mlp.down_proj.weight"):
        assert name in sd, name
    assert sd["blocks.1.mlp.experts.gate_up_proj"].shape == (8, 64, H)
    assert sd["blocks.1.mlp.experts.down_proj"].shape == (8, H, 32)
    assert sd["blocks.0.mlp.gate_proj.weight"].shape == (96, H)
    assert not any("inv_freq" in k for k in sd)
    assert model.pipeline_layout == {"blocks": "blocks", "first": ("wte",), "last": ("norm", "lm_head")}
    assert model.main_input_name == "input_ids" and MoEModel.pipeline_loss is LlamaModel.pipeline_loss
    assert adapter_for_model(model).dufu_classes == (MoEModel,)  # not the dense family's mapping


def test_stages_chain_to_the_whole_model():
    from dufu.parallel.pipeline import build_stage_module

    model = tiny().eval()
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for s in range(2):
        h = build_stage_module(model, s, 2, [0, 0, 1, 1])(h)
    with torch.no_grad():
        torch.testing.assert_close(h, model(tokens).logits, rtol=0, atol=1e-6)


def test_meta_build_then_materialise():
    from dufu.parallel.materialize import materialize_

    with torch.device("meta"):
        model = tiny(tie_word_embeddings=True)
    assert all(p.is_meta for p in model.parameters()) and model.lm_head.weight is model.wte.weight
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = tiny(tie_word_embeddings=True)
    torch.manual_seed(0)
    reference.init_weights()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    # per-module initialisation (what a parallel run does): a meta build gives a real build's values
    with torch.device("meta"):
        meta = tiny()
    meta = materialize_(meta, meta, torch.device("cpu"), seed=5)
    real = tiny()
    real = materialize_(real, real, torch.device("cpu"), seed=5)
    for name, value in real.state_dict().items():
        torch.testing.assert_close(meta.state_dict()[name], value, rtol=0, atol=0, msg=name)
    experts = meta.blocks["1"].mlp.experts.gate_up_proj
    assert experts.std().item() == pytest.approx(0.02, rel=0.1)
    assert meta.blocks["1"].mlp.router.weight.std().item() == pytest.approx(0.02, rel=0.3)


def test_the_auxiliary_loss_reaches_the_routers_through_backward():
    """The returned loss is the LM loss alone, yet its backward also carries the load-balancing loss of every
    MoE block: the gradients equal those of LM loss + the sum of transformers' per-layer balancing losses."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    kw = dict(moe_kwargs("mixtral"), num_layers=3)
    with_aux, without = MoEModel(**kw, aux_loss_coeff=0.5), MoEModel(**kw, aux_loss_coeff=0.0)
    without.load_state_dict(with_aux.state_dict())
    tokens = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(2))
    loss = with_aux(tokens[:, :-1], shift_labels=tokens[:, 1:]).loss
    loss.backward()

    logits = []  # router logits of every MoE block, with their graph
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: logits.append(out))
             for m in without.moe_layers().values()]
    plain = without(tokens[:, :-1], shift_labels=tokens[:, 1:]).loss
    for h in hooks:
        h.remove()
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)  # the aux loss is not in the returned loss
    aux = sum(0.5 * load_balancing_loss_func((lg,), 4, 2) for lg in logits)
    (plain + aux).backward()
    for (name, p), q in zip(with_aux.named_parameters(), without.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
    lm_only = MoEModel(**kw, aux_loss_coeff=0.0)  # the LM loss alone moves the routers less far
    lm_only.load_state_dict(with_aux.state_dict())
    lm_only(tokens[:, :-1], shift_labels=tokens[:, 1:]).loss.backward()
    for key, moe in with_aux.moe_layers().items():
        extra = moe.router.weight.grad - lm_only.blocks[key].mlp.router.weight.grad
        assert extra.abs().max() > 1e-3 * moe.router.weight.grad.abs().max(), key


@pytest.mark.parametrize("hf_config,match", [
    (dict(model_type="mixtral", sliding_window=4096), "sliding_window=4096"),
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(model_type="qwen2_moe", use_sliding_window=True), "use_sliding_window"),
    (dict(model_type="qwen2_moe", layer_types=["full_attention", "sliding_attention"]), "sliding"),
    (dict(model_type="qwen2_moe", num_experts=0), "num_experts=0"),
])
def test_unsupported_transformers_configs_are_refused(hf_config, match):
    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=NH, intermediate_size=48,
                hidden_act="silu")
    with pytest.raises(DufuError, match=match):
        build_from_hf_config({**base, **hf_config})
    build_from_hf_config({**base, "model_type": hf_config["model_type"]})  # the same without it builds


@pytest.mark.parametrize("kw,match", [
    (dict(shared_expert_gate=False), "shared expert without a gate"),
    (dict(shared_ffn_hidden_size=None, shared_expert_gate=False), "dense blocks"),
    (dict(shared_ffn_hidden_size=None, shared_expert_gate=False, moe_layer_freq=1, mlp_only_layers=()), "Q/K/V"),
])
def test_models_transformers_cannot_describe_are_refused_on_export(tmp_path, kw, match):
    with pytest.raises(DufuError, match=match):
        dufu.save_pretrained(tiny(**kw), tmp_path)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_config_export_then_import_gives_the_constructor_arguments(kind):
    from dufu.models.hub import adapters

    kwargs = dict(moe_kwargs(kind), head_dim=8, rms_norm_eps=1e-5, rope_theta=5e5, attention_dropout=0.1,
                  rope_scaling={"rope_type": "linear", "factor": 2.0}, initializer_range=0.03, aux_loss_coeff=0.02)
    if kind == "mixtral":
        kwargs.update(num_experts=6, top_k=3, moe_ffn_hidden_size=48)
    else:
        kwargs.update(top_k=4, mlp_only_layers=[0], moe_layer_freq=1, tie_word_embeddings=True)
    with torch.device("meta"):
        model = MoEModel(**kwargs)
    hf = adapter_for_model(model).config_to_hf(model)
    assert hf["model_type"] == kind and hf["architectures"] == [ARCH[kind]]
    back = adapters()[kind].config_from_hf(hf)
    assert {k: back[k] for k in kwargs} == {k: tuple(v) if k == "mlp_only_layers" else v for k, v in kwargs.items()}
    getattr(transformers, {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig"}[kind])(**hf)  # a valid config


def test_constructor_checks_the_layer_pattern():
    with pytest.raises(ValueError, match="moe_layer_freq"):
        tiny(moe_layer_freq=0)
    with pytest.raises(ValueError, match=r"mlp_only_layers \[7\]"):
        tiny(mlp_only_layers=[7])


def moe_parameters(vocab, hidden, layers, heads, kv_heads, experts, expert_ffn, shared_ffn=0, qkv_bias=False) -> int:
    """A MoE decoder's parameter count from its shapes (every block a MoE block, untied head)."""
    hd = hidden // heads
    attn = 2 * hidden * heads * hd + 2 * hidden * kv_heads * hd + (heads * hd + 2 * kv_heads * hd if qkv_bias else 0)
    moe = experts * 3 * hidden * expert_ffn + experts * hidden  # experts + router
    if shared_ffn:
        moe += 3 * hidden * shared_ffn + hidden  # shared expert + its gate
    return 2 * vocab * hidden + layers * (attn + moe + 2 * hidden) + hidden


@pytest.mark.parametrize("recipe,expected,shape", [
    ("mixtral_8x7b", 46_702_792_704, (32000, 4096, 32, 32, 8, 8, 14336)),  # Mixtral-8x7B's 46.7B
    ("qwen2_moe_a2_7b", 14_315_784_192, (151936, 2048, 24, 16, 16, 60, 1408, 5632, True)),  # Qwen1.5-MoE's 14.3B
])
def test_packaged_sizes_have_the_published_parameter_counts(recipe, expected, shape):
    assert moe_parameters(*shape) == expected
    cfg = LazyConfig.load(resolve_config_path(recipe))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    assert isinstance(model, MoEModel) and len(model.moe_layers()) == model.num_layers
    assert sum(p.numel() for p in model.parameters()) == expected


def test_moe_debug_is_the_tiny_test_model():
    cfg = LazyConfig.load(resolve_config_path("moe_debug"))
    m = cfg.model
    assert (m.hidden_size, m.num_experts, m.top_k, m.aux_loss_coeff) == (64, 8, 2, 0.01)
    assert cfg.dataloader.train.seq_length == 32 and cfg.tokenization.tokenizer.kind == "byte"
    model = instantiate(m)
    tokens = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1], shift_labels=tokens[:, 1:])
    assert abs(out.loss.item() - math.log(m.vocab_size)) < 0.5
