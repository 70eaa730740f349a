"""Helpers shared by the dufu tests (imported by test modules; the fixtures are in conftest.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dufu.environment import environment  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parent.parent


def load_benchmark(script: str):
    """``benchmarks/<script>.py`` as a module (importing one runs nothing), imported as ``python
    benchmarks/<script>.py`` runs it: the script's folder first on the path (benchmarks/harness and its sibling
    modules), and the module in ``sys.modules`` while it executes (dataclasses look their module up then)."""
    import pytest

    spec = importlib.util.spec_from_file_location(f"bench_{script}", REPO / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        mp.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
    return module


def benchmark_result(directory, pattern: str) -> tuple[Path, dict]:
    """The one result a benchmark run wrote into ``directory``: its table (the single ``pattern`` .md file there)
    and the data of the .json beside it."""
    (md,) = Path(directory).glob(pattern)
    return md, json.loads(md.with_suffix(".json").read_text())

# Overrides that make a gpt_debug run cheap without changing what it computes: no TensorBoard, no
# evaluation, no generation, and a given peak FLOP/s instead of a measured one (MFU is still logged).
FAST = (
    "train.tensorboard=False",
    "train.evaluation.enabled=False",
    "train.generation.enabled=False",
    "train.peak_tflops=1.0",
    "train.log_period=1",
    "train.plan_memory=False",
)

# The session's reference run (fixture `debug_run`). Evaluation, TensorBoard and generation are on, so
# one run exercises every output file; the peak FLOP/s is measured (and cached in the session cache).
DEBUG_RUN_OVERRIDES = (
    "train.train_iter=10",
    "train.log_period=1",
    "train.checkpointer.period=5",
    "train.checkpointer.max_to_keep=3",
    "train.tensorboard=True",
    "train.evaluation.enabled=True",
    "train.evaluation.eval_period=5",
    "train.evaluation.eval_iter=2",
    "train.generation.enabled=True",
    "train.generation.max_new_tokens=8",
    "train.generation.prompts=['The ']",
)


def load_config(recipe: str = "gpt_debug", overrides=()):
    from dufu.config import LazyConfig, resolve_config_path

    cfg = LazyConfig.load(resolve_config_path(recipe))
    return LazyConfig.apply_overrides(cfg, list(overrides))


def read_records(output_dir) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(output_dir) -> dict[int, float]:
    """{step: training loss} from a run's metrics.jsonl; a step logged twice is an error."""
    losses = {}
    for r in read_records(output_dir):
        if "loss" in r:
            assert r["step"] not in losses, f"step {r['step']} logged twice in {output_dir}/metrics.jsonl"
            losses[r["step"]] = r["loss"]
    return losses


@dataclass
class Run:
    """A finished in-process training run."""

    output_dir: Path
    overrides: list[str]
    trainer: object = None
    summary: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def records(self) -> list[dict]:
        return read_records(self.output_dir)

    @property
    def losses(self) -> dict[int, float]:
        return train_losses(self.output_dir)


def train_config(cfg, output_dir, resume: bool = False) -> Run:
    """Train an already loaded config in this process (``train.output_dir`` is set to ``output_dir``)."""
    from dufu.config import LazyConfig
    from dufu.engine.trainer import Trainer

    LazyConfig.apply_overrides(cfg, [f"train.output_dir={output_dir}"])
    log: list[str] = []
    trainer = Trainer(cfg, resume=resume, log=log.append)
    summary = trainer.train()
    return Run(Path(output_dir), [], trainer, summary, log)


def train(output_dir, overrides=(), recipe: str = "gpt_debug", resume: bool = False, fast: bool = True) -> Run:
    """Train ``recipe`` in this process into ``output_dir``; ``overrides`` come after the FAST ones."""
    overrides = [*(FAST if fast else ()), *overrides]
    run = train_config(load_config(recipe, overrides), output_dir, resume=resume)
    run.overrides = overrides
    return run


def snapshot(directory) -> dict:
    """Every file and directory under ``directory`` with size, mtime and SHA-256 (to prove nothing changed)."""
    root = Path(directory)
    state = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            state[rel] = "dir"
        else:
            st = p.stat()
            state[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return state


def count_gpt_parameters(vocab: int, hidden: int, layers: int, positions: int, ffn: int | None = None,
                         tied: bool = True) -> int:
    """GPT-2's parameter count from its shapes (biases everywhere but the head; head tied or not)."""
    ffn = ffn or 4 * hidden
    per_layer = (
        2 * hidden  # ln1 weight + bias
        + 4 * (hidden * hidden + hidden)  # q, k, v, out projections with bias
        + 2 * hidden  # ln2
        + hidden * ffn + ffn  # fc1
        + ffn * hidden + hidden  # fc2
    )
    total = vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden  # + ln_f
    return total if tied else total + vocab * hidden
