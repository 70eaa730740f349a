"""Swin: windows and shifts, transformers parity both ways, recipes, pipeline split, a short training run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dufu.layers import HeadwiseEmbedding
from dufu.engine.weights.pretrained import from_pretrained
from dufu.models import hub
from dufu.models.swin import SwinForImageClassification, count_swin_parameters
from dufu.models.swin.model import relative_position_index, shifted_window_mask, window_merge, window_partition

KW = dict(image_size=16, patch_size=2, num_channels=3, num_labels=5, embed_dim=16, depths=[2, 2],
          num_heads=[2, 4], window_size=4, drop_path_rate=0.0)


def make(**kw) -> SwinForImageClassification:
    torch.manual_seed(0)
    return SwinForImageClassification(**{**KW, **kw})


def test_windows_round_trip_and_relative_index():
    x = torch.randn(2, 8, 12, 5)
    w = window_partition(x, 4)
    assert w.shape == (2 * 2 * 3, 16, 5)
    torch.testing.assert_close(window_merge(w, 4, 8, 12), x)
    idx = relative_position_index(3)
    assert idx.shape == (9, 9) and idx.min() == 0 and idx.max() == 24
    assert (idx.diagonal() == 12).all()  # offset (0, 0) is the centre of the 5 x 5 table
    # a window smaller than the table's uses the table's centre
    small = relative_position_index(2, table_window=3)
    assert (small.diagonal() == 12).all() and small.max() < 25


def test_shift_mask_separates_wrapped_regions():
    mask = shifted_window_mask(8, 8, 4, 2)
    assert mask.shape == (4, 16, 16)
    assert (mask[0] == 0).all()  # the top-left window holds one region only
    assert set(mask.unique().tolist()) == {0.0, -100.0}
    assert (mask == mask.transpose(1, 2)).all()


def test_blocks_shapes_shifts_and_merging():
    model = make()
    blocks = list(model.blocks.values())
    assert [b.layer_idx for b in blocks] == [0, 1, 2, 3]
    assert [b.shift for b in blocks] == [0, 2, 0, 0]  # stage 2 is 4 x 4 = one window: no shift
    assert [b.downsample is not None for b in blocks] == [False, True, False, False]
    assert all(isinstance(b.attn.relative_position_bias, HeadwiseEmbedding) for b in blocks)
    assert model.num_layers == 4 and model.num_features == 32


def test_forward_shapes_loss_and_gradients():
    model = make(drop_path_rate=0.2)
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 2, 4])
    out = model(pixel_values=x, labels=y)
    assert out.logits.shape == (3, 5)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, y))
    assert abs(out.loss.item() - math.log(5)) < 0.5
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, model(x).logits)  # drop path only while training


def test_pipeline_split_passes_one_tensor_between_stages():
    from dufu.parallel.pipeline import build_stage_module

    model = make().eval()
    x = torch.randn(2, 3, 16, 16)
    first, last = (build_stage_module(model, s, 2, [0, 0, 1, 1]) for s in (0, 1))
    hidden = first(x)
    assert hidden.shape == (2, 16, 32)  # after patch merging: 4 x 4 tokens of width 32
    torch.testing.assert_close(last(hidden), model(x).logits)


def test_swin_tiny_parameter_count_on_meta():
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(resolve_config_path("swin_tiny"))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    expected = count_swin_parameters(224, 4, 3, 1000, 96, [2, 2, 6, 2], [3, 6, 12, 24], 7)
    assert sum(p.numel() for p in model.parameters()) == expected == 28_288_354


CONFIGS = {
    "two-stages": dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4),
    "padded-windows": dict(image_size=40, patch_size=4, embed_dim=16, depths=[2, 3], num_heads=[2, 2], window_size=4,
                           hidden_act="gelu_new"),
    "absolute-positions": dict(image_size=56, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                               window_size=7, use_absolute_embeddings=True, num_channels=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_parity_both_ways(name, tmp_path):
    import transformers

    cfg = transformers.SwinConfig(num_labels=5, **CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.SwinForImageClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf").eval()
    assert isinstance(model, SwinForImageClassification)
    x, y = torch.randn(3, cfg.num_channels, cfg.image_size, cfg.image_size), torch.tensor([0, 2, 4])
    with torch.no_grad():
        expected, got = hf(pixel_values=x, labels=y), model(pixel_values=x, labels=y)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-4, atol=1e-4)

    hub.save_pretrained(model, tmp_path / "dufu")
    again = transformers.SwinForImageClassification.from_pretrained(tmp_path / "dufu").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(pixel_values=x).logits, got.logits, rtol=1e-4, atol=1e-4)


def test_transformers_in_memory_names_load_too():
    import transformers

    from dufu.models.swin.hf import MAPPING

    cfg = transformers.SwinConfig(num_labels=5, **CONFIGS["two-stages"])
    hf = transformers.SwinForImageClassification(cfg).eval()
    model = hub.build_from_hf_config(cfg.to_dict())
    sd = {k: read() for k, read in MAPPING.tensor_sources(hf.state_dict(), model).items()}  # lazy readers
    assert set(sd) == set(model.state_dict())


def test_swin_debug_trains(tmp_path):
    from dufu_testing import train

    run = train(tmp_path / "swin", ["train.train_iter=6"], recipe="swin_debug")
    losses = run.losses
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses.values())
    assert abs(losses[1] - math.log(10)) < 0.5
