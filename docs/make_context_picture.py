"""Draw docs/context_layout.png: how context parallelism splits a sequence over cp = 4 ranks.

    python docs/make_context_picture.py

Left: the sequence cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r. Right: the causal attention
blocks (query chunk x key chunk) each rank computes, coloured by rank: every rank gets 2cp + 1 of them.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

CP = 4
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def owner(chunk: int) -> int:
    return chunk if chunk < CP else 2 * CP - 1 - chunk


def main() -> None:
    n = 2 * CP
    fig, (top, grid) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    for c in range(n):  # the sequence
        r = owner(c)
        top.add_patch(Rectangle((c, 0), 1, 1, facecolor=COLORS[r], edgecolor="white", lw=2))
        top.text(c + 0.5, 0.5, f"{c}", ha="center", va="center", color="white", fontsize=12, weight="bold")
        top.text(c + 0.5, -0.35, f"rank {r}", ha="center", va="center", fontsize=8, color=COLORS[r])
    top.annotate("", xy=(n, 1.45), xytext=(0, 1.45), arrowprops=dict(arrowstyle="->", color="#444"))
    top.text(n / 2, 1.7, "sequence position (chunks of T / 2cp tokens)", ha="center", fontsize=9)
    for r in range(CP):
        top.text(0, -1.0 - 0.42 * r, f"rank {r} holds chunks {r} and {2 * CP - 1 - r}", fontsize=9, color=COLORS[r])
    top.set_xlim(-0.2, n + 0.2)
    top.set_ylim(-1.0 - 0.42 * CP, 2.0)
    top.axis("off")
    top.set_title(f"cp = {CP}: load-balanced causal chunks", fontsize=11)

    counts = [0] * CP
    for q in range(n):  # query chunk q attends to key chunks 0..q
        for k in range(q + 1):
            r = owner(q)
            counts[r] += 1
            grid.add_patch(Rectangle((k, n - 1 - q), 1, 1, facecolor=COLORS[r], edgecolor="white", lw=1.5,
                                     alpha=1.0 if k < q else 0.55))
    grid.set_xlim(0, n)
    grid.set_ylim(0, n)
    grid.set_aspect("equal")
    grid.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)])
    grid.set_yticks([i + 0.5 for i in range(n)], [str(n - 1 - i) for i in range(n)])
    grid.set_xlabel("key chunk (all-gathered K, V)")
    grid.set_ylabel("query chunk (held locally)")
    grid.set_title("attention blocks computed (diagonal: causal mask)\n" +
                   ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)), fontsize=10)
    fig.tight_layout()
    out = Path(__file__).with_name("context_layout.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
