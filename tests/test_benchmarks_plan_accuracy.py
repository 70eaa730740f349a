"""The comparison of ``benchmarks/plan_accuracy.py``, on a synthetic measurement (no processes): predicted /
measured per layout, the 10% / 25% verdicts and their summary, the planner called on each run's own config with
the runs' settings, a planner that rejects a layout or is missing, and the median step time read from
``metrics.jsonl``; the models (the calibration model and the held-out ones, each with a baseline of its own
family), their selection, result files and one-line-per-model summary; and one ``--quick`` run of a held-out
model end to end (one layout, its baseline, the prediction)."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

import launch
from dufu_testing import load_benchmark

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("plan_accuracy")


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


# ----------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def models(bench):
    """benchmarks/plan_accuracy_models.py, as the script imported it."""
    return sys.modules["plan_accuracy_models"]


def test_model_selection_and_default_layouts(bench, models):
    names = lambda ms: [m.name for m in ms]  # noqa: E731
    held_out = [m.name for m in models.MODELS if m.held_out]
    assert len(held_out) >= 3 and not bench.CALIBRATION.held_out
    assert names(models.select(["held-out"])) == held_out
    assert names(models.select(["llama-8x512,gpt-16x256", "gpt-16x256", "held-out"]))[:2] == ["llama-8x512",
                                                                                              "gpt-16x256"]
    assert len(models.select(["held-out", "gpt-8x512"])) == len(held_out) + 1  # each once
    with pytest.raises(ValueError, match="choose from gpt-8x512"):
        models.select(["gpt-huge"])
    with pytest.raises(SystemExit):  # the command line says so before anything runs
        bench.main(["--model", "gpt-huge"])
    with pytest.raises(SystemExit):
        bench.main(["--layouts", "held-out,dp9"])

    args = lambda **kw: types.SimpleNamespace(**{"layouts": None, "quick": False, **kw})  # noqa: E731
    llama = models.BY_NAME["llama-8x512"]
    keys = lambda layouts: [layout.key for layout in layouts]  # noqa: E731
    assert keys(bench.layouts_for(bench.CALIBRATION, args())) == [layout.key for layout in bench.LAYOUTS]
    assert keys(bench.layouts_for(llama, args())) == bench.HELD_OUT_LAYOUTS
    assert keys(bench.layouts_for(llama, args(quick=True))) == bench.QUICK_LAYOUTS
    assert keys(bench.layouts_for(bench.CALIBRATION, args(layouts="held-out,1proc,pp2i"))) == [
        *bench.HELD_OUT_LAYOUTS, "pp2i"]
    assert len(bench.HELD_OUT_LAYOUTS) == 8 and set(bench.HELD_OUT_LAYOUTS) <= set(bench.BY_KEY)


def test_models_build_from_their_recipes_with_baselines_of_their_family(bench, models):
    """Every model's sizes (full and quick) and its baseline are overrides its recipe takes; the baseline builds
    the same class, tiny; the quick sizes keep the 4 layers interleaved 1F1B at pp 2 needs."""
    import torch

    from dufu.config import instantiate

    parallel_memory = sys.modules["parallel_memory"]
    for model in models.MODELS:
        built = {}
        for what, sizes in (("full", model.sizes), ("quick", model.quick), ("baseline", model.baseline)):
            cfg = bench.config_for(parallel_memory.model_overrides(sizes, 64), model.recipe)
            with torch.device("meta"):
                m = instantiate(cfg.model)
            built[what] = (type(m), sum(p.numel() for p in {id(p): p for p in m.parameters()}.values()))
        assert built["full"][0] is built["quick"][0] is built["baseline"][0], model.name
        assert 10e6 < built["full"][1] < 70e6 and built["quick"][1] < 8e6 and built["baseline"][1] < 0.2e6, built
        assert model.quick["num_layers"] >= 4 and model.sizes["max_position_embeddings"] == 64
    llama = models.BY_NAME["llama-8x512"]
    assert llama.recipe == "llama_debug" and llama.baseline["num_key_value_heads"] < llama.baseline[
        "num_attention_heads"]
    assert bench.baseline_model(bench.BY_KEY["pp2i"], llama)["num_layers"] == 4  # one layer per pipeline stage
    assert bench.baseline_model(bench.BY_KEY["pp2i"])["hidden_size"] == 64  # the GPT baseline by default


def test_predictions_plan_with_the_runs_settings(bench, results, monkeypatch):
    """dufu.plan reads OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ as settings of the runs it predicts: the
    predictions are made with the runs' (one thread, glibc returning freed memory), the environment restored."""
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    seen = []

    def estimate(cfg, world_size, hardware):
        seen.append((os.environ.get("OMP_NUM_THREADS"), os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                     type(cfg.model).__name__, cfg.model._target_.__name__))
        return types.SimpleNamespace(memory_per_gpu_bytes=MiB, step_time_s=1.0, memory={}, time={}, layout={})

    bench.predict(results["measured"]["rows"][:1], estimate, "llama_debug")
    assert seen[0][:2] == ("1", "65536") and seen[0][3] == "LlamaModel"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    assert bench.run_settings({"threads_per_process": 2, "allocator": {}}) == {"OMP_NUM_THREADS": "2"}


def test_result_files_name_their_model(bench, models, tmp_path):
    for name in ("plan-accuracy-2026-11-25.json", "plan-accuracy-2026-11-27-gpt-8x512.json",
                 "plan-accuracy-2026-11-28-llama-8x512.json", "plan-accuracy-2026-11-26-llama-8x512.json",
                 "plan-accuracy-2026-11-29-heldout.json"):
        (tmp_path / name).write_text("{}")
    llama = models.BY_NAME["llama-8x512"]
    assert bench.newest_results(tmp_path, llama).name == "plan-accuracy-2026-11-28-llama-8x512.json"
    assert bench.newest_results(tmp_path).name == "plan-accuracy-2026-11-27-gpt-8x512.json"
    assert bench.newest_results(tmp_path, models.BY_NAME["gpt-16x256"]) is None
    assert bench.stem_for(tmp_path, "gpt-16x256", "2026-12-01").name == "plan-accuracy-2026-12-01-gpt-16x256"


def test_held_out_report_and_summary_of_models(bench, models, results, tmp_path):
    predictions = {"1proc": {"memory_per_gpu_bytes": 540 * MiB, "step_time_s": 2.4},
                   "dp2z3": {"memory_per_gpu_bytes": 240 * MiB, "step_time_s": 6.0}}
    entries = []
    for model in (models.CALIBRATION, models.BY_NAME["gpt-4x1024"]):
        r = json.loads(json.dumps(results))
        r["measured"].update(model.describe())
        r["planner"], r["predictions"] = {"available": True}, predictions
        bench.finish(r)
        entries.append((r, bench.stem_for(tmp_path, model.name, r["date"])))
    calibration, wide = (bench.report(r) for r, _ in entries)
    assert calibration.startswith("# Planner accuracy - gpt-8x512 (calibration model) - 2026-01-01")
    assert "**Calibration model**" in calibration and "in sample" in calibration
    assert wide.startswith("# Planner accuracy - gpt-4x1024 (held out) - 2026-01-01")
    assert "**Held out**" in wide and "was **not** used to set any constant of the CPU cost model" in wide
    assert "Machine: Test CPU, 2 cores" in wide  # the CPU model, as before
    bench.write_models(entries, tmp_path)
    text = (tmp_path / "plan-accuracy-2026-01-01-heldout.md").read_text()
    assert text.startswith("# Planner accuracy out of sample - 2026-01-01")
    assert "| gpt-4x1024 | `gpt_debug` | 29.4M | 1 of 2 | 0.80 to 1.08 (median 0.94); dp2 ZeRO-3 0.80 | 1 of 2 |" in text
    assert "| gpt-8x512 (calibration model: in sample) |" in text
    assert "**All 2 models: peak memory per rank 2 of 4 within 10%; step time 2 of 4 within 25%.**" in text
    data = json.loads((tmp_path / "plan-accuracy-2026-01-01-heldout.json").read_text())
    assert data["machine"]["cpu"] == "Test CPU" and [m["name"] for m in data["models"]] == ["gpt-8x512",
                                                                                              "gpt-4x1024"]
    assert data["models"][1]["held_out"] is True and data["models"][1]["time"]["furthest"]["layout"] == "dp2 ZeRO-3"


@pytest.mark.multiprocess
def test_quick_run_of_a_held_out_model(tmp_path):
    """``--quick --model llama-8x512``: a small LLaMA trained in one layout after a baseline of a tiny LLaMA, the
    planner's prediction next to it, the files named after the model (about 30 s)."""
    out = tmp_path / "results"
    proc = launch.run([sys.executable, REPO / "benchmarks" / "plan_accuracy.py", "--quick", "--model",
                       "llama-8x512", "--layouts", "1proc", "--results-dir", out], cwd=REPO, timeout=300)
    launch.assert_ok(proc)
    stem = out / f"plan-accuracy-{json.loads(next(out.glob('*.json')).read_text())['date']}-llama-8x512"
    data = json.loads(stem.with_suffix(".json").read_text())
    m = data["measured"]
    assert (m["name"], m["held_out"], m["config"]) == ("llama-8x512", True, "llama_debug")
    assert m["model"]["num_key_value_heads"] == 2 and m["baseline_model"]["num_key_value_heads"] == 2
    (row,) = m["rows"]
    assert "model.num_key_value_heads=2" in row["run"]["overrides"]
    assert row["baseline"]["model"]["num_layers"] == 1 and "model.ffn_hidden_size=176" in row["baseline"]["overrides"]
    assert row["peak_minus_baseline_mib"]["max"] > 0 and row["run"]["median_step_time_s"] > 0
    assert data["planner"]["settings"] == {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    pred = data["predictions"]["1proc"]
    assert "error" not in pred and pred["memory_per_gpu_bytes"] > 0 and pred["step_time_s"] > 0
    assert data["machine"]["cpu"]
    text = stem.with_suffix(".md").read_text()
    assert text.startswith("# Planner accuracy - llama-8x512 (held out) - ") and "**Held out**" in text
    assert not list(out.glob("*-heldout.*"))  # one model: no summary of models
