"""Metrics for people and for machines: progress bar, metrics.jsonl, TensorBoard, a loss-curve PNG.

Only the process that owns logging (global rank 0) creates any of these.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm.auto import tqdm


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # On resume, drop records written after the checkpoint we resume from, so the file
            # reads as one uninterrupted run.
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # about 0.5 s to import; only with train.tensorboard

            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=resume_step)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    group = "eval" if k.startswith("eval_") else "train"
                    self._tb.add_scalar(f"{group}/{k}", v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class ProgressBar:
    """A tqdm bar over training steps that shows step, loss, lr, tokens/s, MFU and the ETA."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not enabled,
            file=sys.stderr,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}|{postfix} [{elapsed}<{remaining}]",
        )

    def update(self, n: int = 1, **stats) -> None:
        if stats:
            self.bar.set_postfix_str(
                "  ".join(f"{k} {v}" for k, v in stats.items()), refresh=False
            )
        self.bar.update(n)

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr) if not self.bar.disable else None

    def close(self) -> None:
        self.bar.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Training loss (and validation loss, when present) against step, as a PNG."""
    import matplotlib  # about 0.4 s to import, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss", linewidth=1.5, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
