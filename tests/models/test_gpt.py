"""GPTModel: shapes, loss at initialisation, gradients, tied embeddings, meta-device build."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dufu.models.gpt import GPTModel, causal_lm_loss
from dufu_testing import count_gpt_parameters

V, H, L, NH, P = 384, 64, 2, 4, 32  # the gpt_debug sizes
KW = dict(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, max_position_embeddings=P)


def make(**kw) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(**{**KW, **kw})


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (3, P + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_forward_shapes_and_loss_at_init(batch):
    model = make()
    ids, labels = batch
    out = model(ids, shift_labels=labels)
    assert out.logits.shape == (3, P, V)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    # Small random weights: the prediction is close to uniform over the vocabulary.
    assert abs(out.loss.item() - math.log(V)) < 0.5
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)))
    assert model(ids).loss is None
    assert model(ids[:, :5]).logits.shape == (3, 5, V)  # shorter sequences work


def test_sequence_longer_than_positions_is_rejected():
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        make()(torch.zeros(1, P + 1, dtype=torch.long))


def test_causal_lm_loss_ignores_index():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [0, 4, -100]])
    keep = labels != -100
    expected = F.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(causal_lm_loss(logits, labels), expected)


def test_backward_gives_finite_gradients_for_every_parameter(batch):
    model = make()
    ids, labels = batch
    model(ids, shift_labels=labels).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    # Every block and the embedding actually receive signal.
    assert model.wte.weight.grad.abs().sum() > 0
    assert all(b.mlp.fc1.weight.grad.abs().sum() > 0 for b in model.blocks.values())


def test_tied_embeddings_are_one_tensor(batch):
    model = make()
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # named once
    assert sum(p.numel() for p in model.parameters()) == count_gpt_parameters(V, H, L, P)
    ids, labels = batch
    model(ids, shift_labels=labels).loss.backward()
    # The one tensor gets both gradients (embedding lookup + output head).
    assert model.lm_head.weight.grad is model.wte.weight.grad
    untied = make(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert sum(p.numel() for p in untied.parameters()) == count_gpt_parameters(V, H, L, P, tied=False)


def test_blocks_are_keyed_by_index():
    model = make(num_layers=3)
    assert list(model.blocks.keys()) == ["0", "1", "2"]
    assert [b.layer_idx for b in model.blocks.values()] == [0, 1, 2]
    assert "blocks.2.attn.q_proj.weight" in model.state_dict()


def test_init_is_gpt2_init():
    model = make(num_layers=4, hidden_size=128, num_attention_heads=4)
    std = 0.02
    assert model.wte.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.blocks["0"].attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    # Residual projections are scaled by 1/sqrt(2 * num_layers).
    scaled = std / math.sqrt(2 * 4)
    assert model.blocks["0"].attn.out_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert model.blocks["1"].mlp.fc2.weight.std().item() == pytest.approx(scaled, rel=0.05)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert (p == 0).all(), name
        if ".ln" in name and name.endswith("weight"):
            assert (p == 1).all(), name


def test_meta_build_then_to_empty_and_init_weights(batch):
    with torch.device("meta"):
        model = GPTModel(**KW)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.wte.weight
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    # Tying survives materialisation, and the head is initialised (not left as uninitialised memory).
    assert model.lm_head.weight is model.wte.weight
    assert sum(p.numel() for p in model.parameters()) == count_gpt_parameters(V, H, L, P)

    # init_weights alone determines every parameter: a model built normally and re-initialised from the
    # same seed is identical, so no parameter keeps its pre-init (here: uninitialised) values.
    reference = make()
    torch.manual_seed(0)
    reference.init_weights()
    ref_sd = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, ref_sd[name], rtol=0, atol=0, msg=name)

    ids, labels = batch
    loss = model(ids, shift_labels=labels).loss
    assert abs(loss.item() - math.log(V)) < 0.5
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_dropout_only_in_training_mode(batch):
    model = make(embedding_dropout=0.5, hidden_dropout=0.5, attention_dropout=0.5)
    ids, _ = batch
    model.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.train()
    with torch.no_grad():
        c = model(ids).logits
    assert not torch.allclose(a, c)
