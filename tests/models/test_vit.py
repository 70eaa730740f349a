"""ViT: shapes and loss, transformers parity both ways, the digits data, recipes, a short training run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dufu.data import collate
from dufu.data.images import build_digits_datasets
from dufu.engine.weights.pretrained import from_pretrained
from dufu.models import hub
from dufu.models.vit import ViTForImageClassification, count_vit_parameters

KW = dict(image_size=16, patch_size=4, num_channels=3, num_labels=7, hidden_size=32, num_layers=2,
          num_attention_heads=4, ffn_hidden_size=48)


def make(**kw) -> ViTForImageClassification:
    torch.manual_seed(0)
    return ViTForImageClassification(**{**KW, **kw})


def test_forward_shapes_loss_and_gradients():
    model = make()
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 3, 6])
    out = model(pixel_values=x, labels=y)
    assert out.logits.shape == (3, 7) and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, y))
    assert abs(out.loss.item() - math.log(7)) < 0.5
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model(x).loss is None
    with pytest.raises(ValueError, match="image_size"):
        model(torch.randn(1, 3, 32, 32))


def test_pipeline_stage_forward_is_the_whole_forward():
    """Split in two the way the pipeline builder splits: first stage (embeddings + block 0) then the rest."""
    from dufu.parallel.pipeline import build_stage_module

    model = make().eval()
    x = torch.randn(2, 3, 16, 16)
    first, last = (build_stage_module(model, s, 2, [0, 1]) for s in (0, 1))
    assert first.classifier is None and last.embeddings is None
    hidden = first(x)
    assert hidden.shape == (2, 17, 32)
    torch.testing.assert_close(last(hidden), model(x).logits)


def test_vit_b16_parameter_count_on_meta():
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(resolve_config_path("vit_base"))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == count_vit_parameters(224, 16, 3, 1000, 768, 12) == 86_567_656


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_transformers_parity_both_ways(act, tmp_path):
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=48, num_labels=7, hidden_act=act)
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))  # every tensor away from its initial value
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf").eval()
    assert isinstance(model, ViTForImageClassification) and model.num_labels == 7
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 5, 6])
    with torch.no_grad():
        expected, got = hf(pixel_values=x, labels=y), model(pixel_values=x, labels=y)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-4, atol=1e-4)

    hub.save_pretrained(model, tmp_path / "dufu")
    again = transformers.ViTForImageClassification.from_pretrained(tmp_path / "dufu").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(pixel_values=x).logits, got.logits, rtol=1e-4, atol=1e-4)


def test_transformers_in_memory_names_load_too():
    """transformers 5 renames tensors in memory (vit.layers.0.attention.q_proj ...); those load as well."""
    import transformers

    from dufu.models.vit.hf import MAPPING

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=48, num_labels=7)
    hf = transformers.ViTForImageClassification(cfg).eval()
    model = make()
    sd = {k: read() for k, read in MAPPING.tensor_sources(hf.state_dict(), model).items()}  # lazy readers
    assert set(sd) == set(model.state_dict())
    model.load_state_dict(sd)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x).logits, hf(pixel_values=x).logits, rtol=1e-4, atol=1e-4)


def test_digits_data():
    train, valid = build_digits_datasets(image_size=16, num_channels=3, valid_fraction=0.2, seed=1)
    assert len(train) + len(valid) == 1797 and len(valid) == 359
    s = train[0]
    assert s["pixel_values"].shape == (3, 16, 16) and s["pixel_values"].dtype == np.float32
    assert 0 <= int(s["labels"]) < 10
    assert train.pixel_values.min() >= -1.0 - 1e-6 and train.pixel_values.max() <= 1.0 + 1e-6  # (x - .5) / .5
    batch = collate(train, [0, 1, 2])
    assert batch["pixel_values"].shape == (3, 3, 16, 16) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].shape == (3,) and batch["labels"].dtype == torch.int64
    # the split is a seeded permutation: the same every time, a different one for another seed
    again, _ = build_digits_datasets(image_size=16, num_channels=3, valid_fraction=0.2, seed=1)
    np.testing.assert_array_equal(again.labels, train.labels)
    other, _ = build_digits_datasets(image_size=16, num_channels=3, valid_fraction=0.2, seed=2)
    assert not np.array_equal(other.labels, train.labels)
    assert set(np.unique(valid.labels)) == set(range(10))


def test_vit_debug_trains_and_reports_accuracy(tmp_path):
    from dufu_testing import train

    run = train(tmp_path / "vit", ["train.train_iter=10", "train.evaluation.enabled=True",
                                   "train.evaluation.eval_period=10", "train.evaluation.eval_iter=2"],
                recipe="vit_debug")
    losses = run.losses
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses.values())
    assert abs(losses[1] - math.log(10)) < 0.5
    evals = [r for r in run.records if "eval_loss" in r]
    assert 0.0 <= evals[-1]["eval_accuracy"] <= 1.0
