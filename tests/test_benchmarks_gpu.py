"""``benchmarks/gpu.py --smoke``: the GPU benchmark's code path on the CPU (tiny GPT-2 and LLaMA, 3 steps, in the
test process, with the session's dufu cache) writes its results file with a dufu, a plain PyTorch and a `dufu plan` row per model, every one with a
positive throughput, and both loops start from a proper initialisation on the same tokens."""

from __future__ import annotations

import math
import re
import statistics

import pytest

from dufu_testing import benchmark_result, load_benchmark

# gpt_debug's and llama_debug's sizes (2 layers, hidden 64, vocabulary 384, sequence 32), counted by hand:
# GPT: embeddings 384 x 64 + 32 x 64, per layer 2 norms (2 x 128) + q, k, v, out (4 x (64 x 64 + 64))
#      + fc1 (64 x 256 + 256) + fc2 (256 x 64 + 64), final norm 128, head tied
# LLaMA: embedding and untied head 2 x 384 x 64, per layer q, out 2 x 64 x 64 + k, v 2 x 64 x 32 (2 of 4 heads)
#      + SwiGLU 3 x 64 x 176 + 2 norms x 64, final norm 64
PARAMETERS = {
    "gpt2_small": 384 * 64 + 32 * 64 + 2 * (2 * 128 + 4 * (64 * 64 + 64) + 64 * 256 + 256 + 256 * 64 + 64) + 128,
    "llama_1b": 2 * 384 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64) + 64,
}


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu")


def test_smoke_run_writes_every_row(bench, tmp_path, monkeypatch, dufu_cache_dir):
    out = tmp_path / "results"
    monkeypatch.setenv("DUFU_CACHE_DIR", str(dufu_cache_dir))  # main() keeps it under --smoke; restored after
    assert bench.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    md, data = benchmark_result(out, "gpu-*-cpu.md")
    text = md.read_text()
    assert data["smoke"] is True and data["gpu"]["gpu"] == "cpu" and data["gpu"]["torch"]
    assert data["machine"]["cpu"]

    rows = {(r["model"], r["impl"]): r for r in data["rows"]}
    assert set(rows) == {(m, i) for m in PARAMETERS for i in ("dufu", "plain", "plan")}
    for (model, impl), r in rows.items():
        assert not r.get("error"), (model, impl, r.get("error"))
        assert r["compile"] == "off" and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, (model, impl, r)
        assert re.search(rf"^\| {model} \| off \| {impl} \| 4 x 32 \| [\d,]+ \| [\d.]+% \|", text, re.M), (model, impl)

    for model, parameters in PARAMETERS.items():
        info = data["models"][model]
        assert info["parameters"] == parameters
        assert info["tokens_per_step"] == 4 * 32 and info["dtype"] == "fp32"
        dufu, plain, plan = rows[model, "dufu"], rows[model, "plain"], rows[model, "plan"]
        for r in (dufu, plain):
            assert len(r["step_times_s"]) == len(r["losses"]) == 3
            # tokens/s is the tokens of a step over the median timed step (the first one is warm-up)
            assert math.isclose(r["median_step_s"], statistics.median(r["step_times_s"][1:]))
            assert math.isclose(r["tokens_per_s"], 128 / r["median_step_s"])
            # a proper initialisation (N(0, 0.02) weights) predicts the 384 tokens about uniformly at first (a
            # tied head a little better: it favours repeating the input byte); PyTorch's default Linear init does not
            assert abs(r["losses"][0] - math.log(384)) < 0.3, (model, r["losses"])
        # the same tokens, the same architecture and initialisation scheme: the same first loss, up to the draw
        assert abs(dufu["losses"][0] - plain["losses"][0]) < 0.1, (dufu["losses"], plain["losses"])
        assert plain["host_reads_per_step"] == 1
        # dufu's steps read nothing on the host but the loop's read at its log step (every 10): none in 3 steps
        assert dufu["host_reads_per_step"] == 0, dufu
        # the plan's prediction of the same config on this CPU: a step time, and memory that fits
        assert plan["median_step_s"] > 0 and plan["fits"] is True and 0 < plan["memory_gib"] < plan["memory_limit_gib"]
        assert plan["hardware"] == "cpu"
