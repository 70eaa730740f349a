"""``benchmarks/packing.py --quick``: both variants run on the llama_sft recipe, the attention kernels are timed,
and the result files have every row filled in."""

from __future__ import annotations

import pytest

from dufu_testing import benchmark_result, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("packing")


def test_quick_run_writes_the_table(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path / "cache"))
    assert bench.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    md, data = benchmark_result(tmp_path, "packing-*.md")
    assert data["recipe"] == "llama_sft" and data["machine"]["cpu"]
    (res,) = data["results"].values()
    padded, packed = res["padded"], res["packed"]
    assert packed["samples_per_epoch"] == padded["samples_per_epoch"] == padded["rows_per_epoch"]
    assert packed["rows_per_epoch"] <= padded["rows_per_epoch"]
    assert packed["epoch_padding_share"] <= padded["epoch_padding_share"]
    for r in (padded, packed):
        assert len(r["step_times_s"]) == data["steps"] and r["useful_tokens_per_s"] > 0
        assert 0 <= r["timed_padding_share"] < 1 and r["useful_tokens"] <= r["positions"]
    assert res["speedup"] > 0
    (kernels,) = data["attention"].values()  # one small shape, without FlexAttention in a quick run
    for variant in ("sdpa_causal", "sdpa_bool_mask", "sdpa_additive_mask"):
        assert 0 < kernels[variant]["min_ms"] <= kernels[variant]["median_ms"]
    text = md.read_text()
    assert "| 256 | padded |" in text and "| 256 | packed |" in text and "Headline" in text
    assert "## Attention kernels on a packed row" in text and "| (2, 4, 128, 16) |" in text
