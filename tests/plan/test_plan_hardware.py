"""The device catalog (published figures), user devices, and this machine's CPU measured once and cached."""

from __future__ import annotations

import json

import pytest

from dufu.errors import ConfigError
from dufu.plan import CATALOG, get_hardware
from dufu.plan.hardware import load_hardware_file


def test_catalog_holds_the_published_figures():
    a40, a80, h100, h200 = (CATALOG[n] for n in ("a100-40gb", "a100-80gb", "h100-80gb", "h200"))
    assert a40.peak("bf16") == a80.peak("bf16") == 312e12 and a80.peak("fp16") == 312e12
    assert h100.peak("bf16") == h200.peak("bf16") == 989e12  # dense (half the 2:4-sparse figure)
    assert (a40.memory_bytes, a80.memory_bytes, h100.memory_bytes, h200.memory_bytes) == (40e9, 80e9, 80e9, 141e9)
    assert a80.intra_node_bandwidth == 300e9 and h100.intra_node_bandwidth == 450e9  # NVLink 3 / 4, one direction
    assert a80.inter_node_bandwidth == 25e9 and h200.inter_node_bandwidth == 50e9  # 8 x 200 / 400 Gb/s per node
    assert all(h.source and h.devices_per_node == 8 for h in (a40, a80, h100, h200))
    assert get_hardware("H100") is h100  # aliases and case


def test_user_devices_and_their_errors(tmp_path, monkeypatch):
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"tpu-ish": {"bf16_tflops": 200, "memory_gb": 32, "memory_bandwidth_gbs": 1200,
                                            "intra_node_bandwidth_gbs": 100, "inter_node_bandwidth_gbs": 25}}))
    monkeypatch.setenv("DUFU_HARDWARE", str(path))
    hw = get_hardware("tpu-ish")
    assert hw.peak("bf16") == 200e12 and hw.peak("fp16") == 200e12 and hw.memory_bytes == 32e9
    assert get_hardware({"name": "x", "bf16_tflops": 1, "memory_gb": 1, "memory_bandwidth_gbs": 1,
                         "intra_node_bandwidth_gbs": 1, "inter_node_bandwidth_gbs": 1}).name == "x"
    bad = tmp_path / "bad.yaml"
    bad.write_text("g:\n  bf16_tflops: 1\n  memory: 3\n")
    with pytest.raises(ConfigError, match="unknown field 'memory'"):
        load_hardware_file(bad)
    bad.write_text("g:\n  bf16_tflops: 1\n")
    with pytest.raises(ConfigError, match="lacks memory_gb"):
        load_hardware_file(bad)


def test_this_cpu_is_measured_once_and_cached(monkeypatch):
    import dufu.plan.cpu as cpu

    first = get_hardware("cpu")
    assert first.measured and first.synchronous and first.cores >= 1
    assert first.peak("fp32", 1) > 1e9 and first.peak("bf16", 1) > 1e8
    assert first.elementwise_bandwidth > first.transcendental_bandwidth > 0
    assert 0 < first.attention_efficiency <= 1 and first.op_overhead_s > 0
    assert first.intra_latency_s > 0 and first.intra_node_bandwidth > 1e7  # gloo between two processes
    assert first.calibration.get(1, 0) > 0 and first.page_fault_bandwidth > 0

    def fail():
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(cpu, "probe_cpu", fail)
    assert get_hardware("cpu") == first


def test_a_new_probe_keeps_the_better_of_each_figure():
    from plan_testing import PROBE
    from dufu.plan.cpu import _best_of

    busy = {**PROBE, "gemm": {"1": {"fp32": 50e9, "bf16": 200e9, "fp16": 200e9}}, "calibration": {"1": 0.3},
            "elementwise_bandwidth": 60e9, "gloo_latency_s": 5e-3}
    merged = _best_of(busy, PROBE)  # measured again while other work shared the cores
    assert merged["gemm"]["1"]["fp32"] == 110e9 and merged["calibration"]["1"] == 0.12
    assert merged["elementwise_bandwidth"] == 130e9 and merged["gloo_latency_s"] == 1e-3
    assert _best_of(PROBE, None) is PROBE
