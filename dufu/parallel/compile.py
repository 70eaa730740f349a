"""``torch.compile`` per transformer block: a persistent compile cache, a watch on recompiles, and the "auto" rule.

* :func:`apply_compile` compiles each transformer block in place (``nn.Module.compile``: parameter names and
  the module tree stay as they are, so checkpoints, FSDP and tensor parallelism see the same model). Blocks of
  one shape share one compiled graph: dynamo guards on the code and the tensors' properties, not on the module.
* :func:`use_compile_cache` points inductor's caches (FX graph cache, AOTAutograd cache, and on GPUs Triton's
  kernel cache, all under ``TORCHINDUCTOR_CACHE_DIR``) at ``<dufu cache dir>/inductor``, so a second run of the
  same model skips code generation and the C++/Triton compiler: the warm-up shrinks to dynamo's tracing.
* :class:`CompileWatch` counts compilations and their time, and names the guard that failed when something
  recompiles (a shape, dtype or Python value that changed between steps). A training run compiles each graph
  once; a recompile in the steady state costs another warm-up and, after ``torch._dynamo.config.recompile_limit``
  of them, silently falls back to eager code - so the watch reports every one (``on_recompile="warn"`` or
  ``"error"``).
* :func:`decide_compile` turns ``train.compile.enabled`` (True, False or "auto") into a decision and the sentence
  a run logs about it; "auto" compiles when the measured warm-up is paid back within the run (see
  ``benchmarks/compile.py`` and its results for the numbers behind :data:`CPU_MEASURED`). On CUDA it first checks
  what Triton needs to build kernels (:func:`compile_toolchain_problem`: triton, a C compiler, ``Python.h``):
  where one is missing "auto" runs eager and says why, and ``True`` is refused with how to fix it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch._functorch.config  # torch-private: its caches have no public switch
from torch import nn

from dufu.cache import resolve_cache_dir
from dufu.errors import ConfigError
from dufu.parallel.parallelize_utils import transformer_blocks


def compile_cache_dir() -> Path:
    """Where compiled code is kept between runs: ``<dufu cache dir>/inductor``."""
    return resolve_cache_dir() / "inductor"


def use_compile_cache(path: Optional[Path] = None) -> Path:
    """Keep inductor's compiled graphs in ``path`` (default :func:`compile_cache_dir`) and turn its persistent
    caches on; returns the directory in use. A ``TORCHINDUCTOR_CACHE_DIR`` the user set wins over dufu's."""
    # inductor (torch-private, no public API) takes about 1 s to import: only runs that compile pay it
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # inductor writes its own default into the variable once it has used it; only another value is the user's.
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        chosen = Path(current)
    else:
        chosen = Path(path) if path is not None else compile_cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(chosen)
    chosen.mkdir(parents=True, exist_ok=True)
    import torch._inductor.config  # as above

    torch._inductor.config.fx_graph_cache = True  # generated code, keyed by graph, inputs and config
    torch._functorch.config.enable_autograd_cache = True  # the forward/backward split, so AOT tracing is skipped
    return chosen


def apply_compile(model: nn.Module, *, cache_dir: Optional[Path] = None, cache: bool = True,
                  dynamic: Optional[bool] = None, fullgraph: bool = False) -> nn.Module:
    """Compile each transformer block of ``model`` in place (after tensor parallelism and activation
    checkpointing, before FSDP: see :mod:`dufu.parallel.parallelize`).

    ``cache``/``cache_dir``: the persistent compile cache (:func:`use_compile_cache`). ``dynamic``: as
    ``torch.compile``'s; the default (None) compiles for the shapes seen and generalises a dimension only after it
    has changed once, which a training run with fixed batch and sequence sizes never does. ``fullgraph=True``
    makes a graph break an error instead of a split into several graphs."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"torch.compile found no transformer block in {type(model).__name__}: dufu compiles the "
                         "entries of a ModuleDict/ModuleList that carry a layer_idx. Give the model's repeated "
                         "layers a layer_idx, or set train.compile.enabled=False")
    if cache:
        use_compile_cache(cache_dir)
    for _, block in blocks:
        block.compile(dynamic=dynamic, fullgraph=fullgraph)
    return model


# ------------------------------------------------------------------------------------------ recompiles


class RecompileError(RuntimeError):
    """A compiled block recompiled where a steady state was expected."""


@dataclass
class CompileWatch:
    """Count torch.compile's compilations (and the seconds they take) while installed; report recompiles.

    ``steady()`` marks the end of the warm-up (e.g. after the first training step): a compilation after it is a
    recompile, reported with the guard that failed (``on_recompile``: "warn" - a warning naming it; "error" -
    raise :class:`RecompileError` at the next :meth:`check`; None - only count). Use as a context manager or
    with :meth:`install` / :meth:`remove`, or as a hook of the training loop (``on_start``, ``after_optimizer``,
    ``on_end``): the warm-up ends after ``warmup_steps`` steps, and each later compilation is logged as one line
    with its reason (``on_recompile="error"`` raises instead) and counted in :attr:`recompile_count`.
    """

    on_recompile: Optional[str] = "warn"
    compiles: int = 0  # dynamo frame compilations and lazily compiled backward graphs
    seconds: float = 0.0  # wall time inside them
    warmup_compiles: Optional[int] = None  # compilations before steady() (None: still warming up)
    recompiles: list = field(default_factory=list)  # guard-failure reasons of compilations after steady()
    warmup_steps: int = 1  # as a hook: training steps whose compilations are the warm-up
    _started: Optional[float] = None
    _reasons_seen: dict = field(default_factory=dict)
    _reported: int = 0
    _steps: int = 0

    def __post_init__(self):
        if self.on_recompile not in ("warn", "error", None):
            raise ValueError(f"on_recompile={self.on_recompile!r}: use 'warn', 'error' or None")

    def install(self) -> "CompileWatch":
        from torch._dynamo.callback import callback_handler  # dynamo: ~1 s to import, when compiling only; private

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._reasons_seen = _guard_failure_snapshot()
        return self

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler  # dynamo: ~1 s to import, when compiling only; private

        for callbacks, fn in ((callback_handler.start_callbacks, self._start),
                              (callback_handler.end_callbacks, self._end)):
            if fn in callbacks:
                callbacks.remove(fn)

    def __enter__(self) -> "CompileWatch":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
        if exc[0] is None:
            self.check()

    # ---- as a hook of the training loop (dufu.engine.hooks: the points are looked up by name, so this package
    # does not import the engine). Install at the start, call the warm-up over after ``warmup_steps`` steps, log
    # each later compilation as one line with its reason, and remove the callbacks at the end.
    @property
    def recompile_count(self) -> int:
        """Compilations after the warm-up: the number a run's metrics record carries as ``recompiles``."""
        return len(self.recompiles)

    def on_start(self, trainer) -> None:
        self.install()

    def after_optimizer(self, trainer, loss: float, grad_norm: float) -> None:
        self._steps += 1
        if self.warmup_compiles is None:
            if self._steps >= self.warmup_steps:
                self.steady()
            return
        new = self.recompiles[self._reported:]
        self._reported = len(self.recompiles)
        for reason in new:
            one_line = " ".join(reason.split())
            trainer.log(f"step {trainer.step}: torch.compile recompiled ({one_line}); {self.recompile_count} "
                        f"recompile(s) since the warm-up, after torch._dynamo.config.recompile_limit="
                        f"{torch._dynamo.config.recompile_limit} the block runs eager")
        if new and self.on_recompile == "error":
            raise RecompileError(f"torch.compile recompiled after the warm-up: {' | '.join(new)}")

    def on_end(self, trainer, summary: dict) -> None:
        self.remove()

    def _start(self, args) -> None:
        self._started = time.perf_counter()

    def _end(self, args) -> None:
        self.compiles += 1
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        if self.warmup_compiles is not None:
            reasons = _guard_failures_since(self._reasons_seen)
            self._reasons_seen = _guard_failure_snapshot()
            self.recompiles.append("; ".join(reasons) or
                                   f"a new graph ({getattr(args, 'compile_id', '?')}): a new code path was reached")

    def steady(self) -> None:
        """The warm-up is over: from now on every compilation is a recompile."""
        self.warmup_compiles = self.compiles
        self._reasons_seen = _guard_failure_snapshot()

    def check(self) -> None:
        """Report the recompiles not reported yet (see ``on_recompile``)."""
        new = self.recompiles[self._reported:]
        self._reported = len(self.recompiles)
        if not new or self.on_recompile is None:
            return
        message = (f"torch.compile recompiled {len(new)} time(s) after the warm-up ({self.compiles} compilations, "
                   f"{self.seconds:.1f} s in all). Each recompile costs a warm-up, and after "
                   f"torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit} of them dynamo runs "
                   "the block uncompiled. Make the changing value fixed (batch or sequence size, dtype, a Python "
                   "flag) or mark the dimension dynamic. Reasons: " + " | ".join(new))
        if self.on_recompile == "error":
            raise RecompileError(message)
        warnings.warn(message, stacklevel=2)


def _guard_failure_snapshot() -> dict:
    """How many guard-failure reasons dynamo has recorded so far, per code object."""
    from torch._dynamo.guards import guard_failures  # dynamo: ~1 s to import, when compiling only; private

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _guard_failures_since(snapshot: dict) -> list[str]:
    """The guard-failure reasons recorded after ``snapshot`` (dynamo keeps them per code object)."""
    from torch._dynamo.guards import guard_failures  # dynamo: ~1 s to import, when compiling only; private

    return [str(r) for code, reasons in guard_failures.items() for r in reasons[snapshot.get(code, 0):]]


# ------------------------------------------------------------------------------------------ the GPU toolchain


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None  # found without importing it (~1 s)


def c_compiler() -> Optional[str]:
    """The C compiler Triton would build its kernel launchers with, or None: ``$CC``, else gcc, else clang, the
    order of ``triton.runtime.build`` (triton 3.x). Looked up here, not by importing triton, so the check costs
    nothing and runs where triton is missing too."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) and os.access(cc, os.X_OK) else None)
    return shutil.which("gcc") or shutil.which("clang")


def python_include_dir() -> Path:
    """Where Triton looks for ``Python.h``: the include path of sysconfig's default scheme (Debian's
    ``posix_local`` read as ``posix_prefix``, as ``triton.runtime.build`` does)."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def compile_toolchain_problem() -> Optional[str]:
    """What torch.compile lacks to build CUDA kernels on this machine, or None when nothing is missing.

    Inductor writes Triton kernels, and Triton compiles a small C launcher for each with the system's C compiler
    and Python's headers: without them the first compiled step fails deep inside a worker. Checked at start-up
    on CUDA only (on a CPU inductor's C++ path has its own errors; this machine has no GPU to verify more)."""
    missing = []
    if not _triton_installed():
        missing.append("triton is not installed (CUDA builds of torch depend on it: pip install triton)")
    cc = c_compiler()
    if cc is None:
        named = f"CC={os.environ['CC']} is not an executable, " if os.environ.get("CC") else ""
        missing.append(f"no C compiler ({named}no gcc or clang on PATH; Triton builds its kernel launchers with one:"
                       " install gcc, e.g. apt-get install gcc, or set CC)")
    include = python_include_dir()
    if not (include / "Python.h").is_file():
        missing.append(f"no Python.h in {include} (Triton's launchers include Python's headers: install them, "
                       f"e.g. apt-get install python{sysconfig.get_python_version()}-dev or python3-dev)")
    return "; ".join(missing) or None


# ------------------------------------------------------------------------------------------ "auto"

SETTINGS = (True, False, "auto")


@dataclass(frozen=True)
class CompileMeasurement:
    """Compiled vs eager training steps of one model, as ``benchmarks/compile.py`` measures them."""

    what: str  # model, dtype, machine and where the numbers are written down
    speedup: float  # eager steady step time / compiled steady step time (above 1: compiled is faster)
    warm_s: float  # extra seconds of the first steps when the compile cache has the graphs (every later run)
    cold_s: float  # ... when it is empty (the first run of a model on a machine)


# Measured on a 2-core AMD EPYC (Zen 4, AVX512-BF16, no AMX) CPU, torch 2.13, one thread per process, with other
# jobs on the machine (benchmarks/results/compile-2026-11-25.md). Keyed by the autocast dtype (None: fp32); a
# dtype without an entry has no measurement, and "auto" does not compile it on a CPU.
CPU_MEASURED: dict = {
    None: CompileMeasurement("gpt_debug training steps, benchmarks/results/compile-2026-11-25.md",
                             speedup=0.96, warm_s=11, cold_s=86),
}

# Compile only for a clear gain: smaller differences are within run-to-run noise on a CPU.
MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class CompileDecision:
    """Whether a run compiles its blocks, the sentence its start-up summary shows, and a notice for a setting
    that the measurements say is the slower one."""

    enabled: bool
    reason: str
    notice: Optional[str] = None


def check_compile_setting(enabled) -> None:
    """Raise ValueError saying what to write, for a ``train.compile.enabled`` that is not True, False or "auto"."""
    if not any(enabled is s or (isinstance(enabled, str) and enabled == s) for s in SETTINGS):
        raise ValueError(f"train.compile.enabled = {enabled!r} is not a compile setting; use true (compile each "
                         "transformer block), false (eager) or auto (compile where it measured faster, warm-up "
                         "included: dufu.parallel.compile.decide_compile).")


def decide_compile(enabled, device: torch.device, *, train_iter: int, amp_dtype: Optional[torch.dtype] = None,
                   step_seconds: Optional[float] = None, measured: Optional[dict] = None) -> CompileDecision:
    """Turn ``train.compile.enabled`` into a decision for a run of ``train_iter`` steps on ``device``.

    True and False are obeyed (with a notice when the measurements say compiling is the slower choice).
    "auto" on a CPU compiles when the measured steady speed-up for the dtype (``measured``, default
    :data:`CPU_MEASURED`) is at least :data:`MIN_SPEEDUP` and, given ``step_seconds`` (an estimate of one eager
    step), when the run saves more than the first compilation costs: ``train_iter * step_seconds * (1 - 1 /
    speedup) > cold_s``. On other devices "auto" compiles: inductor's fused GPU kernels are what torch.compile is
    built for, but dufu's machines have no GPU to measure it, so the summary says so.

    On CUDA, unless compile is off, the toolchain Triton needs is checked first
    (:func:`compile_toolchain_problem`): where something is missing, "auto" runs eager with a notice saying what
    and how to install it, and True is refused (:class:`~dufu.errors.ConfigError`) with the same and how to run
    without compiling."""
    check_compile_setting(enabled)
    if device.type == "cuda" and enabled is not False:
        problem = compile_toolchain_problem()
        if problem is not None and enabled is True:
            raise ConfigError(f"train.compile.enabled=true, but torch.compile cannot build CUDA kernels on this "
                              f"machine: {problem}. Install what is missing, or set train.compile.enabled=false "
                              "(eager; auto also runs eager here and says why).")
        if problem is not None:
            return CompileDecision(False, f"off (auto): torch.compile cannot build CUDA kernels here ({problem})",
                                   notice=f"torch.compile is off, the run is eager: {problem}. Install what is "
                                          "missing to compile (train.compile.enabled=false silences this notice).")
    table = CPU_MEASURED if measured is None else measured
    m = table.get(amp_dtype) if device.type == "cpu" else None
    dtype_name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype, str(amp_dtype))
    if m is not None:
        verdict = (f"compiled steps measured {m.speedup:.2f}x as fast as eager in {dtype_name} on a CPU ({m.what}); "
                   f"the compile warm-up took {m.warm_s:.0f} s with a filled cache, {m.cold_s:.0f} s without")
        faster = m.speedup >= MIN_SPEEDUP
    if enabled is not True and enabled is not False:  # "auto"
        if device.type != "cpu":
            return CompileDecision(True, f"on (auto; {device.type}: compiled kernels are the usual gain on "
                                         "accelerators, not measured by dufu; train.compile.enabled=false skips "
                                         "the warm-up)")
        if m is None:
            return CompileDecision(False, f"off (auto): compiled {dtype_name} steps have not measured faster on a "
                                          "CPU (benchmarks/compile.py); train.compile.enabled=true compiles")
        if not faster:
            return CompileDecision(False, f"off (auto): {verdict}; compiling would add its warm-up and save "
                                          "nothing (train.compile.enabled=true compiles anyway)")
        if step_seconds is not None:
            saved = train_iter * step_seconds * (1 - 1 / m.speedup)
            if saved <= m.cold_s:
                return CompileDecision(False, f"off (auto): {verdict}; {train_iter} steps of ~{step_seconds:.2g} "
                                              f"s would save ~{saved:.0f} s, less than the first compilation")
        return CompileDecision(True, f"on (auto): {verdict}")
    if m is not None and enabled is True and not faster:
        return CompileDecision(True, "on (train.compile.enabled=true)",
                               notice=f"compiling is the slow choice here: {verdict}; train.compile.enabled=auto "
                                      "would run eager")
    word = "on" if enabled else "off"
    return CompileDecision(bool(enabled), f"{word} (train.compile.enabled={str(enabled).lower()})")
