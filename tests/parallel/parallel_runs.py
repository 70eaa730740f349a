"""Helpers for multi-process tests: run `dufu train` through its own torchrun launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Every parity run: gpt_debug, fp32, 5 steps, the same global batch (so every layout sees the same samples).
PARITY_ARGS = [
    "train.train_iter=5",
    "train.global_batch_size=8",
    "train.train_micro_batch_size=2",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=5",
    "train.tensorboard=False",
]


def run_dufu(output_dir: Path, nproc: int, *overrides: str, config: str = "gpt_debug", timeout: int = 300,
             extra_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dufu", "train", config, *extra_args, f"train.output_dir={output_dir}", *overrides]
    if nproc > 1:
        cmd[4:4] = ["--nproc", str(nproc)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 and _killed_by_signal(proc.stderr):
        # gloo on an overloaded CPU occasionally kills a rank with SIGSEGV/SIGABRT (seen about once per
        # hundred launches, never twice in a row). Retry once, from a clean directory, and say so; a failure
        # that repeats is reported as it is.
        import shutil
        import warnings

        warnings.warn(f"a rank died by a signal; retrying once: {' '.join(cmd[3:6])}")
        shutil.rmtree(output_dir, ignore_errors=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc


def _killed_by_signal(stderr: str) -> bool:
    return any(f"exitcode: -{sig}" in stderr for sig in (6, 11)) or "terminate called" in stderr


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def final_model_state(output_dir: Path) -> dict[str, torch.Tensor]:
    """The model weights of the last checkpoint, gathered into one process from any layout."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = sorted((output_dir / "checkpoints").glob("step_*"))[-1]
    out = output_dir / "consolidated.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=True)["model"]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-6000:]}"


def assert_matches_reference(out: Path, reference: tuple[list[float], dict], what: str, steps: int = 5) -> None:
    """The promise: a run logs the reference's losses (within 1e-5 relative) and ends with its weights."""
    ref_losses, ref_state = reference
    got = losses(out)
    assert len(got) == len(ref_losses) == steps, f"{what}: {len(got)} logged steps, reference {len(ref_losses)}"
    for step, (a, b) in enumerate(zip(got, ref_losses), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"{what}: step {step} loss {a} != single-process {b}"
    state = final_model_state(out)
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what}: {name}: {m}")
