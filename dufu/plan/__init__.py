"""``dufu plan``: predict per-rank peak memory and step time of a layout before running it, and choose layouts.

>>> from dufu.plan import estimate, search, get_hardware
>>> est = estimate(cfg, world_size=4, hardware="cpu")          # doctest: +SKIP
>>> est.memory_per_gpu_bytes, est.step_time_s, est.fits        # doctest: +SKIP
>>> best = search(cfg_with_auto_values, world_size=64, hardware="a100-80gb")[0]  # doctest: +SKIP

The model is built on the meta device and one training step is traced on fake tensors (:mod:`dufu.plan.shapes`);
memory replays dufu's mechanisms over it (:mod:`dufu.plan.memory`), time prices its ops and the layout's
communication on a device (:mod:`dufu.plan.timing`, :mod:`dufu.plan.comm`, :mod:`dufu.plan.hardware`).
docs/plan.md has the formulas, their sources and the check against published cluster results.
"""

from dufu.engine.schema import AUTO_KEYS
from dufu.plan.cpu import measured_cpu
from dufu.plan.hardware import CATALOG, Hardware, get_hardware
from dufu.plan.layout import Layout
from dufu.plan.search import Estimate, Plan, apply_layout, estimate, search

__all__ = ["AUTO_KEYS", "CATALOG", "Estimate", "Hardware", "Layout", "Plan", "apply_layout", "estimate",
           "get_hardware", "measured_cpu", "search"]
