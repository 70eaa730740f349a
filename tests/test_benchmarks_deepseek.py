"""``benchmarks/deepseek.py --quick``: the balancing runs, the KV caches and the attention timings of a tiny
DeepSeek-style model, in this process, with every row of the result filled in."""

from __future__ import annotations

import pytest

from dufu_testing import benchmark_result, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("deepseek")


def test_quick_run_fills_every_row(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path / "cache"))
    assert bench.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    md, data = benchmark_result(tmp_path, "deepseek-*.md")
    assert data["machine"]["cpu"] and len(data["load_start"]) == 3
    s = data["shape"]

    bal = data["balancing"]
    assert list(bal) == ["loss-free", "loss-free-paper", "aux-loss", "neither"]
    for name, r in bal.items():
        assert r["steps"] == [1, 2] and len(r["max_load_step"]) == 2
        assert all(1.0 <= x <= s["experts"] / s["top_k"] for x in r["max_load_step"])  # busiest / mean expert
        assert r["final_eval_loss"] > 0 and r["evals"][-1]["step"] == 2
    # one start, one data stream: the same first step everywhere (the bias moves after it)
    assert len({r["losses"][0] for r in bal.values()}) == 1
    # the bias moved by gamma per step, in every MoE layer, and only where there is one
    for name, gamma in (("loss-free", bench.GAMMA), ("loss-free-paper", bench.PAPER_GAMMA)):
        ranges = bal[name]["bias_range"]
        assert len(ranges) == s["layers"] - s["first_k_dense"]
        assert all(0 < r <= 2 * 2 * gamma + 1e-6 for r in ranges.values())
    assert bal["aux-loss"]["bias_range"] == bal["neither"]["bias_range"] == {}
    assert bal["aux-loss"]["aux_loss"][0] > 0 and bal["neither"]["aux_loss"][0] == 0

    att = data["attention"]
    (mla, gqa) = att["kv_cache"].values()
    head_dim = s["hidden"] // s["heads"]
    assert mla["bytes_per_token_per_layer"] == (s["kv_lora_rank"] + s["rope"]) * 4  # latent + rotary key, fp32
    assert gqa["bytes_per_token_per_layer"] == 2 * s["kv_heads"] * head_dim * 4
    for r in (mla, gqa):
        assert len(r["layers"]) == s["layers"] and r["generated"] == bench.GEN_NEW
        assert all(la["tokens"] == bench.GEN_PROMPT + bench.GEN_NEW - 1 for la in r["layers"])
    assert att["published_bf16"]["mla"] == (512 + 64) * 2
    layers = att["layer"]["layers"]
    assert list(layers) == ["MLA", "GQA (4/2)", "MHA (4)"]
    assert all(0 < r["min_ms"] <= r["median_ms"] for r in layers.values())
    models = att["model"]
    assert models["same_samples"]
    for r in models["models"].values():
        assert len(r["step_times_s"]) == 2 and r["median_step_s"] > 0 and r["attention_parameters"] > 0

    text = md.read_text()
    for row in ("| loss-free |", "| loss-free-paper |", "| aux-loss |", "| neither |", "| MLA |", "| GQA (4/2) |",
                "| MLA (deepseek_v3_debug) |", "| GQA 4/2 (moe_debug) |"):
        assert row in text
    assert "nan" not in text and "| - |" not in text
    assert md.with_suffix(".png").stat().st_size > 0
