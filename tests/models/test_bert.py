"""BERT and RoBERTa: shapes, losses, gradients, padding, RoBERTa positions, pipeline stages, and parity with
Hugging Face transformers in both directions (import: same outputs; export: transformers loads every tensor)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dufu
from dufu.models.bert import (
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    RobertaModel,
    masked_lm_loss,
    sequence_classification_loss,
)

V, H, L, NH, P = 384, 64, 2, 4, 32  # the bert_debug sizes
KW = dict(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=NH, max_position_embeddings=P,
          hidden_dropout=0.0, attention_dropout=0.0)
ROBERTA_KW = {**KW, "max_position_embeddings": P + 2}
CLASSES = [BertModel, BertForMaskedLM, BertForSequenceClassification,
           RobertaModel, RobertaForMaskedLM, RobertaForSequenceClassification]


def make(cls, **kw):
    torch.manual_seed(0)
    base = ROBERTA_KW if cls.__name__.startswith("Roberta") else KW
    return cls(**{**base, **kw})


def batch(B=3, T=P, seed=1, low=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, 257, (B, T), generator=g)


def test_masked_lm_forward_loss_and_gradients():
    model = make(BertForMaskedLM)
    ids = batch()
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    out = model(ids, labels=labels)
    assert out.logits.shape == (3, P, V)
    assert abs(out.loss.item() - math.log(V)) < 0.5  # near-uniform predictions at initialisation
    keep = labels != -100
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[keep], labels[keep]))
    torch.testing.assert_close(masked_lm_loss(out.logits, labels), out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert all(b.mlp.fc1.weight.grad.abs().sum() > 0 for b in model.blocks.values())
    assert model(ids).loss is None


def test_masked_lm_head_is_tied_to_the_token_embedding():
    model = make(BertForMaskedLM)
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    untied = make(BertForMaskedLM, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight


@pytest.mark.parametrize("cls", [BertForSequenceClassification, RobertaForSequenceClassification])
def test_sequence_classification_losses(cls):
    model = make(cls, num_labels=3)
    ids = batch()
    y = torch.tensor([0, 2, 1])
    out = model(ids, labels=y)
    assert out.logits.shape == (3, 3)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, y))
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    reg = make(cls, num_labels=1)
    target = torch.tensor([0.5, -1.0, 2.0])
    out = reg(ids, labels=target)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), target))
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    logits = torch.randn(3, 3)
    torch.testing.assert_close(sequence_classification_loss(logits, multi),
                               F.binary_cross_entropy_with_logits(logits, multi))


@pytest.mark.parametrize("cls", [BertModel, RobertaModel])
def test_headless_model_returns_hidden_states_and_pooled_vector(cls):
    model = make(cls)
    out = model(batch())
    assert out.last_hidden_state.shape == (3, P, H)
    assert out.pooler_output.shape == (3, H)
    assert out.loss is None and out.logits is None


@pytest.mark.parametrize("cls", [BertModel, RobertaModel])
def test_padding_does_not_change_the_tokens(cls):
    """A padded sequence gives the same hidden states at its real tokens as the unpadded one."""
    model = make(cls).eval()
    pad = model.pad_token_id
    ids = batch(B=1, T=20)
    padded = torch.cat([ids, torch.full((1, 6), pad)], dim=1)
    mask = torch.cat([torch.ones(1, 20, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        a = model(ids).last_hidden_state
        b = model(padded, attention_mask=mask).last_hidden_state[:, :20]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_roberta_positions_start_after_padding_and_skip_pads():
    model = make(RobertaModel)
    pad = model.pad_token_id
    ids = torch.tensor([[5, 6, 7, pad, pad], [5, pad, 7, 8, 9]])
    assert model.default_position_ids(ids).tolist() == [[2, 3, 4, 1, 1], [2, 1, 3, 4, 5]]
    assert make(BertModel).default_position_ids(ids).tolist() == [[0, 1, 2, 3, 4]]
    model(batch(B=1, T=P))  # P tokens fit P + 2 positions
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model(batch(B=1, T=P + 1))


def test_token_types_change_the_output():
    model = make(BertModel).eval()
    ids = batch(B=1, T=8)
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        a = model(ids).last_hidden_state
        b = model(ids, token_type_ids=types).last_hidden_state
    assert not torch.allclose(a, b)


def test_init_and_meta_build():
    model = make(BertForMaskedLM, num_layers=4, hidden_size=128)
    assert model.blocks["0"].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks["3"].mlp.fc2.weight.std().item() == pytest.approx(0.02, rel=0.05)  # no residual scaling
    assert (model.wte.weight[0] == 0).all()  # the padding row
    assert (model.lm_head.bias == 0).all() and (model.blocks["1"].ln1.weight == 1).all()
    with torch.device("meta"):
        meta = BertForMaskedLM(**KW)
    assert all(p.is_meta for p in meta.parameters()) and meta.lm_head.weight is meta.wte.weight
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert meta.lm_head.weight is meta.wte.weight
    out = meta(batch(), labels=batch())
    assert torch.isfinite(out.loss)


def test_blocks_and_declared_parallel_styles():
    model = make(BertForMaskedLM, num_layers=3)
    assert list(model.blocks) == ["0", "1", "2"] and [b.layer_idx for b in model.blocks.values()] == [0, 1, 2]
    from dufu.parallel import transformer_blocks
    from dufu.parallel.tensor_parallel import tensor_parallel_plan

    assert [n for n, _ in transformer_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    plan = {k: type(v).__name__ for k, v in tensor_parallel_plan(model, head=model.lm_head).items()}
    assert plan["wte"] == "RowwiseParallel" and plan["lm_head"] == "ColwiseParallel"
    assert plan["blocks.0.attn.q_proj"] == "ColwiseParallel" and plan["blocks.0.attn.out_proj"] == "RowwiseParallel"
    assert plan["blocks.0.mlp.fc1"] == "ColwiseParallel" and plan["blocks.0.mlp.fc2"] == "RowwiseParallel"
    sp = {k: type(v).__name__ for k, v in tensor_parallel_plan(model, sequence_parallel=True, head=model.lm_head).items()}
    for name in ("ln_emb", "blocks.0.ln1", "blocks.0.ln2", "mlm_transform.dense", "mlm_transform.ln"):
        assert sp[name] == "SequenceParallel", name
    assert sp["wpe"] == sp["token_types"] == "PrepareModuleOutput"


@pytest.mark.parametrize("cls", [BertForMaskedLM, RobertaForMaskedLM, BertForSequenceClassification])
def test_pipeline_stages_compose_to_the_whole_model(cls):
    from dufu.parallel.pipeline import build_stage_module

    model = make(cls).eval()
    ids = batch()
    with torch.no_grad():
        whole = model(ids).logits
        first = build_stage_module(model, 0, 2, [0, 1]).eval()
        last = build_stage_module(model, 1, 2, [0, 1]).eval()
        hidden = first(ids)
        assert hidden.shape == (3, P, H) and list(first.blocks) == ["0"] and list(last.blocks) == ["1"]
        torch.testing.assert_close(last(hidden), whole)
    assert cls.pipeline_loss is not None


# ------------------------------------------------------------------------------------ Hugging Face parity
transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "BertModel": transformers.BertModel,
    "BertForMaskedLM": transformers.BertForMaskedLM,
    "BertForSequenceClassification": transformers.BertForSequenceClassification,
    "RobertaModel": transformers.RobertaModel,
    "RobertaForMaskedLM": transformers.RobertaForMaskedLM,
    "RobertaForSequenceClassification": transformers.RobertaForSequenceClassification,
}


def hf_config(name: str, act: str = "gelu"):
    kw = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
              max_position_embeddings=40, num_labels=3, hidden_act=act, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)
    if name.startswith("Roberta"):
        return transformers.RobertaConfig(type_vocab_size=1, **kw)
    return transformers.BertConfig(type_vocab_size=2, **kw)


def padded_batch(pad: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = pad
    return ids, mask


def outputs(model, ids, mask, types=None):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **({"token_type_ids": types} if types is not None else {}))
    if getattr(out, "logits", None) is not None:
        return out.logits if out.logits.dim() == 2 else out.logits * mask[..., None]
    return out.last_hidden_state * mask[..., None]  # padded positions are don't-cares on both sides


@pytest.mark.parametrize("name", list(HF_CLASSES))
def test_import_and_export_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    cfg = hf_config(name, act="gelu_new" if name == "BertForMaskedLM" else "gelu")
    hf = HF_CLASSES[name](cfg).eval()
    with torch.no_grad():  # transformers initialises some tensors to zero: make every one matter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(tmp_path / "hf")
    ours = dufu.from_pretrained(tmp_path / "hf").eval()
    assert type(ours).__name__ == name
    ids, mask = padded_batch(cfg.pad_token_id)
    types = None if name.startswith("Roberta") else (torch.arange(12) >= 6).long().expand(3, 12)
    ref = outputs(hf, ids, mask, types)
    got = outputs(ours, ids, mask, types)
    assert (got - ref).abs().max().item() < 1e-4

    dufu.save_pretrained(ours, tmp_path / "dufu")
    back, info = HF_CLASSES[name].from_pretrained(tmp_path / "dufu", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert (outputs(back.eval(), ids, mask, types) - got).abs().max().item() < 1e-4


def test_a_bare_encoder_checkpoint_starts_a_classifier(tmp_path):
    """Fine-tuning: the encoder and pooler come from a BertModel checkpoint, the classifier is new."""
    torch.manual_seed(0)
    hf = transformers.BertModel(hf_config("BertModel")).eval()
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="classifier.weight, classifier.bias are not in the checkpoint"):
        model = dufu.from_pretrained(tmp_path, architecture="BertForSequenceClassification", num_labels=5)
    assert model.classifier.out_features == 5
    torch.testing.assert_close(model.pooler.dense.weight, hf.pooler.dense.weight)
    torch.testing.assert_close(model.blocks["1"].mlp.fc2.weight, hf.encoder.layer[1].output.dense.weight)


def test_a_masked_lm_checkpoint_loads_as_a_bare_encoder(tmp_path):
    """The other way round: the MLM head is dropped, the pooler (not in an MLM checkpoint) starts fresh."""
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(hf_config("BertForMaskedLM")).eval()
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="pooler.dense.weight, pooler.dense.bias are not in the checkpoint"):
        model = dufu.from_pretrained(tmp_path, architecture="BertModel").eval()
    ids, mask = padded_batch(0)
    with torch.no_grad():
        ref = hf.bert(input_ids=ids, attention_mask=mask).last_hidden_state * mask[..., None]
    assert (outputs(model, ids, mask) - ref).abs().max().item() < 1e-4
