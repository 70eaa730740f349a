"""``benchmarks/context_parallel.py --quick``: a tiny decoder trained at 128 tokens with cp 1 (one process) and cp 2
(two processes), and result files with every reading filled in and finite."""

from __future__ import annotations

import math
import re
import sys

import pytest

import launch
from launch import REPO
from dufu_testing import benchmark_result


@pytest.mark.multiprocess
def test_quick_run_writes_the_table(tmp_path):
    results = tmp_path / "results"
    proc = launch.run([sys.executable, REPO / "benchmarks" / "context_parallel.py", "--quick", "--results-dir",
                       results], cwd=REPO, timeout=600)
    launch.assert_ok(proc)
    md, data = benchmark_result(results, "context-parallel-*.md")
    assert md.with_suffix(".png").stat().st_size > 0
    assert data["machine"]["cpu"] and data["machine"]["torch"]

    points = {(p["seq_length"], p["cp"]): p for p in data["points"]}
    assert set(points) == {(128, 1), (128, 2)}
    for (T, cp), p in points.items():
        assert p["status"] == "ok", p
        assert len(p["peak_activation_bytes_per_rank"]) == cp and p["hwm_reset"]
        for key in ("peak_activation_bytes", "step_s", "tokens_per_s"):
            assert math.isfinite(p[key]) and p[key] > 0, (key, p[key])
        assert all(math.isfinite(x) for x in p["losses"])
        saved = p["saved"]["bytes"]
        assert saved["rest"] > 0 and p["saved"]["total_bytes"] == sum(saved.values())
    # only the split run gathers keys and values; on the CPU neither builds a causal mask (chunked fused kernel)
    one, two = points[128, 1]["saved"]["bytes"], points[128, 2]["saved"]["bytes"]
    assert one["gathered K/V"] == one["masks"] == 0
    assert two["gathered K/V"] > 0 and two["masks"] == 0
    assert two["rest"] < one["rest"]  # a rank's share of the per-token activations

    (ratio,) = data["ratios"]
    assert ratio["cp"] == 2 and ratio["ideal"] == 0.5 and math.isfinite(ratio["peak_ratio"]) and ratio["peak_ratio"] > 0
    text = md.read_text()
    for cp in (1, 2):
        assert re.search(rf"^\| 128 \| {cp} \| [\d.,]+ \|", text, re.M), f"no row for cp {cp}"
    assert "## Observations" in text and "oversubscribed" in text
