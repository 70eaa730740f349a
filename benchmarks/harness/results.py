"""Where results go and how: ``benchmarks/results/<name>-<YYYY-MM-DD>[-tag].json`` and ``.md``, every ``.json``
holding the machine it was measured on (at least the CPU model); and the small Markdown helpers the reports share.

A script's ``--results-dir`` chooses the folder; by default a full run writes to ``benchmarks/results`` and a
``--quick`` (smoke) run writes nothing unless a folder is given (:func:`results_dir`).
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def today() -> str:
    return _dt.date.today().isoformat()


def results_dir(given, quick: bool = False) -> Path | None:
    """The folder a run writes to: ``given``, else ``benchmarks/results``, except for a quick run (None: none)."""
    if given:
        return Path(given)
    return None if quick else RESULTS


def stem(folder: Path, name: str, date: str | None = None, tag: str = "") -> Path:
    """``folder/name-date[-tag]`` (no suffix)."""
    return Path(folder) / f"{name}-{date or today()}{'-' + tag if tag else ''}"


def write(path_stem: Path, data: dict, markdown: str | None = None, machine: dict | None = None) -> Path:
    """``path_stem.json`` (and ``.md`` from ``markdown``). The JSON holds the machine: ``data["machine"]``, else
    ``machine``, which needs at least the CPU model (:func:`harness.machine.describe`). Returns the stem."""
    info = data.get("machine") or machine
    if not info or not info.get("cpu"):
        raise ValueError(f"{path_stem.name}: a result records the machine it was measured on, with its CPU model")
    data.setdefault("machine", info)
    path_stem = Path(path_stem)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    path_stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    if markdown is not None:
        path_stem.with_suffix(".md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return path_stem


# ----------------------------------------------------------------------------- Markdown
def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def fmt(x, spec: str = ",.0f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def signed(x: float) -> str:
    """A whole number with its sign, never "-0"."""
    return f"{round(x):+,}"
