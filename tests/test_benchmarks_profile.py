"""The step-time categoriser of ``benchmarks/train_step.py --profile``: every profiled op lands in one category,
the categories add up to the profiled step, and the rules tell attention's softmax from the loss's."""

from __future__ import annotations

import types

import pytest
import torch
from dufu_testing import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("train_step")


TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, max_position_embeddings=32)


@pytest.mark.parametrize("chain, expected", [
    (["aten::mm", "aten::matmul", "aten::linear"], "matmul"),
    (["aten::t", "aten::linear"], "matmul"),
    (["aten::sum", "AddmmBackward0", "autograd::engine::evaluate_function: AddmmBackward0"], "matmul"),
    (["aten::_softmax", "aten::softmax"], "attention"),  # eager attention's softmax
    (["aten::_softmax_backward_data", "SoftmaxBackward0"], "attention"),
    (["aten::_log_softmax_backward_data", "LogSoftmaxBackward0"], "loss"),  # not attention's SoftmaxBackward0
    (["aten::_log_softmax", "aten::log_softmax", "aten::cross_entropy_loss"], "loss"),
    (["aten::bmm", "aten::matmul"], "attention"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention"], "attention"),
    (["aten::mm", "_FusedLinearCrossEntropy"], "matmul"),  # a fused loss's own matmuls stay matmul
    (["aten::exp", "_FusedLinearCrossEntropy"], "loss"),
    (["aten::copy_", "aten::_to_copy", "aten::to", "aten::linear"], "casts"),
    (["aten::native_layer_norm", "aten::layer_norm"], "norms/elementwise"),
    (["aten::mul", "MulBackward0"], "norms/elementwise"),
    (["aten::_fused_adamw_", "Optimizer.step#AdamW.step"], "optimizer"),
    (["aten::_foreach_norm"], "optimizer"),  # gradient clipping outside the optimizer's region
    (["gloo:all_reduce", "c10d::allreduce_"], "communication"),
    (["aten::embedding_dense_backward", "EmbeddingBackward0"], "other"),
])
def test_categorize_rules(bench, chain, expected):
    assert bench.categorize(chain) == expected


class _TinyLoop:
    """The benchmark's plain loop on a tiny GPT, fed random tokens (no dataset needed)."""

    def __init__(self, bench, amp_dtype):
        torch.manual_seed(0)
        self.loop = bench.LoopRunner("plain", bench.PlainGPT(**TINY), bench.plain_forward_loss, amp_dtype,
                                     torch.device("cpu"), dataset=None, sampler=None)
        self.batch = torch.randint(0, TINY["vocab_size"], (2, 17))
        self.loop.sampler = types.SimpleNamespace(next_step=lambda: [[0, 1]])

    def step(self):
        return self.loop.step()


def test_breakdown_adds_up_to_the_step(bench, monkeypatch):
    runner = _TinyLoop(bench, torch.bfloat16)
    monkeypatch.setattr(bench, "collate", lambda dataset, indices: runner.batch)
    runner.step()  # warm-up
    b = bench.profile_steps(runner, 2, torch.device("cpu"))
    ms = b["ms"]
    assert set(ms) == set(bench.PROFILE_CATEGORIES)
    for cat in ("matmul", "attention", "loss", "norms/elementwise", "optimizer", "casts"):
        assert ms[cat] > 0, f"{cat} is empty: {ms}"
    assert ms["communication"] == 0  # one process
    assert sum(ms.values()) == pytest.approx(b["total_ms"])
    # On a CPU every op runs on the step's thread: the self times tile the step regions exactly.
    assert b["total_ms"] == pytest.approx(b["step_wall_ms"], rel=1e-3)
    table = bench.profile_table(["plain"], {"plain": b})
    assert "| attention |" in table and "**total (sum)**" in table


def test_breakdown_needs_the_step_regions(bench, monkeypatch):
    runner = _TinyLoop(bench, None)
    monkeypatch.setattr(bench, "collate", lambda dataset, indices: runner.batch)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step()  # not inside record_function(STEP_REGION)
    with pytest.raises(ValueError, match="benchmark.step"):
        bench.step_breakdown(prof.events(), 1)
