"""fused_linear_cross_entropy: the plain path's loss and gradients without the whole logits tensor.

On one process: fp32 to roundoff, fp64 against finite differences, bf16 autocast to bf16 tolerance; ignore_index, tied
weights, chunk sizes that do not divide the tokens, bad input. GPT and LLaMA give the plain path's loss and
gradients with ``fused_loss`` on. Under tensor (and sequence) parallelism on 2 processes: each rank's loss and
gradient shards equal one process's (tests/layers/fused_loss_tp_worker.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import launch
from dufu.layers.loss import cross_entropy_loss, fused_linear_cross_entropy, next_token_labels
from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel

V, C = 256, 64


def data(B=3, T=20, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, C, generator=g, dtype=dtype).requires_grad_()
    w = (0.2 * torch.randn(V, C, generator=g, dtype=dtype)).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :5] = -100  # ignored positions (padding, prompt tokens)
    y[2, -1] = -100
    return h, w, y


def plain(h, w, y, amp=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = cross_entropy_loss(h @ w.t(), y)  # (B, T, V) logits, as the models' plain path
    return loss, torch.autograd.grad(loss, (h, w))


def fused(h, w, y, amp=False, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = fused_linear_cross_entropy(h, w, y, **kw)
    return loss, torch.autograd.grad(loss, (h, w))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 60, 1000])
def test_fp32_loss_and_gradients_equal_the_plain_path(chunk_size):
    h, w, y = data()
    loss, grads = plain(h, w, y)
    got, got_grads = fused(h, w, y, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(got.item() - loss.item()) <= 1e-6 * loss.item()
    for a, b in zip(got_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fp64_gradients_equal_finite_differences():
    """gradcheck's comparison (central differences in fp64), done by hand: gradcheck also runs backward twice on
    one graph, which this function refuses (see test_a_second_backward_through_one_graph_is_refused)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([[1, 0, -100, 10, 3], [7, 7, 2, -100, 5]])
    loss = fused_linear_cross_entropy(h, w, y, chunk_size=3)
    analytic = torch.autograd.grad(loss, (h, w))
    eps = 1e-6
    with torch.no_grad():
        for x, grad in zip((h, w), analytic):
            numeric = torch.zeros_like(x)
            for i in range(x.numel()):
                x.view(-1)[i] += eps
                up = fused_linear_cross_entropy(h, w, y, chunk_size=3)
                x.view(-1)[i] -= 2 * eps
                down = fused_linear_cross_entropy(h, w, y, chunk_size=3)
                x.view(-1)[i] += eps
                numeric.view(-1)[i] = (up - down) / (2 * eps)
            torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)
    # and the value is the plain cross entropy's, in fp64
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)


def test_a_second_backward_through_one_graph_is_refused():
    """Backward scales the gradients computed in forward in place (no second (V, C) buffer): a retained graph
    cannot be differentiated twice, and autograd says so instead of returning scaled-twice gradients."""
    h, w, y = data()
    loss = fused_linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bf16_autocast_matches_the_plain_bf16_path():
    h, w, y = data(B=4, T=32)
    loss, grads = plain(h, w, y, amp=True)
    got, got_grads = fused(h, w, y, amp=True, chunk_size=50)
    # Same bf16 logits, same fp32 log-sum-exp: the same loss (up to fp32 summation order).
    assert abs(got.item() - loss.item()) <= 1e-6 * loss.item()
    assert got_grads[0].dtype == got_grads[1].dtype == torch.float32
    # Gradients: both round their matmuls to bf16 (8 bits, u = 2**-8 ~ 4e-3), the plain path after scaling by
    # 1/N, this one before: a few roundings of difference, and no further from the exact (fp64) gradients.
    exact = plain(h.double().detach().requires_grad_(), w.double().detach().requires_grad_(), y)[1]
    for a, b, x in zip(got_grads, grads, exact):
        assert rel(a, b) < 2e-2
        assert rel(a, x) <= max(1.5 * rel(b, x), 1e-2)


def test_backward_scales_by_the_upstream_gradient():
    h, w, y = data()
    _, grads = plain(h, w, y)
    loss = fused_linear_cross_entropy(h, w, y, chunk_size=16)
    got = torch.autograd.grad(loss * 2.5, (h, w))
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, 2.5 * b, rtol=1e-5, atol=1e-7)


def test_every_label_ignored_gives_nan_and_zero_gradients_like_cross_entropy():
    h, w, y = data()
    y = torch.full_like(y, -100)
    loss, grads = plain(h, w, y)
    got, got_grads = fused(h, w, y)
    assert torch.isnan(loss) and torch.isnan(got)
    for a, b in zip(got_grads, grads):
        assert torch.equal(a, b) and not a.any()


def test_without_autograd_only_the_loss():
    h, w, y = data()
    with torch.no_grad():
        got = fused_linear_cross_entropy(h, w, y)
    assert got.grad_fn is None
    torch.testing.assert_close(got, plain(h, w, y)[0], rtol=1e-6, atol=0)


def test_a_tied_weight_accumulates_both_gradients():
    """The head shares its weight with the token embedding (GPT): the weight's gradient is the sum of both."""
    h, w, y = data()
    ids = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(5))
    grads = []
    for loss_fn in (lambda x: cross_entropy_loss(x @ w.t(), y), lambda x: fused_linear_cross_entropy(x, w, y)):
        w.grad = None
        loss_fn(F.embedding(ids, w) + h).backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_next_token_labels_give_the_shifted_loss():
    h, w, y = data()
    ref = cross_entropy_loss((h @ w.t())[:, :-1], y[:, 1:])
    got = fused_linear_cross_entropy(h, w, next_token_labels(y))
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()


def test_bad_input_is_a_clear_error():
    h, w, y = data()
    with pytest.raises(ValueError, match=r"label 256 is outside the vocabulary \[0, 256\)"):
        fused_linear_cross_entropy(h, w, torch.where(y == y[1, 1], V, y))
    with pytest.raises(ValueError, match=r"needs labels of shape \(3, 20\), got \(3, 19\)"):
        fused_linear_cross_entropy(h, w, y[:, 1:])
    with pytest.raises(ValueError, match="hidden size 64 != the weight's 32"):
        fused_linear_cross_entropy(h, w[:, :32], y)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        fused_linear_cross_entropy(h, w, y, chunk_size=0)


# ------------------------------------------------------------------------------------------ the model families

FAMILIES = {
    "gpt": lambda fused: GPTModel(vocab_size=V, hidden_size=C, num_layers=2, num_attention_heads=4,
                                  max_position_embeddings=32, fused_loss=fused),  # tied head
    "llama": lambda fused: LlamaModel(vocab_size=V, hidden_size=C, num_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, ffn_hidden_size=96, max_position_embeddings=32,
                                      fused_loss=fused),  # untied head
}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_fused_loss_equals_the_plain_loss(family, amp):
    torch.manual_seed(0)
    reference = FAMILIES[family](False)
    model = FAMILIES[family](True)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, V, (2, 25), generator=torch.Generator().manual_seed(1))
    ids, target = tokens[:, :-1], tokens[:, 1:].clone()
    target[0, :4] = -100
    outs = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = m(ids, shift_labels=target)
        out.loss.backward()
        outs.append(out)
    assert outs[0].logits.shape == (2, 24, V) and outs[1].logits is None  # the point: no (B, T, V) logits
    a, b = outs[1].loss.item(), outs[0].loss.item()
    assert abs(a - b) <= (2e-3 if amp else 1e-6) * b  # bf16: the blocks' activations are computed anew
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        g, ref = p.grad, ref_grads[name].grad
        assert g is not None, name
        if name.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores q . b_k): roundoff only
            assert g.abs().max() < 1e-5 * ref_grads[name.replace("bias", "weight")].grad.abs().max() + 1e-6
        elif amp:
            assert rel(g, ref) < 5e-2, name
        else:
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=name)
    # Hugging Face labels (shifted inside) give the same loss; without labels the logits come as always.
    with torch.no_grad():
        hf_style = model(tokens, labels=tokens).loss
        torch.testing.assert_close(hf_style, reference(tokens, labels=tokens).loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


# ------------------------------------------------------------------------------------------ tensor parallel


@pytest.mark.multiprocess
def test_vocabulary_parallel_equals_one_process(tmp_path):
    """2 ranks, vocabulary sharded (evenly and not), with and without sequence parallelism, fp32 and bf16."""
    worker = launch.REPO / "tests" / "layers" / "fused_loss_tp_worker.py"
    out = tmp_path / "tp"
    proc = launch.run(launch.torchrun_command(worker, 2, out), output_dir=out, timeout=300)
    launch.assert_ok(proc)
    for rank in (0, 1):
        assert (out / f"ok_{rank}").read_text().split() == ["fp32-even", "fp32-uneven", "fp32-sp", "bf16-even",
                                                                 "bf16-sp"], proc.describe()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2-sp", "dp2xtp2"])
def test_training_with_the_fused_loss_matches_the_plain_single_process_run(layout, tmp_path):
    """The trainer's path: gpt_debug (tied head) with ``fused_loss`` under tensor (and sequence) parallelism logs
    the losses and ends with the weights of one process on the plain path, in fp32 (tests/parity.py)."""
    from parity import assert_matches_reference, parity_run

    overrides = {"tp2-sp": (2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
                 "dp2xtp2": (4, ["train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2"])}
    nproc, extra = overrides[layout]
    reference = parity_run(tmp_path / "plain", 1, "model.fused_loss=False")
    got = parity_run(tmp_path / layout, nproc, "model.fused_loss=True", *extra)
    assert_matches_reference(got, reference, f"fused loss {layout}")
