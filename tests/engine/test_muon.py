"""Muon (dufu.optim.muon): the orthogonalisation, Moonlight's update scaling, the Muon/AdamW split, decoupled
weight decay, the state's round trip, and gpt_debug_muon in every parallel layout equal to one process.

* one process: Newton-Schulz leaves every singular value in the quintic's band, the same update as
  torch.optim.Muon (match_rms_adamw, bf16), an update RMS of 0.2 x lr x the band, groups as documented, decay
  decoupled from the gradient, state_dict round trip and the device-side skip of a non-finite step;
* 2 processes, one launch (tests/parity.py's SharedRuns): dp2 (replicate), ZeRO-2, ZeRO-3, tp2, tp2 with SP and
  pp2 each log one process's losses and gradient norms at every step and end with its weights (Muon's bound is
  derived in :func:`assert_muon_weights_match`); a run stopped at step 3 under ZeRO-3 and resumed under tp2 (its
  checkpoint resharded, momentum buffers included) ends where one process does; every gradient x2 fails the
  comparison (Muon and clipping divide the factor away: the logged gradient norm shows it).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from dufu.config import instantiate
from dufu.optim import Muon, muon_param_groups, zeropower_via_newtonschulz
from dufu.optim.muon import MATCH_ADAMW_RMS, NS_COEFFICIENTS, ns_dtype_for
from dufu_testing import load_config
from parity import (PRECISIONS, Spec, _compared, _where, assert_matches_reference, assert_weights_match,
                    scale_gradients)

CONFIG = "gpt_debug_muon"


def ns_band(coefficients=NS_COEFFICIENTS, steps: int = 5, smallest: float = 2e-3) -> tuple[float, float]:
    """(lowest, highest) value of the Newton-Schulz quintic iterated ``steps`` times on a singular value in
    [smallest, 1] (the input is divided by its Frobenius norm, so every singular value is at most 1): the band
    the output's singular values lie in, in exact arithmetic. Keller Jordan's coefficients: ~(0.68, 1.2024)."""
    a, b, c = coefficients
    x = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    y = x.clone()
    for _ in range(steps):
        y = a * y + b * y ** 3 + c * y ** 5
    return y[x >= smallest].min().item(), y.max().item()


# ------------------------------------------------------------------------------------------ one process


def quintic(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5) -> torch.Tensor:
    a, b, c = coefficients
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return x


@pytest.mark.parametrize("shape", [(64, 64), (256, 64), (64, 256)])
def test_newton_schulz_is_near_orthogonal(shape):
    """NS5(g) = U q(S) V^T for g / ||g||_F = U S V^T, q the quintic iterated 5 times: same singular vectors, and
    every singular value that is not tiny (>= 2e-3 of the Frobenius norm) lands in the band ~[0.68, 1.2024]."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = zeropower_via_newtonschulz(g)  # fp32
    sv_in = torch.linalg.svdvals((g / g.norm()).double())
    sv = torch.linalg.svdvals(o.double())
    expected = quintic(sv_in).sort(descending=True).values
    assert torch.allclose(sv, expected, atol=1e-4), (sv - expected).abs().max()
    low, high = ns_band(smallest=2e-3)
    assert 0.68 < low < 0.69 and 1.20 < high < 1.21, (low, high)  # the published ~[0.7, 1.2]
    big = quintic(sv_in[sv_in >= 2e-3])
    assert len(big) >= min(shape) - 2 and big.min() >= low - 1e-9 and big.max() <= high + 1e-9
    assert sv.max() <= high + 1e-4 and sv.max() > 1.0, "the quintic oscillates inside its band (no convergence to 1)"
    # the singular vectors are g's: O^T g = V q(S) S V^T is symmetric
    sym = o.mT @ g
    assert torch.allclose(sym, sym.mT, atol=1e-4 * sym.abs().max())


def _one_step(shape, lr=1.0, wd=0.0, grad=None, weight=None, **kw):
    w = nn.Parameter(torch.zeros(*shape) if weight is None else weight.clone())
    w.grad = grad.clone() if grad is not None else torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    kw.setdefault("ns_dtype", "float32")
    Muon([{"params": [w], "use_muon": True}], lr=lr, weight_decay=wd, **kw).step()
    return w.detach()


@pytest.mark.parametrize("shape", [(64, 64), (256, 64), (64, 256)])
def test_update_rms_matches_adamw(shape):
    """Moonlight's scaling: the update is lr x 0.2 sqrt(max(A, B)) x O, whose RMS is 0.2 lr x the RMS of O's
    singular values (0.2 lr for an exactly orthogonal O, i.e. AdamW's typical update RMS)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    update = -_one_step(shape, grad=g, momentum=0.0, nesterov=False)  # lr 1, from W = 0
    o = zeropower_via_newtonschulz(g)
    rms = update.pow(2).mean().sqrt().item()
    expected = MATCH_ADAMW_RMS * math.sqrt(max(shape)) * o.norm().item() / math.sqrt(shape[0] * shape[1])
    assert rms == pytest.approx(expected, rel=1e-6)
    low, high = ns_band()
    assert MATCH_ADAMW_RMS * low <= rms <= MATCH_ADAMW_RMS * high, rms
    assert torch.allclose(update, MATCH_ADAMW_RMS * math.sqrt(max(shape)) * o, rtol=1e-6, atol=1e-7)


def test_same_update_as_torch_muon():
    """With bf16 Newton-Schulz (torch's only mode), 3 Nesterov steps with weight decay equal torch.optim.Muon's
    with Moonlight's scaling (adjust_lr_fn="match_rms_adamw")."""
    gen = torch.Generator().manual_seed(2)
    w = nn.Parameter(torch.randn(64, 256, generator=gen))
    w_torch = nn.Parameter(w.detach().clone())
    ours = Muon([{"params": [w], "use_muon": True}], lr=0.05, weight_decay=0.1, ns_dtype="bfloat16")
    theirs = torch.optim.Muon([w_torch], lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(64, 256, generator=gen)
        w.grad, w_torch.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.allclose(w, w_torch, rtol=0, atol=1e-6), (w - w_torch).abs().max()


def test_newton_schulz_dtype_follows_the_device():
    """"auto": bf16 where the CPU multiplies bf16 in hardware (AMX-BF16 / AVX512-BF16, torch's capabilities), else
    fp32; an explicit dtype is obeyed; bf16 iterations stay in the band (up to bf16 roundoff)."""
    cpu = torch.device("cpu")
    caps = torch.cpu.get_capabilities()
    fast = bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))
    assert ns_dtype_for("auto", cpu) == (torch.bfloat16 if fast else torch.float32)
    assert ns_dtype_for("float32", cpu) == torch.float32 and ns_dtype_for("bfloat16", cpu) == torch.bfloat16
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    o = zeropower_via_newtonschulz(g, dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16
    sv = torch.linalg.svdvals(o.double())
    assert sv.min() > 0.6 and sv.max() < 1.3, (sv.min(), sv.max())


def test_weight_decay_is_decoupled():
    """W <- W (1 - lr wd) - lr 0.2 sqrt(max) O(g): the decay does not enter the gradient or the momentum, so the
    orthogonalised part is the same whatever the weights, and a zero gradient leaves pure decay."""
    shape, lr, wd = (64, 256), 0.1, 0.5
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    w1, w2 = torch.randn(*shape), 10 * torch.randn(*shape)
    step1 = _one_step(shape, lr, wd, grad=g, weight=w1) - w1 * (1 - lr * wd)
    step2 = _one_step(shape, lr, wd, grad=g, weight=w2) - w2 * (1 - lr * wd)
    assert torch.allclose(step1, step2, atol=1e-5)
    rms = step1.pow(2).mean().sqrt().item()
    assert 0.68 * MATCH_ADAMW_RMS * lr <= rms <= 1.21 * MATCH_ADAMW_RMS * lr, rms  # the update is there
    assert torch.equal(_one_step(shape, lr, wd, grad=torch.zeros(*shape), weight=w1), w1 * (1 - lr * wd))


def _debug_model() -> nn.Module:
    torch.manual_seed(0)
    return instantiate(load_config(CONFIG).model)


def _names(model, params) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in params)


def test_parameters_split_into_muon_and_adamw_groups():
    model = _debug_model()
    groups = muon_param_groups(model, weight_decay_norm=0.0, weight_decay_bias=0.0)
    muon = [g for g in groups if g["use_muon"]]
    assert len(muon) == 1 and "weight_decay" not in muon[0]  # the optimizer's own decay
    matrices = {f"blocks.{i}.{m}.weight" for i in range(2)
                for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")}
    assert set(_names(model, muon[0]["params"])) == matrices
    adamw = {n: g.get("weight_decay") for g in groups if not g["use_muon"] for n in _names(model, g["params"])}
    # embeddings (the head is tied to wte: once) with the optimizer's decay; norms and biases without
    assert {n for n, wd in adamw.items() if wd is None} == {"wte.weight", "wpe.weight"}
    assert {n for n, wd in adamw.items() if wd == 0.0} == {n for n, _ in model.named_parameters()
                                                           if n.endswith("bias") or ".ln" in n or n.startswith("ln")}
    assert len(adamw) + len(matrices) == len(list(model.parameters()))

    class Stage(nn.Module):  # a last pipeline stage's own (untied) head, an MoE-like 3-D tensor, a frozen matrix
        def __init__(self):
            super().__init__()
            self.proj, self.lm_head, self.frozen = nn.Linear(8, 8), nn.Linear(8, 32, bias=False), nn.Linear(8, 8)
            self.experts = nn.Parameter(torch.zeros(2, 8, 8))
            self.frozen.requires_grad_(False)

    stage = Stage()
    split = {g["use_muon"]: _names(stage, g["params"]) for g in muon_param_groups(stage) if g["use_muon"]}
    assert split == {True: ["proj.weight"]}
    assert muon_param_groups(nn.Module()) == [{"params": [], "use_muon": False}]  # nothing to train
    opt = Muon(muon_param_groups(stage), lr=1e-3)
    assert sum(len(g["params"]) for g in opt.param_groups) == 4  # frozen left out


def test_refuses_groups_it_cannot_split():
    w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="muon_param_groups"):
        Muon([w])
    with pytest.raises(ValueError, match=r"shape \(4,\).*2-D"):
        Muon([{"params": [nn.Parameter(torch.zeros(4))], "use_muon": True}])
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([{"params": [w], "use_muon": True}], ns_dtype="fp8")


def _train(model, opt, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 257, (2, 32), generator=gen)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_state_dict_round_trips_and_resumes_exactly():
    """An optimizer rebuilt from state_dict() (Muon's momentum buffers, AdamW's moments and step, the groups'
    rates) continues exactly as the original; the AdamW groups stay linked to the outer optimizer's."""
    model = _debug_model()
    opt = Muon(muon_param_groups(model), lr=3e-3, fused=True)
    _train(model, opt, 3, seed=0)
    saved, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    kinds = {k for s in saved["state"].values() for k in s}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}, kinds
    expected = _train(model, opt, 2, seed=1)

    resumed = _debug_model()
    resumed.load_state_dict(saved_model)
    opt2 = Muon(muon_param_groups(resumed), lr=1.0, fused=True)  # the state's rates win
    opt2.load_state_dict(saved)
    assert all(g["lr"] == 3e-3 for g in opt2.param_groups)
    assert opt2._adamw.state is opt2.state and all(a is b for a, b in zip(
        opt2._adamw.param_groups, [g for g in opt2.param_groups if not g["use_muon"]]))
    assert _train(resumed, opt2, 2, seed=1) == expected
    for (n, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n


def test_non_finite_step_is_skipped_on_the_device():
    """The trainer's found_inf (fused optimizers): a step with a NaN gradient changes no weight and no state."""
    model = _debug_model()
    opt = Muon(muon_param_groups(model), lr=1e-2, fused=True)
    assert opt._step_supports_amp_scaling
    _train(model, opt, 1, seed=0)
    before = copy.deepcopy((model.state_dict(), opt.state_dict()["state"]))
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    for (n, a), b in zip(model.state_dict().items(), before[0].values()):
        assert torch.equal(a, b), n
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, before[1][i][k]), (i, k)


# ------------------------------------------------------------------------------------------ layouts

DP2, TP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2"
PP2 = "train.dist.pipeline_parallel_size=2"
ZERO = "train.zero_optimization.enabled=True"
LAYOUTS = {
    "dp2": [DP2],
    "dp2-zero2": [DP2, ZERO, "train.zero_optimization.stage=2"],
    "dp2-zero3": [DP2, ZERO, "train.zero_optimization.stage=3"],
    "tp2": [TP2],
    "tp2-sp": [TP2, "train.dist.sequence_parallel=True"],
    "pp2": [PP2],
}
RUNS = {
    **{layout: Spec(2, tuple(overrides), config=CONFIG) for layout, overrides in LAYOUTS.items()},
    "stopped": Spec(2, (*LAYOUTS["dp2-zero3"], "train.stop_at_iter=3", "train.checkpointer.period=3"), config=CONFIG),
    "resumed": Spec(2, (TP2, "train.checkpointer.period=3"), config=CONFIG, resume_of="stopped"),
    "bug-x2": Spec(2, (*LAYOUTS["dp2-zero3"], scale_gradients(2.0)), config=CONFIG),
}


@pytest.fixture(scope="module")
def muon_runs(shared_runs):
    return shared_runs(RUNS, uses={"test_resumed_in_another_layout_matches_single_process": "resumed",
                                   "test_parity_check_fails_on_a_gradient_scale_bug": "bug-x2"})


def muon_update_band() -> float:
    """The largest |entry| of an orthogonalised update O: |O_ij| <= sigma_max(O) <= the band's top."""
    return ns_band(smallest=0.0)[1]


def assert_muon_weights_match(state: dict, ref_state: dict, what: str, lrs, weight_decay: float, muon_names,
                              precision: str = "fp32") -> None:
    """Final weights of Muon's matrices equal the reference's within what Muon lets reduction order change.

    Derivation. Muon moves a matrix W (A, B) at step t by -lr_t wd W - s_t O_t, s_t = lr_t 0.2 sqrt(max(A, B)),
    O_t = NS5(U_t) the orthogonalised (Nesterov) momentum: every singular value of O_t is the quintic iterate of
    one of U_t / ||U_t||_F's, at most h = 1.2024 (:func:`ns_band`), so |O_t,ij| <= h whatever the gradients.
    1. every entry: |w - w_ref| <= 2 sum_t (s_t h + lr_t wd max|w_ref|): no two Muon runs from the same weights
       can be further apart (each update reversed). The update's size is fixed, like AdamW's (rule 1 there).
    2. all but ``Precision.outliers`` of the entries (at least 1): |w - w_ref| <= 1e-4 |w_ref| + eta sum_t s_t,
       eta = ``Precision.update_rel`` (1e-3 in fp32). The layouts gather the same update matrix up to reduction
       order, ~1e-6 relative in fp32 (docs/architecture.md); the normalised iteration is Lipschitz with at most
       its slope at zero, a^5 = 3.4445^5 ~ 488 (the largest slope on [0, 1], by the coefficients' design), so
       O_t moves by <= ~5e-4 per step, inside eta with a 2x margin. Unlike Adam there is no eps that amplifies a
       roundoff-level gradient (the whole matrix is normalised at once), so no parameter is exempt. A wrong
       shard, row or step moves an entry by ~s_t, 1000x this. Measured (dp2 ZeRO-3 and tp2 against one
       process, 5 steps): at most ~2e-8, 0.005 of rule 2's bound.
    Every gradient x2 leaves this unchanged (NS normalises the update): the logged gradient norm catches that.
    """
    tol = PRECISIONS[precision]
    lrs = list(lrs)
    h = muon_update_band()
    for name, got, ref, diff in _compared({k: state[k] for k in muon_names}, {k: ref_state[k] for k in muon_names},
                                          what):
        assert ref.ndim == 2, f"{what}: {name} is not a matrix: not Muon's"
        s = [lr * 0.2 * math.sqrt(max(ref.shape)) for lr in lrs]
        hard = 2 * (h * sum(s) + sum(lrs) * weight_decay * ref.abs().max().item())
        worst = diff.max().item()
        assert worst <= hard, (f"{what}: {name}: greatest difference {worst:.3g} at {_where(diff)} exceeds {hard:.3g}, "
                               f"the most two Muon runs can differ after {len(lrs)} steps of rates {lrs}")
        tight = 1e-4 * ref.abs() + tol.update_rel * sum(s)
        beyond = int((diff > tight).sum())
        allowed = max(1, int(tol.outliers * diff.numel()))
        assert beyond <= allowed, (
            f"{what}: {name}: {beyond} of {diff.numel()} entries differ by more than 1e-4 |w| + {tol.update_rel:g} x "
            f"{sum(s):.3g} (the sum of Muon's scaled rates), {allowed} allowed; greatest {worst:.3g} at {_where(diff)}")


def assert_muon_run_matches(got, reference, what: str) -> None:
    """Losses, rates, gradient norms (tests/parity.py), then the weights: Muon's bound on its matrices, AdamW's
    on the rest."""
    assert_matches_reference(got, dataclasses.replace(reference, state=None), what)
    model = _debug_model()
    muon_names = set(_names(model, [p for g in muon_param_groups(model) if g["use_muon"] for p in g["params"]]))
    assert muon_names and muon_names < set(reference.state)
    assert_muon_weights_match(got.state, reference.state, what, reference.lrs, reference.weight_decay, muon_names)
    rest = set(reference.state) - muon_names
    assert_weights_match({k: got.state[k] for k in rest}, {k: reference.state[k] for k in rest}, what, reference.lrs,
                         reference.betas, reference.weight_decay)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference_run, muon_runs):
    reference = reference_run(CONFIG)
    assert reference.optimizer == "Muon"
    assert_muon_run_matches(muon_runs.result(layout), reference, f"muon {layout}")


@pytest.mark.multiprocess
def test_resumed_in_another_layout_matches_single_process(reference_run, muon_runs):
    """Stopped after step 3 under ZeRO-3, resumed under tp2: the checkpoint's Muon momentum buffers and AdamW
    moments are resharded from dim-0 data shards to tensor shards, and the run ends where one process does."""
    got = muon_runs.result("resumed")
    assert sorted(got.train) == [1, 2, 3, 4, 5]
    assert_muon_run_matches(got, reference_run(CONFIG), "muon stopped in dp2-zero3 at step 3, resumed in tp2")


@pytest.mark.multiprocess
def test_parity_check_fails_on_a_gradient_scale_bug(reference_run, muon_runs):
    """Every gradient x2 under ZeRO-3: Muon (and clipping) divide the factor away, so only the logged gradient
    norm shows it; the comparison must fail on it, at the first step."""
    got, reference = muon_runs.result("bug-x2"), reference_run(CONFIG)
    with pytest.raises(AssertionError, match="step 1 grad_norm"):
        assert_muon_run_matches(got, reference, "muon x2")
    ratios = [a / b for a, b in zip(got.grad_norms, reference.grad_norms)]
    assert all(abs(r - 2) < 1e-4 for r in ratios), ratios
