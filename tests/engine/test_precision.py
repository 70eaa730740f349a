"""train.amp.enabled: "auto" picks the faster dtype from measured matmul peaks; explicit choices are obeyed, with a
notice when they are the slow one; MFU is measured against the peak of the dtype in use."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dufu.config.overrides import apply_overrides
from dufu.engine.precision import MIN_SPEEDUP, choose_precision
from dufu.errors import ConfigError
from dufu_testing import FAST, load_config, train

# Measured matmul peaks (GFLOP/s, 2 threads) of the CPUs dufu has run on.
ICE_LAKE = {torch.float32: 262.0, torch.bfloat16: 61.0}  # AVX-512, no bf16 hardware
ZEN_4 = {torch.float32: 200.0, torch.bfloat16: 430.0}  # AVX512-BF16
SAPPHIRE_RAPIDS = {torch.float32: 350.0, torch.bfloat16: 2000.0}  # AMX
CPU = torch.device("cpu")


class FakePeaks:
    """A device whose matmul speeds are ``table`` (GFLOP/s): ``speeds`` answers the start-up measurement,
    ``peak`` the MFU basis (the cached best); records what was asked."""

    def __init__(self, table):
        self.table, self.measured, self.peaks = table, [], []

    def speeds(self, device, dtypes):
        self.measured.append(tuple(dtypes))
        return {dtype: self.table[dtype] * 1e9 for dtype in dtypes}

    def peak(self, device, dtype, override_tflops=None, remeasure=True):
        self.peaks.append(dtype)
        if override_tflops is not None:
            return override_tflops * 1e12, "given"
        return self.table[dtype] * 1e9, f"measured {dtype}"


def choose(enabled, dtype_name, device, fake, override_tflops=None):
    return choose_precision(enabled, dtype_name, device, override_tflops, speeds_fn=fake.speeds, peak_fn=fake.peak)


@pytest.mark.parametrize("cpu, expected", [(ICE_LAKE, None), (ZEN_4, torch.bfloat16),
                                           (SAPPHIRE_RAPIDS, torch.bfloat16)])
def test_auto_picks_the_dtype_whose_matmul_is_faster(cpu, expected):
    fake = FakePeaks(cpu)
    p = choose("auto", "bf16", CPU, fake)
    assert p.dtype == expected and p.notice is None
    assert p.reason.startswith("auto: bf16 matmul") and f"{cpu[torch.bfloat16]:,.0f} GFLOP/s" in p.reason
    assert fake.measured == [(torch.float32, torch.bfloat16)]  # both measured together (in alternation)
    # MFU against the peak of the dtype in use
    used = expected or torch.float32
    assert p.peak_flops == cpu[used] * 1e9 and fake.peaks == [used]
    assert p.peaks == {"fp32": cpu[torch.float32] * 1e9, "bf16": cpu[torch.bfloat16] * 1e9}
    assert p.name == ("bf16 autocast" if expected else "fp32")


def test_auto_needs_a_real_speedup_not_a_tie():
    just_below = {torch.float32: 100.0, torch.bfloat16: 100.0 * MIN_SPEEDUP - 1}
    assert choose("auto", "bf16", CPU, FakePeaks(just_below)).dtype is None
    at = {torch.float32: 100.0, torch.bfloat16: 100.0 * MIN_SPEEDUP}
    assert choose("auto", "bf16", CPU, FakePeaks(at)).dtype == torch.bfloat16


def test_explicit_choices_are_obeyed_with_a_notice_when_slow():
    slow = choose(True, "bf16", CPU, FakePeaks(ICE_LAKE))
    assert slow.dtype == torch.bfloat16 and slow.peak_flops == 61e9
    assert "bf16 autocast is the slow choice" in slow.notice and "auto would train in fp32" in slow.notice
    assert choose("bf16", "fp16", CPU, FakePeaks(ICE_LAKE)).dtype == torch.bfloat16

    fp32 = choose(False, "bf16", CPU, FakePeaks(ZEN_4))
    assert fp32.dtype is None and fp32.peak_flops == 200e9
    assert "fp32 is the slow choice" in fp32.notice and "auto would use bf16" in fp32.notice

    fast = choose(True, "bf16", CPU, FakePeaks(SAPPHIRE_RAPIDS))
    assert fast.dtype == torch.bfloat16 and fast.notice is None
    assert choose(False, "bf16", CPU, FakePeaks(ICE_LAKE)).notice is None


def test_fp16_with_loss_scaling_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    volta = FakePeaks({torch.float32: 15_700.0, torch.float16: 125_000.0})
    p = choose("auto", "bf16", torch.device("cuda"), volta)
    assert p.dtype == torch.float16 and p.name == "fp16 autocast with loss scaling"
    assert p.reason.startswith("auto: fp16 matmul")


def test_a_given_peak_skips_measuring_for_explicit_settings_only():
    fake = FakePeaks(ZEN_4)
    p = choose(False, "bf16", CPU, fake, override_tflops=1.0)
    assert p.dtype is None and p.peak_flops == 1e12 and p.notice is None
    assert fake.measured == []  # the override answers; nothing is measured
    fake = FakePeaks(ZEN_4)
    p = choose("auto", "bf16", CPU, fake, override_tflops=1.0)
    assert p.dtype == torch.bfloat16 and p.peak_flops == 1e12  # decided by measurement, MFU basis as given


def test_the_start_up_measurement_alternates_the_dtypes_and_records_the_best(monkeypatch, tmp_path):
    from dufu.engine.reporting import flops

    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DUFU_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(flops, "_UNCACHED", {})
    speeds = flops.matmul_speeds(CPU, (torch.float32, torch.bfloat16), size=256, seconds=0.05)
    assert set(speeds) == {torch.float32, torch.bfloat16} and all(v > 0 for v in speeds.values())
    for dtype in speeds:  # recorded: a quiet reading in the cache, one under load for this run only, labelled
        peak, source = flops.device_peak_flops(CPU, dtype, remeasure=False)
        assert peak > 0 and ("best quiet" in source or "measured under load: not cached" in source)


@pytest.mark.parametrize("override, value", [("train.amp.enabled=auto", "auto"), ("train.amp.enabled=bf16", "bf16"),
                                             ("train.amp.enabled=true", True), ("train.amp.enabled=false", False)])
def test_the_setting_takes_a_bool_or_a_word_on_the_command_line(override, value):
    for start in ("gpt_debug", "gpt2_small"):  # fp32 recipe (False) and default ("auto")
        cfg = load_config(start)
        apply_overrides(cfg, [override])
        assert cfg.train.amp.enabled == value and type(cfg.train.amp.enabled) is type(value)


def test_unknown_settings_are_refused_with_the_choices():
    from dufu.engine.validate import validate_config

    cfg = load_config("gpt_debug")
    apply_overrides(cfg, ["train.amp.enabled=bf17"])
    with pytest.raises(ConfigError, match="train.amp.enabled = 'bf17' is not a precision setting.*auto"):
        validate_config(cfg)
    cfg = load_config("gpt_debug", ["train.amp.enabled=True", "train.amp.dtype=fp8"])
    with pytest.raises(ConfigError, match="train.amp.dtype = 'fp8' is not supported"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="expects a str"):  # 1 is neither a switch nor a word
        apply_overrides(load_config("gpt2_small"), ["train.amp.enabled=1"])


def test_recipes_default_to_auto_and_debug_recipes_to_fp32():
    assert load_config("default").train.amp.enabled == "auto"
    assert load_config("gpt2_small").train.amp.enabled == "auto"
    assert load_config("gpt_debug").train.amp.enabled is False  # the parity tests' fp32 numbers


def test_a_run_on_auto_says_which_dtype_and_why(tmp_path):
    run = train(tmp_path / "auto", ["train.amp.enabled=auto", "train.train_iter=2", "train.checkpointer.period=0"])
    p = run.trainer.runtime.precision
    out = "\n".join(run.log)
    assert f"precision    {p.name}: auto: bf16 matmul" in out
    assert run.trainer.runtime.amp_dtype == p.dtype and p.peak_flops == 1e12  # train.peak_tflops=1.0 is the MFU basis
    # the decision follows the measured (cached) peaks of this machine
    assert (p.dtype == torch.bfloat16) == (p.peaks["bf16"] >= MIN_SPEEDUP * p.peaks["fp32"])


class CountCasts(TorchDispatchMode):
    """Counts the casts to bf16 that reach the kernels."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.casts += 1
        return func(*args, **kwargs)


def test_weights_are_cast_once_per_step_not_per_micro_batch(tmp_path):
    from dufu.engine.trainer import Trainer

    def step(cache: bool):
        cfg = load_config("gpt_debug", [*FAST, "train.amp.enabled=bf16", "train.train_micro_batch_size=2",
                                        "train.global_batch_size=8", f"train.amp.cache_weight_casts={cache}",
                                        f"train.output_dir={tmp_path / str(cache)}"])
        trainer = Trainer(cfg, log=lambda *a: None)
        trainer._begin()
        counter = CountCasts()
        with counter:
            loss, _ = trainer.train_step()
        weights = sum(1 for p in trainer.model.parameters() if p.ndim == 2)
        return loss, counter.casts, weights

    cached_loss, cached, weights = step(True)
    loss, uncached, _ = step(False)
    assert cached_loss == loss  # the same bf16 copies, reused: bit for bit the same step
    # 4 micro-batches: the uncached step casts every matmul weight in each forward, the cached one once
    assert uncached - cached >= 3 * (weights - 1), (uncached, cached, weights)
