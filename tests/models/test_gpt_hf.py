"""GPT-2 and transformers: imported weights give transformers' logits (also with padding), exported weights
load in transformers' Auto classes, lazy per-module loading, ``model.pretrained``, and the parameter counts
of the packaged GPT-2 sizes."""

from __future__ import annotations

import pytest
import torch

import dufu
from dufu.config import LazyConfig, instantiate, resolve_config_path
from dufu.errors import DataError
from dufu.models.gpt import GPTModel
from dufu.engine.weights.pretrained import load_pretrained
from dufu.models.hub import HFWeights
from dufu_testing import count_gpt_parameters

transformers = pytest.importorskip("transformers")

V, H, L, NH, P = 100, 64, 2, 4, 64
ATOL = 1e-4  # fp32


def hf_gpt2(tie: bool = True, **kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=P,
                                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, **kw)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 init, so their mapping is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2_hf")
    model = hf_gpt2()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))


def test_import_gives_transformers_logits_and_loss(hf_dir, ids):
    path, hf = hf_dir
    ours = dufu.from_pretrained(path).eval()
    assert isinstance(ours, GPTModel) and ours.lm_head.weight is ours.wte.weight
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        out = ours(ids, labels=ids)
    assert ref.logits.abs().max() > 0.1  # not a trivially small output
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # shift_labels: the already-shifted targets give the same loss
        shifted = ours(ids[:, :-1], shift_labels=ids[:, 1:]).loss
    torch.testing.assert_close(shifted, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_matches_transformers(hf_dir, ids, side):
    path, hf = hf_dir
    ours = dufu.from_pretrained(path).eval()
    mask = torch.ones_like(ids)
    if side == "left":
        mask[1, :5], mask[2, :9] = 0, 0
    else:
        mask[1, -5:], mask[2, -9:] = 0, 0
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # outputs at padding positions are meaningless in both
    torch.testing.assert_close(out[real], ref[real], rtol=0, atol=ATOL)
    if side == "left":  # left padding precedes real tokens: the mask must keep them from attending to it
        with torch.no_grad():
            unmasked = ours(ids).logits
        assert not torch.allclose(unmasked[real], out[real], atol=1e-3)


@pytest.mark.parametrize("tie", [True, False])
def test_export_loads_in_transformers_auto_class(tmp_path, ids, tie):
    torch.manual_seed(2)
    ours = GPTModel(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, max_position_embeddings=P,
                    tie_word_embeddings=tie).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    dufu.save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=ATOL)
    back = dufu.from_pretrained(tmp_path).eval()  # and back again, exactly
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_a_pipeline_stage_reads_only_its_own_tensors(hf_dir, monkeypatch):
    from dufu.parallel.pipeline import build_stage_module

    path, _ = hf_dir
    read = []
    original = HFWeights.__getitem__
    monkeypatch.setattr(HFWeights, "__getitem__", lambda self, k: read.append(k) or original(self, k))
    torch.manual_seed(0)
    full = GPTModel(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, max_position_embeddings=P)
    stage = build_stage_module(full, stage=1, num_stages=2, stage_ids=[0, 1])  # block 1, ln_f, head
    load_pretrained(stage, path)
    assert read and all(k.startswith(("transformer.h.1.", "transformer.ln_f.", "transformer.wte.")) for k in read), read
    assert not any(k.startswith("transformer.h.0.") for k in read)
    reference = dufu.from_pretrained(path)
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=0, atol=0, msg=name)


def test_model_pretrained_key_loads_the_weights_and_checks_sizes(hf_dir):
    path, _ = hf_dir
    kw = dict(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, max_position_embeddings=P)
    built = GPTModel(**kw, pretrained=str(path))  # building reads nothing: the weights are a separate step
    assert built.pretrained_path == str(path)
    ours = load_pretrained(built)
    reference = dufu.from_pretrained(path)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, rtol=0, atol=0, msg=name)
    with pytest.raises(DataError, match=r"num_layers=3 \(pretrained: 2\)"):
        load_pretrained(GPTModel(**{**kw, "num_layers": 3}, pretrained=str(path)))
    with pytest.raises(DataError, match="do not exist"):
        load_pretrained(GPTModel(**kw, pretrained=str(path / "missing")))
    with torch.device("meta"):  # start-up checks build on meta: nothing is read
        assert GPTModel(**kw, pretrained=str(path / "missing")).wte.weight.is_meta


# GPT-2 sizes: (recipe, hidden, layers, heads, published parameter count with GPT-2's 50,257-token vocabulary)
GPT2_SIZES = [
    ("gpt2_small", 768, 12, 12, 124_439_808),
    ("gpt2_medium", 1024, 24, 16, 354_823_168),
    ("gpt2_large", 1280, 36, 20, 774_030_080),
    ("gpt2_xl", 1600, 48, 25, 1_557_611_200),
]


@pytest.mark.parametrize("recipe,hidden,layers,heads,published", GPT2_SIZES)
def test_packaged_gpt2_sizes_have_the_published_parameter_counts(recipe, hidden, layers, heads, published):
    cfg = LazyConfig.load(resolve_config_path(recipe))
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.max_position_embeddings) == (hidden, layers, heads, 1024)
    assert m.vocab_size == 50304  # 50,257 padded to a multiple of 128
    assert count_gpt_parameters(50257, hidden, layers, 1024) == published
    for vocab, expected in ((50304, published + 47 * hidden), (50257, published)):
        m.vocab_size = vocab
        with torch.device("meta"):
            model = instantiate(m)
        assert sum(p.numel() for p in model.parameters()) == expected  # the tied head counts once
