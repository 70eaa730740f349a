"""The GPU time model on published training results its constants were not fitted to, and the fit itself.

``benchmarks/plan_fit.py`` holds the published rows (each with its source, layout and how sure its mapping to a dufu
config is), the named subset the constants of :data:`dufu.plan.hardware.GPU_CONSTANTS` are fitted to (every other
row of Table 1 of Narayanan et al. 2021), and the fit. Here: every held-out row is predicted within
:data:`TOLERANCE`; the published figures are read as their sources count them (eq. 3 of Narayanan et al. turns a
published iteration time into the published TFLOP/s); and a fit from the priors reproduces the constants dufu holds.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from dufu.plan.hardware import GPU_CONSTANTS

REPO = Path(__file__).resolve().parents[2]

# Held-out rows of the system the fit rows come from (Megatron-LM, Narayanan et al. 2021, Tables 1 and 2) are
# predicted within 10% of the published throughput (observed: at most 8.7%, mean 2.9% for Table 1 and 5.4% for
# Table 2; benchmarks/results/plan_fit-2026-11-28.md). Other systems ran the same kind of layouts slower than
# Megatron-LM (MT-NLG's 530B at 2,240 GPUs: 126 TFLOP/s per GPU, Megatron's own 159): the planner, fitted to
# Megatron-LM, is optimistic for them, within 20% (observed 12.1-16.3%).
TOLERANCE = 0.10
OTHER_SYSTEMS_TOLERANCE = 0.20


def _load():
    spec = importlib.util.spec_from_file_location("bench_plan_fit", REPO / "benchmarks" / "plan_fit.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))  # as `python benchmarks/plan_fit.py` has it (harness)
        mp.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while it is executed
        spec.loader.exec_module(module)  # importing it runs nothing
    return module


plan_fit = _load()
HELD_OUT = [r for r in plan_fit.PUBLISHED if r.key not in plan_fit.FIT_ROWS]


@pytest.fixture(scope="module")
def candidates():
    """Every row's model, setup and the layouts the planner chooses among (one search per row)."""
    return {}


def _candidates(cache: dict, row):
    if row.key not in cache:
        cache[row.key] = plan_fit.candidates(row)
    return cache[row.key]


def test_the_fit_rows_are_named_and_the_rest_held_out():
    keys = [r.key for r in plan_fit.PUBLISHED]
    assert len(keys) == len(set(keys))
    assert set(plan_fit.FIT_ROWS) <= set(keys)
    table1 = [r.key for r in plan_fit.PUBLISHED if "Table 1" in r.source]
    assert list(plan_fit.FIT_ROWS) == table1[::2]  # every other row of Table 1
    assert len(HELD_OUT) >= 10 and not {r.key for r in HELD_OUT} & set(plan_fit.FIT_ROWS)
    for r in plan_fit.PUBLISHED:
        assert r.source and r.certainty in ("high", "medium") and (r.certainty == "high" or r.note), r.key
        assert r.dp * r.tp * r.pp == r.gpus and r.batch % r.dp == 0, r.key


def test_published_figures_are_read_as_their_sources_count_them():
    """A published iteration time and the TFLOP/s its source prints agree through eq. 3 of Narayanan et al. (the
    count the planner's comparison uses): BLOOM's log line (104.70 s, 149.77 TFLOP/s) and MT-NLG's three runs."""
    by = plan_fit.BY_KEY
    assert by["bloom-176B"].published_tflops() == pytest.approx(149.77, abs=0.01)
    assert [round(by[f"mt-nlg-530B-{n}"].published_tflops()) for n in (2240, 2800, 3360)] == [126, 120, 113]
    # Table 1: the aggregate petaFLOP/s column is GPUs x TFLOP/s (the latter rounded to a whole number: 502.0 / 3,072
    # = 163.4), and the step time follows from the count
    row = by["megatron21-t1-1008.0B"]
    assert abs(row.gpus * row.published_tflops() - 502.0e3) <= row.gpus * 0.5
    assert row.published_step_s() == pytest.approx(row.flops() / (3072 * 163e12))


@pytest.mark.parametrize("row", HELD_OUT, ids=[r.key for r in HELD_OUT])
def test_held_out_row_within_tolerance(row, candidates):
    step, layout = plan_fit.predict(_candidates(candidates, row), GPU_CONSTANTS)
    ratio = row.published_step_s() / step  # predicted / published throughput
    if row.key.startswith("megatron21-"):
        assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, f"{row.key}: predicted / published {ratio:.3f} ({layout.short()})"
    else:
        assert 1.0 <= ratio <= 1 + OTHER_SYSTEMS_TOLERANCE, f"{row.key}: predicted / published {ratio:.3f}"


def test_the_fit_reproduces_the_constants(candidates):
    """Fitting the named rows again, from the priors' centres, gives the constants dufu holds (to the digits they
    are written with), with either solver."""
    rows = [_candidates(candidates, plan_fit.BY_KEY[k]) for k in plan_fit.FIT_ROWS]
    result = plan_fit.fit(rows, solver="numpy")
    for name, value in result["constants"].items():
        assert plan_fit.rounded(value) == pytest.approx(GPU_CONSTANTS[name], rel=0.006), (name, value)
    assert set(result["constants"]) == set(GPU_CONSTANTS)
    assert all(math.isfinite(v) for v in result["posterior_sd"].values())
