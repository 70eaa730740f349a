"""The devices ``dufu plan`` knows: published figures for GPUs, measured ones for this machine's CPU.

The published figures a prediction rests on are here, in one table, each with its source. The few model
constants of a GPU (how close kernels come to those peaks, what overlaps, latencies) are not published figures:
:data:`GPU_CONSTANTS` holds them, fitted by ``benchmarks/plan_fit.py`` to a named subset of published training
results and checked on results the fit did not use (``docs/plan.md``).

=============  ===============  ========  ==========  ======================  ===================================
name           dense bf16/fp16  memory    HBM         NVLink per GPU          inter-node per GPU
=============  ===============  ========  ==========  ======================  ===================================
a100-40gb      312 TFLOP/s      40 GB     1,555 GB/s  300 GB/s (600 both      25 GB/s (DGX A100: 8 x 200 Gb/s
                                                      directions, NVLink 3)    HDR InfiniBand per node)
a100-80gb      312 TFLOP/s      80 GB     2,039 GB/s  300 GB/s                25 GB/s
h100-80gb      989 TFLOP/s      80 GB     3,350 GB/s  450 GB/s (900 both      50 GB/s (DGX H100: 8 x 400 Gb/s
(SXM)                                                 directions, NVLink 4)    NDR InfiniBand per node)
h200           989 TFLOP/s      141 GB    4,800 GB/s  450 GB/s                50 GB/s (DGX H200, as DGX H100)
=============  ===============  ========  ==========  ======================  ===================================

Sources: NVIDIA A100 Tensor Core GPU data sheet (2020/2021; SXM4 figures), NVIDIA DGX A100 data sheet (8 single-
port ConnectX-6 200 Gb/s HDR InfiniBand for the cluster network), NVIDIA H100 Tensor Core GPU data sheet (SXM5; the
data sheet's 1,979 TFLOP/s bf16 is with 2:4 sparsity, dense is half), NVIDIA DGX H100 data sheet (8 x ConnectX-7
400 Gb/s), NVIDIA H200 Tensor Core GPU data sheet (SXM). fp32 peaks are the non-tensor-core figures (19.5 and 67
TFLOP/s): dufu does not turn on TF32.

``cpu`` is this machine, measured, not looked up (:mod:`dufu.plan.cpu`; about five seconds, once; cached in dufu's
cache directory, ``plan_hardware.json``, per CPU model, core count and torch version; ``dufu plan --remeasure``
measures again and keeps the better of each figure):

* matmul throughput of one thread at a few shapes, fp32 and bf16, and of all cores for a large square (the figure
  :func:`dufu.engine.reporting.flops.device_peak_flops` keeps as the best seen);
* elementwise ops: simple ones (add, mul) and ones with transcendentals (GELU, layer norm, softmax and their
  backward), which on a CPU run far below memory bandwidth; fused attention as a fraction of the matmul rate;
  fused AdamW; a large copy (memory bandwidth);
* the host time of one autograd op (dispatch, not data);
* gloo's all-reduce latency and bandwidth between two processes, and what memory new from the system costs;
* a real forward + backward of a small GPT, which calibrates what per-op pricing leaves out.

Adding a device: a YAML or JSON file mapping names to fields (units in the field names), e.g.::

    my-gpu:
      description: my accelerator
      bf16_tflops: 400          # dense peak
      fp32_tflops: 50
      memory_gb: 96
      memory_bandwidth_gbs: 3000
      intra_node_bandwidth_gbs: 400   # per device, one direction
      inter_node_bandwidth_gbs: 50
      devices_per_node: 8

passed with ``dufu plan --hardware-file FILE`` or listed in ``$DUFU_HARDWARE`` (paths separated by ``:``); or
``get_hardware({...})`` / a :class:`Hardware` in Python. Omitted model constants take :data:`GPU_CONSTANTS`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Optional, Union

import yaml

from dufu.errors import ConfigError
from dufu.plan.cpu import measured_cpu
from dufu.plan.device import GB, TFLOPS, Hardware


# The GPU time model's constants (not published figures; see Hardware): fitted by benchmarks/plan_fit.py to a named
# subset of published training results (every other row of Table 1 of Narayanan et al. 2021) and checked on the
# rest; results: benchmarks/results/plan_fit-<date>.md. tests/plan/test_plan_heldout.py checks that the fit
# reproduces these values. Every GPU of the catalog and every user device takes them unless its file sets its own.
GPU_CONSTANTS: dict = {
    "gemm_efficiency": 0.936,
    "gemm_half_size": 266.0,
    "attention_efficiency": 0.45,
    "memory_efficiency": 0.934,
    "comm_efficiency": 0.808,
    "overlap": 0.807,
    "op_overhead_s": 6.01e-06,
    "intra_latency_s": 1.93e-06,
    "inter_latency_s": 6.09e-06,
}


def _gpu(name, description, bf16, fp32, memory_gb, hbm_gbs, nvlink_gbs, ib_gbs, source) -> Hardware:
    return Hardware(name=name, description=description, peak_flops={"bf16": bf16 * TFLOPS, "fp16": bf16 * TFLOPS,
                                                                     "fp32": fp32 * TFLOPS},
                    memory_bytes=memory_gb * GB, memory_bandwidth=hbm_gbs * GB,
                    intra_node_bandwidth=nvlink_gbs * GB, inter_node_bandwidth=ib_gbs * GB, source=source,
                    **GPU_CONSTANTS)


CATALOG: dict[str, Hardware] = {
    h.name: h for h in (
        _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB in a DGX A100 (8 per node)", 312, 19.5, 40, 1555, 300, 25,
             "NVIDIA A100 data sheet; DGX A100 data sheet (8 x 200 Gb/s HDR InfiniBand per node)"),
        _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB in a DGX A100 (8 per node)", 312, 19.5, 80, 2039, 300, 25,
             "NVIDIA A100 data sheet; DGX A100 data sheet (8 x 200 Gb/s HDR InfiniBand per node)"),
        _gpu("h100-80gb", "NVIDIA H100 SXM5 80GB in a DGX H100 (8 per node)", 989, 67, 80, 3350, 450, 50,
             "NVIDIA H100 data sheet (dense = half the 2:4-sparse figure); DGX H100 data sheet (8 x 400 Gb/s)"),
        _gpu("h200", "NVIDIA H200 SXM 141GB in a DGX H200 (8 per node)", 989, 67, 141, 4800, 450, 50,
             "NVIDIA H200 data sheet; DGX H200 data sheet (8 x 400 Gb/s)"),
    )
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200"}

# Field names of a hardware file, in the units people write them in.
_FILE_UNITS = {
    "bf16_tflops": ("peak_flops", "bf16", TFLOPS), "fp16_tflops": ("peak_flops", "fp16", TFLOPS),
    "fp32_tflops": ("peak_flops", "fp32", TFLOPS), "memory_gb": ("memory_bytes", None, GB),
    "memory_bandwidth_gbs": ("memory_bandwidth", None, GB),
    "intra_node_bandwidth_gbs": ("intra_node_bandwidth", None, GB),
    "inter_node_bandwidth_gbs": ("inter_node_bandwidth", None, GB),
    "reserved_gb": ("reserved_bytes", None, GB),
}


def hardware_from_dict(name: str, entry: dict, origin: str = "") -> Hardware:
    """A :class:`Hardware` from a file entry (units in the field names, see the module docstring)."""
    kwargs: dict = {**GPU_CONSTANTS, "name": name, "description": entry.get("description", name), "peak_flops": {},
                    "source": entry.get("source", origin)}
    known = {f for f in Hardware.__dataclass_fields__}
    for key, value in entry.items():
        if key in ("description", "source"):
            continue
        if key in _FILE_UNITS:
            target, sub, unit = _FILE_UNITS[key]
            if sub:
                kwargs["peak_flops"][sub] = float(value) * unit
            else:
                kwargs[target] = float(value) * unit
        elif key in known and key not in ("name",):
            kwargs[key] = value
        else:
            raise ConfigError(
                f"hardware {name!r}{f' in {origin}' if origin else ''}: unknown field {key!r}. Fields: "
                f"{', '.join(sorted(set(_FILE_UNITS) | known - {'name', 'peak_flops'}))}."
            )
    if "bf16" in kwargs["peak_flops"] and "fp16" not in kwargs["peak_flops"]:
        kwargs["peak_flops"]["fp16"] = kwargs["peak_flops"]["bf16"]
    missing = [k for k in ("memory_bytes", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth")
               if k not in kwargs]
    if not kwargs["peak_flops"]:
        missing.insert(0, "bf16_tflops")
    if missing:
        names = {v[0]: k for k, v in _FILE_UNITS.items() if v[1] is None}
        raise ConfigError(
            f"hardware {name!r}{f' in {origin}' if origin else ''} lacks {', '.join(names.get(m, m) for m in missing)}; "
            "give its published figures (see dufu/plan/hardware.py for the fields)."
        )
    return Hardware(**kwargs)


def load_hardware_file(path: Union[str, Path]) -> dict[str, Hardware]:
    """The devices a YAML or JSON hardware file defines."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the hardware file {path}: {e.strerror}. Check the path.") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except ValueError as e:
        raise ConfigError(f"the hardware file {path} is not valid {path.suffix[1:] or 'YAML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the hardware file {path} must map device names to their figures, e.g. "
                          "`my-gpu: {bf16_tflops: 400, memory_gb: 96, ...}`.")
    return {str(k).lower(): hardware_from_dict(str(k).lower(), v or {}, str(path)) for k, v in data.items()}


def user_hardware(files: Optional[list] = None) -> dict[str, Hardware]:
    """Devices from ``files`` and from ``$DUFU_HARDWARE`` (paths separated by os.pathsep)."""
    paths = list(files or [])
    env = os.environ.get("DUFU_HARDWARE")
    if env:
        paths += [p for p in env.split(os.pathsep) if p]
    found: dict[str, Hardware] = {}
    for p in paths:
        found.update(load_hardware_file(p))
    return found


def known_names(files: Optional[list] = None) -> list[str]:
    return sorted(set(CATALOG) | {"cpu"} | set(user_hardware(files)))


def get_hardware(spec: Union[str, Hardware, dict, None] = "cpu", files: Optional[list] = None,
                 remeasure: bool = False) -> Hardware:
    """A device by name (the catalog, ``cpu``, or a user file's entry), a dict of figures, or a Hardware."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, dict):
        return hardware_from_dict(spec.get("name", "custom"), {k: v for k, v in spec.items() if k != "name"})
    name = (spec or "cpu").strip().lower()
    name = ALIASES.get(name, name)
    users = user_hardware(files)
    if name in users:
        return users[name]
    if name == "cpu":
        return measured_cpu(remeasure=remeasure)
    if name in CATALOG:
        return CATALOG[name]
    names = known_names(files)
    close = difflib.get_close_matches(name, names, n=1)
    raise ConfigError(
        f"unknown --gpu {spec!r}{f'; did you mean {close[0]!r}?' if close else '.'} Known devices: "
        f"{', '.join(names)}. Add your own with --hardware-file FILE (YAML/JSON, see docs/plan.md)."
    )
