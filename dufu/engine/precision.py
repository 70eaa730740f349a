"""Which dtype a run computes in: ``train.amp.enabled`` = "auto" (the default), True, False, "bf16" or "fp16".

"auto" measures the device, it does not guess from its name: the throughput of a large matmul in fp32 and in the
low-precision dtype, timed in alternation at start-up (dufu.engine.reporting.flops; known GPUs answer from the data
sheet). A CPU without a bf16 matrix unit (no AMX, no AVX512-BF16: Intel Ice Lake and older) runs bf16 matmuls
at a quarter of fp32's speed, so bf16 autocast there makes a run several times slower; on AMX (Sapphire Rapids) bf16 is ~6x fp32, on Zen 4's
AVX512-BF16 ~2x, on Ampere and newer GPUs ~16x.

The rule: autocast to the low-precision dtype when its measured matmul throughput is at least ``MIN_SPEEDUP`` times
fp32's. The margin exists because autocast does not speed up everything: norms, softmax, the loss and the optimizer
stay in fp32 and the casts cost time, so a matmul only slightly faster in bf16 does not pay for them. The
low-precision dtype is bf16 where the device has it (the same range as fp32: no loss scaling), else fp16 with
dynamic loss scaling (CUDA GPUs before Ampere). An explicit choice is obeyed, with a one-line notice when the
measurement says it is the slow one.

Every rank of a run must compute in the same dtype, so rank 0 decides and the others receive its decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dufu.engine.reporting.flops import DtypeSpeeds, device_peak_flops, matmul_speeds

MIN_SPEEDUP = 1.25
SETTINGS = ("auto", True, False, "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class Precision:
    """``dtype``: the autocast dtype, None for fp32. ``peak_flops``/``peak_source``: the MFU basis, the measured
    (or data-sheet) peak of the dtype in use. ``peaks``: every measured peak, FLOP/s by dtype name."""

    dtype: torch.dtype | None
    reason: str
    peak_flops: float
    peak_source: str
    notice: str | None = None
    peaks: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.dtype is None:
            return "fp32"
        return f"{NAMES[self.dtype]} autocast" + (" with loss scaling" if self.dtype == torch.float16 else "")


def check_setting(enabled, dtype_name) -> None:
    """Raise ValueError with what to write instead, for a ``train.amp`` the trainer cannot run."""
    if enabled not in SETTINGS or isinstance(enabled, int) and not isinstance(enabled, bool):
        raise ValueError(
            f"train.amp.enabled = {enabled!r} is not a precision setting; use train.amp.enabled=auto (the faster of "
            "fp32 and bf16/fp16 autocast on this device, measured), true (autocast to train.amp.dtype), false (fp32), "
            "bf16 or fp16."
        )
    if dtype_name not in DTYPES:
        raise ValueError(f"train.amp.dtype = {dtype_name!r} is not supported; use one of {tuple(DTYPES)} "
                         "(e.g. train.amp.dtype=bf16).")


def low_precision_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device has it (every CPU: torch emulates it where there is no hardware; CUDA from Ampere),
    else fp16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def _gflops(flops: float) -> str:
    return f"{flops / 1e9:,.0f} GFLOP/s"


def choose_precision(enabled, dtype_name: str, device: torch.device, override_tflops: float | None = None,
                     speeds_fn=matmul_speeds, peak_fn=device_peak_flops) -> Precision:
    """The precision of a run on ``device`` for the setting ``enabled`` (see the module docstring).

    The decision reads matmul speeds measured now, fp32 and the low-precision dtype in alternation (0.8 s; a
    busy machine slows both alike, so their ratio holds where each alone would read low); the MFU basis is the
    best quiet reading cached for the dtype in use, else this start-up's reading labelled "measured under load:
    not cached". ``train.peak_tflops``
    (``override_tflops``) sets the MFU basis; with an explicit setting nothing is measured then (and there is no
    slow-choice notice). ``speeds_fn(device, dtypes) -> {dtype: FLOP/s}`` and ``peak_fn(device, dtype,
    override_tflops, remeasure) -> (FLOP/s, source)``: tests pass their own."""
    check_setting(enabled, dtype_name)
    low = DTYPES[dtype_name] if enabled is True else DTYPES.get(enabled) or low_precision_dtype(device)
    if enabled != "auto" and override_tflops is not None:
        dtype = low if enabled is not False else None
        peak, source = peak_fn(device, dtype or torch.float32, override_tflops, False)
        return Precision(dtype, f"train.amp.enabled={enabled!r}", peak, source)
    speeds = speeds_fn(device, (torch.float32, low))
    fp32_speed, low_speed = speeds[torch.float32], speeds[low]
    peaks = {"fp32": fp32_speed, NAMES[low]: low_speed}
    measured = (f"{NAMES[low]} matmul {_gflops(low_speed)} vs fp32 {_gflops(fp32_speed)}, "
                f"{low_speed / fp32_speed:.2f}x")
    if isinstance(speeds, DtypeSpeeds) and speeds.note:  # under load: one thread, by its CPU time
        measured += f" ({speeds.note})"
    fast = low_speed >= MIN_SPEEDUP * fp32_speed
    notice = None
    if enabled == "auto":
        dtype = low if fast else None
        reason = f"auto: {measured}; autocast pays from {MIN_SPEEDUP:g}x"
    else:
        dtype = low if enabled is not False else None
        reason = f"train.amp.enabled={enabled!r}; {measured}"
        if dtype is not None and not fast:
            notice = (f"{NAMES[low]} autocast is the slow choice on this device ({measured}); "
                      "train.amp.enabled=auto would train in fp32.")
        elif dtype is None and fast:
            notice = (f"fp32 is the slow choice on this device ({measured}); "
                      f"train.amp.enabled=auto would use {NAMES[low]} autocast.")
    peak, source = peak_fn(device, dtype or torch.float32, override_tflops, False)
    return Precision(dtype, reason, peak, source, notice, peaks)


def agree(precision: Precision | None, group=None) -> Precision:
    """Rank 0's decision on every rank (``precision`` is only needed on rank 0)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return precision
    box = [precision]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]
