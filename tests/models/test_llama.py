"""LlamaModel: transformers parity both ways (Llama with GQA and Llama 3 RoPE scaling, Qwen2 with Q/K/V
biases and a tied head), HF-style inputs and outputs, pipeline hooks, meta build, packaged sizes, and
starting from pretrained weights (``model.pretrained`` / ``pretrained_model``)."""

from __future__ import annotations

import math

import pytest
import torch

import dufu
from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.errors import DataError
from dufu.models.gpt import causal_lm_loss
from dufu.engine.weights.pretrained import load_pretrained, pretrained_model
from dufu.models.llama import LlamaModel
from dufu.models.outputs import ModelOutput

transformers = pytest.importorskip("transformers")

V, H, L, NH, NKV, FFN, P = 96, 64, 2, 4, 2, 128, 64
ATOL = 1e-4  # fp32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=NKV, max_position_embeddings=P, bos_token_id=None, eos_token_id=None)
    if kind == "llama":  # Llama 3.1-style RoPE scaling; its original context (16) is shorter than the inputs
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE)))
    elif kind == "llama_bias":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so their mapping is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for kind in ("llama", "llama_bias", "qwen2"):
        path = tmp_path_factory.mktemp(kind)
        model = hf_model(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2"])
def test_import_gives_transformers_logits_and_loss(hf_dirs, ids, kind):
    path, hf = hf_dirs[kind]
    ours = dufu.from_pretrained(path).eval()
    assert isinstance(ours, LlamaModel)
    assert (ours.num_attention_heads, ours.num_key_value_heads) == (NH, NKV)
    assert (ours.lm_head.weight is ours.wte.weight) == (kind == "qwen2")
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        out = ours(ids, labels=ids)
    assert isinstance(out, ModelOutput) and ref.logits.abs().max() > 0.1
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        shifted = ours(ids[:, :-1], shift_labels=ids[:, 1:]).loss
    torch.testing.assert_close(shifted, ref.loss, rtol=1e-5, atol=1e-6)


def test_llama3_rope_scaling_is_applied(hf_dirs, ids):
    path, _ = hf_dirs["llama"]
    ours = dufu.from_pretrained(path).eval()
    assert ours.rope_scaling["rope_type"] == "llama3" and ours.rope_theta == 500000.0
    plain = dufu.from_pretrained(path, rope_scaling=None).eval()
    with torch.no_grad():
        assert not torch.allclose(ours(ids).logits, plain(ids).logits, atol=1e-3)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_and_positions_match_transformers(hf_dirs, ids, side):
    path, hf = hf_dirs["llama"]
    ours = dufu.from_pretrained(path).eval()
    mask = torch.ones_like(ids)
    if side == "left":
        mask[1, :5], mask[2, :11] = 0, 0
    else:
        mask[1, -5:], mask[2, -11:] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kw in ({"attention_mask": mask}, {"attention_mask": mask, "position_ids": positions}):
            ref = hf(ids, **kw).logits
            out = ours(ids, **kw).logits
            torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "llama_bias", "qwen2"])
def test_export_loads_in_transformers_auto_class(tmp_path, ids, kind):
    torch.manual_seed(3)
    kw = dict(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, num_key_value_heads=NKV,
              ffn_hidden_size=FFN, max_position_embeddings=P)
    if kind == "llama":
        kw.update(rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    elif kind == "llama_bias":
        kw.update(qkv_bias=True, out_bias=True, mlp_bias=True)
    else:
        kw.update(qkv_bias=True, tie_word_embeddings=True)
    ours = LlamaModel(**kw).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    dufu.save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=ATOL)
    back = dufu.from_pretrained(tmp_path).eval()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


def make(**kw) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(**{**dict(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, ffn_hidden_size=176, max_position_embeddings=32), **kw})


def test_forward_contract_for_trainer_and_pipeline():
    model = make(num_layers=3)
    assert list(model.blocks) == ["0", "1", "2"] and [b.layer_idx for b in model.blocks.values()] == [0, 1, 2]
    assert model.pipeline_layout == {"blocks": "blocks", "first": ("wte",), "last": ("norm", "lm_head")}
    assert model.main_input_name == "input_ids" and LlamaModel.pipeline_loss is causal_lm_loss
    assert "blocks.2.attn.k_proj.weight" in model.state_dict()
    assert not any("inv_freq" in k for k in model.state_dict())  # rotary tables are not checkpointed
    tokens = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1], shift_labels=tokens[:, 1:])
    assert out.logits.shape == (2, 32, 384) and abs(out.loss.item() - math.log(384)) < 0.5
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model.return_dict = False  # a pipeline stage returns a plain tensor
    logits = model(tokens[:, :-1])
    assert isinstance(logits, torch.Tensor) and torch.equal(logits, out.logits.detach())
    # grouped-query attention: K/V projections have num_key_value_heads * head_dim outputs
    assert model.blocks["0"].attn.k_proj.weight.shape == (2 * 16, 64)


def test_stages_chain_to_the_whole_model():
    from dufu.parallel.pipeline import build_stage_module

    model = make(num_layers=4, tie_word_embeddings=True).eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for s in range(2):
        stage = build_stage_module(model, s, 2, [0, 0, 1, 1])
        assert list(stage.blocks) == (["0", "1"] if s == 0 else ["2", "3"])
        h = stage(h)
    with torch.no_grad():
        torch.testing.assert_close(h, model(tokens).logits, rtol=0, atol=1e-6)


def test_meta_build_then_materialise():
    with torch.device("meta"):
        model = make(tie_word_embeddings=True)
    assert all(p.is_meta for p in model.parameters()) and model.lm_head.weight is model.wte.weight
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = make(tie_word_embeddings=True)
    torch.manual_seed(0)
    reference.init_weights()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(model.blocks["1"].rotary.inv_freq, reference.blocks["1"].rotary.inv_freq)


def llama_parameters(vocab, hidden, layers, heads, kv_heads, ffn, tied=False, qkv_bias=False) -> int:
    """LLaMA's parameter count from its shapes."""
    hd = hidden // heads
    attn = hidden * heads * hd + 2 * hidden * kv_heads * hd + heads * hd * hidden
    if qkv_bias:
        attn += heads * hd + 2 * kv_heads * hd
    per_layer = attn + 3 * hidden * ffn + 2 * hidden  # + SwiGLU + two RMSNorm weights
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


@pytest.mark.parametrize("recipe,expected,shape", [
    ("llama3_8b", 8_030_261_248, (128256, 4096, 32, 32, 8, 14336, False, False)),
    ("llama2_7b", 6_738_415_616, (32000, 4096, 32, 32, 32, 11008, False, False)),
    ("qwen2_0_5b", 494_032_768, (151936, 896, 24, 14, 2, 4864, True, True)),
])
def test_packaged_sizes_have_the_published_parameter_counts(recipe, expected, shape):
    assert llama_parameters(*shape) == expected
    cfg = LazyConfig.load(resolve_config_path(recipe))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == expected  # a tied head counts once
    assert (model.vocab_size, model.hidden_size, model.num_layers) == shape[:3]


def test_llama_debug_is_the_tiny_test_model():
    cfg = LazyConfig.load(resolve_config_path("llama_debug"))
    m = cfg.model
    assert (m.vocab_size, m.num_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads) == (384, 2, 64, 4, 2)
    assert cfg.dataloader.train.seq_length == 32 and cfg.tokenization.tokenizer.kind == "byte"


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, dufu_cache_dir):
    """llama_debug trained for 3 steps (a dufu run to start from)."""
    from dufu_testing import train

    return train(tmp_path_factory.mktemp("llama_run") / "run", ["train.train_iter=3", "train.checkpointer.period=3"],
                 recipe="llama_debug")


def test_sft_recipe_starts_from_the_pretrained_run(pretrained_run, tmp_path):
    from dufu.engine.weights.checkpoint import Checkpointer
    from dufu_testing import load_config, train_config

    ckpt = Checkpointer(pretrained_run.output_dir / "checkpoints").latest()
    trained = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    cfg = load_config("llama_sft", [f"model.pretrained={pretrained_run.output_dir}"])
    model = instantiate(cfg.model)  # building reads nothing: the weights are a separate step
    assert model.pretrained_path == str(pretrained_run.output_dir)
    load_pretrained(model)
    for name, value in trained.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    for source in (pretrained_run.output_dir, ckpt):  # the functional form takes sizes from the run's config
        other = pretrained_model(path=str(source))
        for name, value in trained.items():
            torch.testing.assert_close(other.state_dict()[name], value, rtol=0, atol=0, msg=name)
    # and it trains: two steps of the SFT recipe from there, starting at the pretrained model's loss
    run = train_config(load_config("llama_sft", [
        f"model.pretrained={pretrained_run.output_dir}", "train.train_iter=2", "train.log_period=1",
        "train.evaluation.enabled=False", "train.tensorboard=False", "train.peak_tflops=1.0"]), tmp_path / "sft")
    assert len(run.losses) == 2 and all(math.isfinite(v) for v in run.losses.values())
    assert run.losses[1] < pretrained_run.losses[1]  # better than the random start of pretraining


def test_pretrained_sizes_must_match(pretrained_run):
    with pytest.raises(DataError, match=r"hidden_size=128 \(pretrained: 64\)"):
        load_pretrained(instantiate(load_sft_config(pretrained_run, "model.hidden_size=128")))


def load_sft_config(run, *overrides):
    from dufu_testing import load_config

    return load_config("llama_sft", [f"model.pretrained={run.output_dir}", *overrides]).model
