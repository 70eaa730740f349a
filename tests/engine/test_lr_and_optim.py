"""WarmupCosineLR / WarmupConstantLR and the default optimizer parameter groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dufu.engine.lr_scheduler import WarmupConstantLR, WarmupCosineLR
from dufu.engine.optim import get_default_optimizer_params
from dufu.models.gpt import GPTModel

BASE_LR = 0.5


def lrs(scheduler_cls, steps: int, **kw) -> list[float]:
    """The learning rate in effect before each of ``steps`` optimizer steps, and after the last."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    sched = scheduler_cls(opt, **kw)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_cosine_warmup_is_linear():
    lr = lrs(WarmupCosineLR, 4, max_iter=20, warmup_iter=4, warmup_factor=0.0, min_lr_ratio=0.1)
    assert lr == pytest.approx([0.0, 0.125, 0.25, 0.375, 0.5])
    lr = lrs(WarmupCosineLR, 4, max_iter=20, warmup_iter=4, warmup_factor=0.2, min_lr_ratio=0.1)
    # from warmup_factor * lr up to lr, in equal steps
    assert lr == pytest.approx([BASE_LR * (0.2 + 0.8 * i / 4) for i in range(5)])


def test_cosine_decays_to_min_lr_ratio_and_stays():
    max_iter, warmup, ratio = 20, 4, 0.1
    lr = lrs(WarmupCosineLR, 30, max_iter=max_iter, warmup_iter=warmup, warmup_factor=0.0, min_lr_ratio=ratio)
    assert lr[warmup] == pytest.approx(BASE_LR)
    mid = warmup + (max_iter - warmup) // 2
    assert lr[mid] == pytest.approx(BASE_LR * (ratio + (1 - ratio) * 0.5))  # cos(pi/2) = 0: halfway
    for it in range(warmup, max_iter + 1):
        progress = (it - warmup) / (max_iter - warmup)
        assert lr[it] == pytest.approx(BASE_LR * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))))
    assert lr[max_iter] == pytest.approx(BASE_LR * ratio)
    assert lr[max_iter:] == pytest.approx([BASE_LR * ratio] * (len(lr) - max_iter))
    decay = lr[warmup : max_iter + 1]
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # monotone after warmup


def test_cosine_without_warmup_and_invalid_warmup():
    lr = lrs(WarmupCosineLR, 10, max_iter=10, warmup_iter=0, min_lr_ratio=0.0)
    assert lr[0] == pytest.approx(BASE_LR) and lr[10] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="warmup_iter 11"):
        lrs(WarmupCosineLR, 1, max_iter=10, warmup_iter=11)


def test_warmup_constant():
    lr = lrs(WarmupConstantLR, 6, max_iter=6, warmup_iter=2, warmup_factor=0.0)
    assert lr == pytest.approx([0.0, 0.25, 0.5, 0.5, 0.5, 0.5, 0.5])


# ------------------------------------------------------------------ parameter groups


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPTModel(vocab_size=384, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)


def test_no_weight_decay_on_norms_and_biases(model):
    groups = get_default_optimizer_params(model, weight_decay_norm=0.0, weight_decay_bias=0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, not_decayed = set(), set()
    for g in groups:
        target = not_decayed if g.get("weight_decay", "default") == 0.0 else decayed
        target.update(names[id(p)] for p in g["params"])
    for n, p in model.named_parameters():
        is_norm = ".ln" in n or n.startswith("ln_f")
        if is_norm or n.endswith(".bias"):
            assert n in not_decayed, n
        else:
            assert p.ndim == 2 and n in decayed, n
    assert "wte.weight" in decayed and "blocks.0.attn.q_proj.weight" in decayed
    # Decayed groups keep the optimizer's own weight_decay (no key) when weight_decay=None.
    assert all("weight_decay" not in g for g in groups if names[id(g["params"][0])] in decayed)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    for g in opt.param_groups:
        expected = 0.0 if names[id(g["params"][0])] in not_decayed else 0.1
        assert g["weight_decay"] == expected


def test_tied_parameter_appears_once(model):
    assert model.lm_head.weight is model.wte.weight
    groups = get_default_optimizer_params(model)
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params})
    unique = {id(p) for p in model.parameters()}
    assert {id(p) for p in params} == unique
    assert sum(id(p) == id(model.wte.weight) for p in params) == 1
    torch.optim.AdamW(groups, lr=1e-3)  # torch refuses duplicates, so this must not raise


def test_explicit_weight_decay_and_frozen_parameters():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    m[2].weight.requires_grad_(False)
    groups = get_default_optimizer_params(m, weight_decay=0.3, weight_decay_norm=0.01, weight_decay_bias=0.02)
    by_wd = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    assert by_wd[0.3] == {id(m[0].weight)}  # the frozen weight is left out
    assert by_wd[0.01] == {id(m[1].weight), id(m[1].bias)}
    assert by_wd[0.02] == {id(m[0].bias), id(m[2].bias)}
