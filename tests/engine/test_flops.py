"""Model FLOPs per token (6N + 12 L H T) and the peak FLOP/s used for MFU: measured alike for every dtype, and
cached only when the machine was quiet (a reading under load serves its own run, labelled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from dufu.cache import resolve_cache_dir
from dufu.engine.precision import MIN_SPEEDUP, choose_precision
from dufu.engine.reporting import flops
from dufu.models.gpt import GPTModel
from dufu_testing import count_gpt_parameters

V, H, L, P = 384, 64, 2, 32
CPU = torch.device("cpu")
BOTH = (torch.float32, torch.bfloat16)
UNDER_LOAD = "measured under load: not cached"


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_parameters_exclude_lookup_tables(tied):
    model = GPTModel(vocab_size=V, hidden_size=H, num_layers=L, num_attention_heads=4, max_position_embeddings=P,
                     tie_word_embeddings=tied)
    total = count_gpt_parameters(V, H, L, P, tied=tied)
    # The position table is a pure lookup; the token table counts once when it is also the output head.
    expected = total - P * H if tied else total - P * H - V * H
    assert flops.count_matmul_params(model) == expected


def test_flops_per_token_formula():
    assert flops.flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache of peaks (the session's cache directory stays, with its datasets) and no reading of this
    process kept: the peak comes from what the test does."""
    path = tmp_path / "peaks" / "peak_flops.json"
    monkeypatch.setattr(flops, "_cache_file", lambda: path)
    monkeypatch.delenv("DUFU_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(flops, "_UNCACHED", {})
    return path


def cached(path) -> dict:
    return {k: v["flop_s"] for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def test_a_given_peak_overrides(fresh, monkeypatch):
    peak, source = flops.device_peak_flops(CPU, torch.float32, override_tflops=2.5)
    assert peak == 2.5e12 and "given in the config" in source
    monkeypatch.setenv("DUFU_PEAK_TFLOPS", "0.5")
    assert flops.device_peak_flops(CPU, torch.float32)[0] == 0.5e12
    assert cached(fresh) == {}


def test_only_quiet_readings_are_cached_and_the_best_one_stays(fresh):
    # Under load, on an empty cache: the reading is this run's peak, labelled, and nothing is written.
    assert flops.keep_reading(CPU, torch.bfloat16, 3.2e10, under_load=True, how="2 threads waited 45%") is False
    assert cached(fresh) == {}
    peak, source = flops.device_peak_flops(CPU, torch.bfloat16, remeasure=False)
    assert peak == 3.2e10 and UNDER_LOAD in source and "45%" in source
    # A reading whose load nobody checked is no better: used, not cached.
    flops.device_peak_flops(CPU, torch.float32, remeasure=False, measured=2e9)
    assert cached(fresh) == {}
    assert "load not checked: not cached" in flops.device_peak_flops(CPU, torch.float32, remeasure=False)[1]

    # A quiet reading is cached and is the peak from then on; the loaded one is still named, as not cached.
    assert flops.keep_reading(CPU, torch.bfloat16, 2.0e12, under_load=False) is True
    peak, source = flops.device_peak_flops(CPU, torch.bfloat16, remeasure=False)
    assert peak == 2.0e12 and "best quiet" in source and f"32 GFLOP/s, was {UNDER_LOAD}" in source
    # Only a better quiet reading replaces it; a reading under load never does, however high.
    flops.keep_reading(CPU, torch.bfloat16, 1.9e12, under_load=False)
    flops.keep_reading(CPU, torch.bfloat16, 2.5e12, under_load=True)
    assert list(cached(fresh).values()) == [2.0e12]
    flops.keep_reading(CPU, torch.bfloat16, 2.1e12, under_load=False)
    assert list(cached(fresh).values()) == [2.1e12] and "bfloat16" in next(iter(cached(fresh)))
    assert flops.device_peak_flops(CPU, torch.bfloat16, remeasure=False)[0] == 2.1e12


def test_a_bare_number_in_the_cache_is_not_a_quiet_peak(fresh):
    """An older dufu cached whatever it measured, under load too: such an entry is not trusted."""
    key = flops._key(CPU, torch.bfloat16)
    fresh.parent.mkdir()
    fresh.write_text(json.dumps({key: 3.2e10}))
    flops.keep_reading(CPU, torch.bfloat16, 1e12, under_load=True)
    peak, source = flops.device_peak_flops(CPU, torch.bfloat16, remeasure=False)
    assert peak == 1e12 and UNDER_LOAD in source
    flops.keep_reading(CPU, torch.bfloat16, 2e12, under_load=False)
    assert cached(fresh) == {key: 2e12}


def reading(speeds: dict, wait_share: float) -> flops.MatmulReading:
    """A reading of :func:`flops.measure_matmuls` with these speeds (GFLOP/s) and run-queue wait share."""
    load = flops.LoadMeter(2)
    load.method, load.wait_share = "run-queue wait", wait_share
    return flops.MatmulReading({dtype: [s * 1e9] for dtype, s in speeds.items()}, 2048, dict.fromkeys(speeds, 1), load)


def test_the_start_up_choice_uses_a_loaded_reading_for_this_run_only(fresh, monkeypatch):
    """The MFU basis of a run (choose_precision's peak_source, printed in the start-up summary) is a quiet reading
    or says it was measured under load; under load the dtypes are compared on one thread by CPU time."""
    readings = [reading({torch.float32: 2, torch.bfloat16: 30}, wait_share=0.5),  # all threads, under load
                reading({torch.float32: 150, torch.bfloat16: 900}, wait_share=0.5),  # one thread, CPU time
                reading({torch.float32: 350, torch.bfloat16: 2000}, wait_share=0.01),  # quiet
                reading({torch.float32: 30, torch.bfloat16: 190}, wait_share=0.4),
                reading({torch.float32: 150, torch.bfloat16: 910}, wait_share=0.4)]
    calls = []

    def measure(device, dtypes, size=2048, seconds=0.8, cpu_time=False):
        calls.append((torch.get_num_threads(), cpu_time))
        return readings.pop(0)

    monkeypatch.setattr(flops, "measure_matmuls", measure)
    threads = torch.get_num_threads()
    loaded = choose_precision("auto", "bf16", CPU)
    assert calls == [(threads, False), (1, True)] and torch.get_num_threads() == threads
    assert loaded.dtype == torch.bfloat16 and loaded.peaks == {"fp32": 150e9, "bf16": 900e9}
    assert loaded.peak_flops == 30e9 and UNDER_LOAD in loaded.peak_source  # this run's reading, labelled
    assert "waited for a core 50%" in loaded.peak_source and "compared on one thread" in loaded.peak_source
    assert cached(fresh) == {}

    quiet = choose_precision("auto", "bf16", CPU)
    assert len(calls) == 3  # quiet: no second look
    assert quiet.dtype == torch.bfloat16 and quiet.peak_flops == 2000e9 and "best quiet" in quiet.peak_source
    assert sorted(cached(fresh).values()) == [350e9, 2000e9]

    again = choose_precision("auto", "bf16", CPU)  # loaded again: the cached quiet peak stays the MFU basis
    assert again.dtype == torch.bfloat16 and again.peak_flops == 2000e9 and UNDER_LOAD in again.peak_source
    assert sorted(cached(fresh).values()) == [350e9, 2000e9]

    # what the start-up measurement returns says how it was measured
    readings.extend([reading({torch.float32: 20, torch.bfloat16: 50}, wait_share=0.3),
                     reading({torch.float32: 150, torch.bfloat16: 920}, wait_share=0.3)])
    speeds = flops.matmul_speeds(CPU, BOTH)
    assert speeds == {torch.float32: 150e9, torch.bfloat16: 920e9}
    assert speeds.note == "one thread, by CPU time: under load, its 2 threads waited for a core 30% of the time"


def test_every_dtype_is_timed_at_one_size_in_alternation(monkeypatch):
    """One matrix size for all dtypes, however differently fast they are; samples alternate between the dtypes."""
    order = []
    real = flops._timed_matmuls

    def timed(a, b, device, *args):
        order.append((a.dtype, a.shape[0]))
        return real(a, b, device, *args)

    monkeypatch.setattr(flops, "_timed_matmuls", timed)
    r = flops.measure_matmuls(CPU, BOTH, size=512, seconds=0.05)
    sampled = order[-2 * flops.MIN_ROUNDS:]
    assert {n for _, n in sampled} == {r.size} and r.size in (256, 512)
    assert [d for d, _ in sampled] == [torch.float32, torch.bfloat16] * flops.MIN_ROUNDS
    assert min(len(s) for s in r.samples.values()) >= flops.MIN_ROUNDS
    with pytest.raises(ValueError, match="set_num_threads\\(1\\)"), start_up_threads(2):
        flops.measure_matmuls(CPU, BOTH, size=256, seconds=0.01, cpu_time=True)


@contextmanager
def cpu_hogs(count: int):
    """``count`` processes that spin on a core each (they end themselves after a minute should this one die)."""
    hog = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    procs = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", hog], start_new_session=True))
        time.sleep(0.3)  # started and spinning
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@contextmanager
def start_up_threads(count: int | None = None):
    """The threads a run measures with (every core; the test session runs one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_under_cpu_hogs_the_ratio_and_the_choice_hold(fresh):
    """The start-up measurement of train.amp.enabled=auto beside CPU hogs: the load is seen (not cached, labelled),
    and the bf16/fp32 ratio and the dtype it picks are those of the reading without the hogs."""
    with start_up_threads():
        quiet = choose_precision("auto", "bf16", CPU)
        cache_before = cached(fresh)
        with cpu_hogs(max(2, os.cpu_count() or 1)) as hogs:
            loaded = choose_precision("auto", "bf16", CPU)
            assert all(h.poll() is None for h in hogs)  # the load was there throughout
    quiet_ratio, loaded_ratio = (p.peaks["bf16"] / p.peaks["fp32"] for p in (quiet, loaded))
    print(f"without hogs {quiet_ratio:.2f}x: {quiet.peak_source}\nwith hogs {loaded_ratio:.2f}x: {loaded.peak_source}")
    assert UNDER_LOAD in loaded.peak_source and cached(fresh) == cache_before  # seen, used, not cached
    # Under load the dtypes are compared on one thread, the quiet reading uses every core. The two ratios differ by
    # how each dtype scales with threads: on an AMX CPU whose two cores are SMT siblings sharing one AMX unit, bf16
    # does not scale and fp32 does (measured: 6.6x on one thread, 3.2-4.1x on two). So the ratio is held within 2x
    # only near the decision (within 2x of MIN_SPEEDUP either way); away from it the verdict must hold with margin.
    if MIN_SPEEDUP / 2 < quiet_ratio < 2 * MIN_SPEEDUP:
        assert 0.5 < loaded_ratio / quiet_ratio < 2.0
    else:
        assert (loaded_ratio >= MIN_SPEEDUP) == (quiet_ratio >= MIN_SPEEDUP)
    assert loaded.dtype == quiet.dtype == (torch.bfloat16 if quiet_ratio >= MIN_SPEEDUP else None)


def test_a_runs_mfu_basis_is_a_quiet_peak_or_says_it_is_not(debug_run):
    """The session's debug run measured its peak (train.peak_tflops unset): its start-up summary gives the MFU basis
    with its source, which is the cached quiet peak or a reading labelled as not cached."""
    rt = debug_run.trainer.runtime
    mfu_line = next(line for text in debug_run.log for line in text.splitlines() if line.strip().startswith("MFU"))
    assert mfu_line.endswith(f"peak {rt.peak_source}")
    if "best quiet" in rt.peak_source:
        table = json.loads((resolve_cache_dir() / "peak_flops.json").read_text())
        assert table[flops._key(CPU, rt.amp_dtype or torch.float32)]["flop_s"] >= rt.peak_flops
    else:
        assert UNDER_LOAD in rt.peak_source, rt.peak_source


@pytest.mark.parametrize("name,bf16,fp32,source", [
    ("NVIDIA H100 NVL", 835.5, 60.0, "H100 NVL"),
    ("NVIDIA H100 80GB HBM3", 989.5, 67.0, "H100 SXM"),
    ("NVIDIA H100 PCIe", 756.5, 51.0, "H100 PCIe"),
    ("NVIDIA H800", 989.5, 67.0, "H800 SXM"),
    ("NVIDIA H800 PCIe", 756.5, 51.0, "H800 PCIe"),
    ("NVIDIA H200", 989.5, 67.0, "H200 SXM"),
    ("NVIDIA H200 NVL", 835.5, 60.0, "H200 NVL"),
    ("NVIDIA GH200 480GB", 989.5, 67.0, "GH200"),
    ("NVIDIA B200", 2250.0, 75.0, "HGX B200"),
    ("NVIDIA GB200", 2500.0, 80.0, "GB200 NVL72"),
    ("NVIDIA A100-SXM4-80GB", 312.0, 19.5, "A100"),
    ("NVIDIA A100 80GB PCIe", 312.0, 19.5, "A100"),
    ("NVIDIA A100-PCIE-40GB", 312.0, 19.5, "A100"),
    ("NVIDIA A10", 125.0, 31.2, "A10 data sheet"),
    ("NVIDIA A10G", 70.0, 31.2, "A10G"),
    ("NVIDIA L4", 121.0, 30.3, "L4 data sheet"),
    ("NVIDIA L40S", 362.05, 91.6, "L40S"),
    ("NVIDIA L40", 181.05, 90.5, "L40 data sheet"),
    ("NVIDIA GeForce RTX 4090", 165.2, 82.6, "Ada"),
    ("Tesla V100-SXM2-16GB", 125.0, 15.7, "V100 SXM2"),
    ("Tesla T4", 65.0, 8.1, "T4"),
])
def test_a_gpu_name_maps_to_its_dense_data_sheet_peak(name, bf16, fp32, source):
    """Names as torch.cuda.get_device_name gives them; the most specific entry wins ("H100 NVL" is not an H100
    SXM, "A10" is neither "A100" nor "A10G", "GB200" is not "B200"); every figure is dense (half the sparse one)."""
    peak, where = flops.gpu_peak_tflops(name, torch.bfloat16)
    assert peak == bf16 and source in where and name in where and "dense" in where
    assert flops.gpu_peak_tflops(name, torch.float16)[0] == bf16
    assert flops.gpu_peak_tflops(name, torch.float32)[0] == fp32  # TF32 off: torch's default
    entry = flops.gpu_peak(name)
    tf32 = flops.gpu_peak_tflops(name, torch.float32, tf32=True)[0]
    assert tf32 == (entry.tf32 if entry.tf32 is not None else fp32)


def test_every_table_entry_is_reachable_and_sourced():
    """No entry hides behind an earlier, less specific one, and each names its data sheet."""
    for entry in flops.GPU_PEAKS:
        name = " ".join(["NVIDIA", entry.model, *entry.variant])
        assert flops.gpu_peak(name) is entry, name
        assert entry.source and entry.bf16 > entry.fp32 > 0


def test_an_unknown_gpu_reports_no_mfu_unless_a_peak_is_given(fresh, monkeypatch):
    """A CUDA device missing from the table gets no measured peak (a small matmul would overstate MFU): the peak
    is None and the sentence says why and that train.peak_tflops sets it."""
    assert flops.gpu_peak_tflops("NVIDIA RTX PRO 6000 Blackwell", torch.bfloat16) is None
    assert flops.gpu_peak_tflops("NVIDIA H20", torch.bfloat16) is None  # not an H200, not an H100
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Some Future GPU")
    monkeypatch.setattr(flops, "measure_matmuls", lambda *a, **k: pytest.fail("a GPU peak was measured"))
    peak, source = flops.device_peak_flops(gpu, torch.bfloat16)
    assert peak is None and source.startswith("n/a: NVIDIA Some Future GPU") and "train.peak_tflops" in source
    assert flops.device_peak_flops(gpu, torch.bfloat16, override_tflops=400.0)[0] == 400e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert flops.device_peak_flops(gpu, torch.bfloat16) == (835.5e12, flops.gpu_peak_tflops("NVIDIA H100 NVL",
                                                                                              torch.bfloat16)[1])
    assert cached(fresh) == {}
