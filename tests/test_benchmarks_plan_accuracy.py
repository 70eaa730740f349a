"""The comparison of ``benchmarks/plan_accuracy.py``, on a synthetic measurement (no processes): predicted /
measured per layout, the 10% / 25% verdicts and their summary, the planner called on each run's own config, a
planner that rejects a layout or is missing, and the median step time read from ``metrics.jsonl``."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan_accuracy", REPO / "benchmarks" / "plan_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        # as `python benchmarks/plan_accuracy.py` has it: the script's folder first (parallel_memory.py, harness)
        mp.syspath_prepend(str(REPO / "benchmarks"))
        mp.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it is executed
        spec.loader.exec_module(module)  # importing it runs nothing
    return module


def _row(bench, key: str, peak_mib: tuple[float, float], step_s: float) -> dict:
    """A measured row as ``measure`` writes it: peak - baseline per rank, the median step time."""
    layout = bench.BY_KEY[key]
    per_rank = list(peak_mib[:layout.nproc]) if layout.nproc > 1 else [peak_mib[0]]
    overrides = ["model.num_layers=2", "train.train_iter=6", "train.train_micro_batch_size=1",
                 f"train.global_batch_size={bench.GLOBAL_BATCH}", *layout.overrides()]
    return {**layout.describe(),
            "baseline": {"peak_mib": [330.0] * layout.nproc},
            "run": {"overrides": overrides, "median_step_time_s": step_s, "load_avg_before": 0.5,
                    "losses": [5.0, 4.9], "step_times_s": [2 * step_s, step_s], "timed_steps": 1},
            "peak_minus_baseline_mib": {"max": max(per_rank), "min": min(per_rank), "per_rank": per_rank},
            "train_minus_baseline_mib": {"max": max(per_rank) - 1, "min": min(per_rank) - 1, "per_rank": per_rank}}


@pytest.fixture()
def results(bench):
    rows = [_row(bench, "1proc", (500.0,), 2.0), _row(bench, "dp2z3", (300.0, 280.0), 4.0),
            _row(bench, "pp2i", (200.0, 260.0), 3.0)]
    failed = {**bench.BY_KEY["tp2"].describe(), "baseline": {"peak_mib": [330.0, 331.0]},
              "run": {"overrides": bench.BY_KEY["tp2"].overrides(), "median_step_time_s": None,
                      "load_avg_before": 0.5, "losses": [], "error": "boom", "returncode": 1}}
    return {"date": "2026-01-01", "cores": 2, "load_avg_start": 0.1, "load_avg_end": 0.3, "measure_s": 600.0,
            "cpu_s": 1100.0,
            "machine": {"cpu": "Test CPU", "logical_cpus": 2, "torch": "2.13.0", "python": "3.11", "libc": "glibc",
                        "memory_gib": 8, "dufu_commit": "abc1234"},
            "measured": {"config": "gpt_debug", "model": {"num_layers": 2}, "parameters": 29_447_168,
                         "seq_length": 64, "global_batch_size": 4, "micro_batch_size": 1, "steps": 6, "warmup": 2,
                         "baseline_model": {"num_layers": 1, "hidden_size": 64}, "rows": [*rows, failed]}}


def test_ratios_verdicts_and_summary(bench, results):
    predictions = {
        "1proc": {"memory_per_gpu_bytes": 540 * MiB, "step_time_s": 2.4},   # +8%: within; +20%: within
        "dp2z3": {"memory_per_gpu_bytes": 240 * MiB, "step_time_s": 6.0},   # -20%: no; +50%: no
        "pp2i": {"error": "NotImplementedError: interleaved"},
    }
    comp = {c["key"]: c for c in bench.compare(results["measured"]["rows"], predictions, cores=2)}
    one, z3, pp, tp = comp["1proc"], comp["dp2z3"], comp["pp2i"], comp["tp2"]
    assert one["measured_memory_mib"] == 500.0 and one["predicted_memory_mib"] == 540.0
    assert one["memory_ratio"] == pytest.approx(1.08) and one["memory_within"] is True
    assert one["time_ratio"] == pytest.approx(1.2) and one["time_within"] is True
    assert z3["measured_memory_mib"] == 300.0  # the larger rank
    assert z3["memory_ratio"] == pytest.approx(0.8) and z3["memory_within"] is False
    assert z3["time_ratio"] == pytest.approx(1.5) and z3["time_within"] is False
    assert z3["processes_per_core"] == 1.0
    assert pp["memory_ratio"] is None and pp["memory_within"] is None and pp["prediction_error"].startswith("NotImpl")
    assert tp["measured_memory_mib"] is None and tp["memory_within"] is None  # a failed run is not judged
    s = bench.summary(list(comp.values()))
    assert (s["memory"]["within"], s["memory"]["compared"]) == (1, 2)
    assert s["memory"]["line"] == "Peak memory per rank: 1 of 2 within 10%"
    assert s["time"]["line"] == "Step time: 1 of 2 within 25%"
    # the tolerance is inclusive: exactly 10% / 25% off passes
    edge = bench.compare(results["measured"]["rows"][:1],
                         {"1proc": {"memory_per_gpu_bytes": 450 * MiB, "step_time_s": 2.5}}, cores=2)[0]
    assert edge["memory_within"] is True and edge["time_within"] is True


def test_predict_uses_each_runs_config_and_world_size(bench, results):
    seen = []

    def estimate(cfg, world_size, hardware):
        d = cfg.train.dist
        seen.append((world_size, d.data_parallel_size, d.pipeline_parallel_size, d.virtual_pipeline_size,
                     cfg.train.zero_optimization.stage if cfg.train.zero_optimization.enabled else 0,
                     cfg.model.num_layers, hardware))
        if d.virtual_pipeline_size > 1:
            raise NotImplementedError("interleaved")
        return types.SimpleNamespace(memory_per_gpu_bytes=100 * MiB * world_size, step_time_s=1.5,
                                     memory={"parameters": 4 * MiB, "opaque": object()}, time={"compute": 1.0},
                                     layout={"dp": d.data_parallel_size})

    pred = bench.predict(results["measured"]["rows"][:3], estimate)
    assert seen == [(1, 1, 1, 1, 0, 2, "cpu"), (2, 2, 1, 1, 3, 2, "cpu"), (2, 1, 2, 2, 0, 2, "cpu")]
    assert pred["1proc"]["memory_per_gpu_bytes"] == 100 * MiB and pred["dp2z3"]["step_time_s"] == 1.5
    assert pred["1proc"]["memory"]["parameters"] == 4 * MiB
    assert pred["1proc"]["memory"]["opaque"].startswith("<object")  # JSON-ready
    assert pred["pp2i"] == {"error": "NotImplementedError: interleaved"}
    json.dumps(pred)


def test_report_with_and_without_planner(bench, results):
    results["planner"] = {"available": False, "error": "ModuleNotFoundError: No module named 'dufu.plan'"}
    results["predictions"] = None
    bench.finish(results)
    text = bench.report(results)
    assert "**No predictions**" in text and "No module named 'dufu.plan'" in text
    assert "| dp2 ZeRO-3 | 2 | 1 | 300 (280) | - | - | - | 4,000 | - |" in text
    assert "| tp2 | 2 | 1 | failed |" in text
    assert "within 10%" in text and "of 0" not in text  # no summary line without predictions

    results["planner"], results["predictions"] = {"available": True}, {
        "1proc": {"memory_per_gpu_bytes": 540 * MiB, "step_time_s": 2.4},
        "dp2z3": {"memory_per_gpu_bytes": 240 * MiB, "step_time_s": 6.0}}
    bench.finish(results)
    text = bench.report(results)
    assert "| 1 process | 1 | 0.5 | 500 | 540 | 1.08 (+8%) | yes | 2,000 | 2,400 | 1.20 (+20%) | yes |" in text
    assert "| dp2 ZeRO-3 | 2 | 1 | 300 (280) | 240 | 0.80 (-20%) | **no** | 4,000 | 6,000 | 1.50 (+50%) | **no** |" \
        in text
    assert "**Peak memory per rank: 1 of 2 within 10%**; **Step time: 1 of 2 within 25%**." in text
    assert "Failed runs: tp2" in text

    # what else ran: the CPU time of other processes (20% of 2 cores over 600 s) and a note, first
    results["other_cpu_s"], results["notes"] = 240.0, ["A second benchmark ran meanwhile."]
    bench.finish(results)
    text = bench.report(results)
    assert "Other processes used 240 CPU seconds meanwhile, 20% of the cores: the step times are slower" in text
    assert "## Observations\n\n* A second benchmark ran meanwhile.\n" in text
    json.dumps(results)


def test_layout_overrides_exist_in_the_recipe(bench):
    """Every layout's overrides name keys of gpt_debug's config (an unknown key is an error) with its degrees."""
    for layout in bench.LAYOUTS:
        cfg = bench.config_for(layout.overrides())
        d = cfg.train.dist
        assert (d.data_parallel_size, d.tensor_parallel_size, d.pipeline_parallel_size) == (
            layout.dp, layout.tp, layout.pp)
        assert cfg.train.zero_optimization.enabled is bool(layout.zero)
        assert cfg.train.amp.enabled == (False if layout.dtype == "fp32" else layout.dtype)
    pp2i = bench.BY_KEY["pp2i"].overrides()
    assert "train.dist.pipeline_schedule=interleaved_1f1b" in pp2i and "train.dist.virtual_pipeline_size=2" in pp2i
    assert bench.BY_KEY["dp2"].title == "dp2 DDP" and bench.BY_KEY["tp2sp-ac"].title == "tp2 + SP, full AC"
    assert len(bench.LAYOUTS) >= 12


def test_median_step_time_after_warmup(bench, tmp_path):
    lines = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": t} for s, t in enumerate([9.0, 5.0, 1.0, 3.0, 2.0], 1)]
    lines.insert(2, {"step": 2, "eval_loss": 4.0})  # an evaluation record has no loss: not a step
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    got = bench.step_times(tmp_path, warmup=2)
    assert got["timed_steps"] == 3 and got["median_step_time_s"] == 2.0
    assert got["step_times_s"] == [9.0, 5.0, 1.0, 3.0, 2.0]
    assert bench.step_times(tmp_path / "missing", warmup=2)["median_step_time_s"] is None
