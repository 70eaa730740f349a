"""``benchmarks/moe.py --quick``: the three parts run end to end on a tiny model (one process; then 2 processes at
dp 2 with expert-parallel sizes 1 and 2; then the experts' grouped GEMM against their loop in one process) and
write the result files with every row filled in."""

from __future__ import annotations

import re
import sys

import pytest

import launch
from launch import REPO
from dufu_testing import benchmark_result


@pytest.mark.multiprocess
def test_quick_run_writes_both_tables(tmp_path):
    results = tmp_path / "results"
    proc = launch.run([sys.executable, REPO / "benchmarks" / "moe.py", "--quick", "--results-dir", results],
                      cwd=REPO, timeout=300)
    launch.assert_ok(proc)
    md, data = benchmark_result(results, "moe-*.md")
    text = md.read_text()
    assert md.with_suffix(".png").stat().st_size > 0

    # part 1: MoE vs dense, the same samples, active parameters equal up to the routers (layers x E x H)
    part1, shape = data["dense"], data["shape"]
    assert part1["same_samples"] is True
    moe, dense = part1["rows"]["moe"], part1["rows"]["dense"]
    for row in (moe, dense):
        assert len(row["step_times_s"]) == part1["steps"]
        for key in ("median_step_s", "tokens_per_s", "mfu", "flops_per_token", "parameters"):
            assert row[key] > 0, (key, row[key])
        assert row["profile"]["wall_ms"] > 0 and row["profile"]["ms"]["matmul"] > 0
    routers = shape["num_layers"] * shape["num_experts"] * shape["hidden_size"]
    assert moe["active_parameters"] - dense["active_parameters"] == routers
    assert dense["active_parameters"] == dense["parameters"] < moe["parameters"]
    assert moe["profile"]["matmul_calls"] > dense["profile"]["matmul_calls"]  # per expert (on the CPU, also grouped)
    assert part1["step_time_ratio_moe_over_dense"] > 0
    assert re.search(r"^\| MoE \| [\d,]+ \| [\d,]+ \|", text, re.M)
    assert re.search(r"^\| dense \| [\d,]+ \| [\d,]+ \|", text, re.M)
    assert "MoE / dense step time:" in text

    # part 2: one row per expert-parallel size; only EP > 1 exchanges tokens, in forward and in backward
    rows = {r["ep"]: r for r in data["ep"]["rows"]}
    assert set(rows) == {1, 2}
    for r in rows.values():
        assert r["median_step_s"] > 0 and r["median_rank_step_s"] > 0 and r["median_rank_step_cpu_s"] > 0
        assert r["all_reduce_s"] > 0  # the data-parallel gradient average, in both layouts
    assert rows[1]["a2a_share"] == 0 and rows[1]["a2a_forward_s"] == 0
    assert 0 < rows[2]["a2a_share"] < 1 and 0 < rows[2]["a2a_cpu_share"] < 1
    assert rows[2]["a2a_forward_s"] > 0 and rows[2]["a2a_backward_s"] > 0 and rows[2]["a2a_counts_s"] > 0
    assert rows[2]["dispatch_s"] > 0 and rows[2]["combine_s"] > 0
    assert data["ep"]["max_loss_difference"] < 1e-3  # the same model trained in both layouts
    for ep in (1, 2):
        assert re.search(rf"^\| {ep} \| [\d,]+ \(", text, re.M), f"no row for EP {ep}"
    assert "## Observations" in text

    # part 3: the grouped GEMM and the loop, fp32 and bf16, one layer and the training step
    part3 = data["grouped"]
    assert set(part3["layer"]) == set(part3["step"]) == {"fp32", "bf16"}
    for dtype, r in part3["layer"].items():
        assert r["median_ms"]["loop"] > 0 and r["median_ms"]["grouped"] > 0
        assert r["host_reads"]["loop"] == 1  # counts.tolist()
        if part3["available"][dtype]["eager"]:
            assert r["host_reads"]["grouped"] == 0
            assert r["max_relative_grad_difference"] < (1e-5 if dtype == "fp32" else 5e-2)
    for r in part3["step"].values():
        assert len(r["step_times_s"]["loop"]) == len(r["step_times_s"]["grouped"]) == r["steps"] > 0
    assert "## Grouped GEMM vs the per-expert loop" in text
    assert re.search(r"^\| one MoE layer, forward \+ backward \| bf16 \| [\d.]+ \([\d.]+\) \| [\d.]+ \(", text, re.M)
