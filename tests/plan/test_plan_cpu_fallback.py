"""A CPU probe that cannot measure a figure says so: the stand-in it uses is labelled "assumed, not measured" in the
device's source and in the plan's notes, and is never written to the cache as a measurement."""

from __future__ import annotations

import json

import dufu.plan.cpu as cpu
from plan_testing import PROBE, load
from dufu.plan import estimate

MEASURED = {**PROBE, "gloo_all_gather_bandwidth": 0.45e9}  # a probe whose every figure was measured


def test_a_failed_gloo_probe_is_reported_and_not_cached(monkeypatch, tmp_path):
    # the real failure path: the two probe processes start, and exit without measuring
    monkeypatch.setattr(cpu, "_GLOO_WORKER", "import sys; sys.exit('no loopback networking here')")
    figures = cpu.gloo_figures()
    assert set(figures["assumed"]) == {"gloo_latency_s", "gloo_bandwidth", "page_fault_bandwidth",
                                       "gloo_all_gather_bandwidth"}
    assert all("no loopback networking here" in why for why in figures["assumed"].values()), figures["assumed"]
    record = {**{k: v for k, v in PROBE.items() if k not in figures}, **figures}

    hw = cpu.cpu_from_probe(record)
    assert not hw.measured and "assumed, not measured" in hw.source
    assert "gloo_latency_s" in cpu.assumed_figures(hw) and "gloo all-reduce" not in hw.source.split(";")[0]
    assert cpu.cpu_from_probe(PROBE).measured and cpu.assumed_figures(cpu.cpu_from_probe(PROBE)) == ""

    # measured_cpu probes again every time rather than cache the stand-in
    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path))
    probes = []
    monkeypatch.setattr(cpu, "probe_cpu", lambda: probes.append(1) or dict(record))
    first = cpu.measured_cpu()
    assert not first.measured and cpu.measured_cpu() == first and len(probes) == 2
    cached = tmp_path / "plan_hardware.json"
    assert not cached.exists() or json.loads(cached.read_text()) == {}

    # a plan on such a device says which figures it assumed
    est = estimate(load("gpt_debug"), 1, first)
    assert any("assumed, not measured" in n and "gloo_bandwidth" in n for n in est.notes), est.notes

    # a later probe that measures gloo is cached; one that fails again keeps the measured figures, not the stand-in
    monkeypatch.setattr(cpu, "probe_cpu", lambda: dict(MEASURED))
    assert cpu.measured_cpu(remeasure=True).measured
    stored = json.loads(cached.read_text())
    assert [r["gloo_latency_s"] for r in stored.values()] == [PROBE["gloo_latency_s"]]
    monkeypatch.setattr(cpu, "probe_cpu", lambda: dict(record))
    again = cpu.measured_cpu(remeasure=True)
    assert again.measured and again.intra_latency_s == PROBE["gloo_latency_s"] / 2
    assert "assumed" not in json.loads(cached.read_text())[cpu._cpu_key()]


class _Loaded:
    """A LoadMeter whose block waited for a core most of the time."""

    def __init__(self, threads):
        self.under_load = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def describe(self):
        return "its 1 thread waited for a core 60% of the time"


def test_a_probe_under_load_is_labelled_and_not_cached(monkeypatch, tmp_path):
    # the probe itself notices the load (stubbed meter; small stand-ins for the slow parts of the probe)
    monkeypatch.setattr(cpu, "LoadMeter", _Loaded)
    monkeypatch.setattr(cpu, "_PROBE_SHAPES", ((64, 64, 64), (32, 64, 64)))
    monkeypatch.setattr(cpu, "_op_rates", lambda peak: {k: PROBE[k] for k in (
        "elementwise_bandwidth", "transcendental_bandwidth", "attention_efficiency", "optimizer_bandwidth",
        "stream_bandwidth")})
    monkeypatch.setattr(cpu, "_op_overhead", lambda: PROBE["op_overhead_s"])
    monkeypatch.setattr(cpu, "_calibration_step", lambda: 0.1)
    monkeypatch.setattr(cpu, "gloo_figures", lambda: {k: MEASURED[k] for k in MEASURED if k.startswith("gloo")
                                                      or k == "page_fault_bandwidth"})
    record = cpu.probe_cpu()
    assert record["under_load"] == "its 1 thread waited for a core 60% of the time"
    hw = cpu.cpu_from_probe(record)
    assert "measured under load (its 1 thread waited for a core 60% of the time): not cached" in hw.source

    # measured_cpu uses it for this plan and measures again next time
    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path))
    probes = []
    monkeypatch.setattr(cpu, "probe_cpu", lambda: probes.append(1) or dict(record))
    cpu.measured_cpu()
    cpu.measured_cpu()
    assert len(probes) == 2
    cached = tmp_path / "plan_hardware.json"
    assert not cached.exists() or json.loads(cached.read_text()) == {}
    # a quiet probe is cached
    monkeypatch.setattr(cpu, "probe_cpu", lambda: {k: v for k, v in record.items() if k != "under_load"})
    cpu.measured_cpu()
    assert list(json.loads(cached.read_text())) == [cpu._cpu_key()]
