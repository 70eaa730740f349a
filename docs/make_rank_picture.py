"""Draw docs/rank_layout.png: how 8 ranks form the mesh for dp=2, tp=2, pp=2 (LiBai's rank order).

    python docs/make_rank_picture.py

Rank = pipeline_rank * (dp * tp) + data_rank * tp + tensor_rank: the tensor axis is innermost, so
tensor-parallel peers are neighbouring ranks; the pipeline axis is outermost.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

DP, TP, PP = 2, 2, 2
TENSOR_COLOR = "#d62728"  # tensor groups: rows inside a stage
DATA_COLOR = "#1f77b4"  # data groups: columns inside a stage
PIPE_COLOR = "#555555"  # pipeline groups: the same cell in every stage

CELL, GAP = 1.0, 0.75  # rank square size and the space between squares
STAGE_PAD, STAGE_GAP = 0.6, 2.4


def rank_of(p: int, d: int, t: int) -> int:
    return p * DP * TP + d * TP + t


def cell_origin(p: int, d: int, t: int) -> tuple[float, float]:
    """Lower-left corner of rank (p, d, t); data index grows downwards, as in the mesh's printed form."""
    stage_w = TP * CELL + (TP - 1) * GAP + 2 * STAGE_PAD
    x0 = p * (stage_w + STAGE_GAP) + STAGE_PAD
    y_top = DP * CELL + (DP - 1) * GAP + STAGE_PAD
    x = x0 + t * (CELL + GAP)
    y = y_top - (d + 1) * CELL - d * GAP
    return x, y


def main(out: Path = Path(__file__).resolve().parent / "rank_layout.png") -> Path:
    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=150)
    stage_w = TP * CELL + (TP - 1) * GAP + 2 * STAGE_PAD
    stage_h = DP * CELL + (DP - 1) * GAP + 2 * STAGE_PAD

    for p in range(PP):
        sx = p * (stage_w + STAGE_GAP)
        ax.add_patch(FancyBboxPatch((sx, 0), stage_w, stage_h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    fc="#f3f3f3", ec="black", lw=1.4))
        first = rank_of(p, 0, 0)
        ax.text(sx + stage_w / 2, stage_h + 0.18, f"pipeline stage {p}\nranks {first}-{first + DP * TP - 1}",
                ha="center", va="bottom", fontsize=11, weight="bold")
        # Tensor groups: one row of the stage (same data index), drawn as a red outline around the row.
        for d in range(DP):
            x, y = cell_origin(p, d, 0)
            ax.add_patch(FancyBboxPatch((x - 0.12, y - 0.12), TP * CELL + (TP - 1) * GAP + 0.24, CELL + 0.24,
                                        boxstyle="round,pad=0,rounding_size=0.12", fc="none", ec=TENSOR_COLOR,
                                        lw=2.2))
        # Data groups: one column (same tensor index), drawn as a dashed blue outline around the column.
        for t in range(TP):
            x, y = cell_origin(p, DP - 1, t)
            ax.add_patch(FancyBboxPatch((x - 0.22, y - 0.22), CELL + 0.44, DP * CELL + (DP - 1) * GAP + 0.44,
                                        boxstyle="round,pad=0,rounding_size=0.16", fc="none", ec=DATA_COLOR,
                                        lw=2.0, ls="--"))
        for d in range(DP):
            for t in range(TP):
                x, y = cell_origin(p, d, t)
                ax.add_patch(plt.Rectangle((x, y), CELL, CELL, fc="white", ec="black", lw=1.2))
                ax.text(x + CELL / 2, y + CELL * 0.58, str(rank_of(p, d, t)), ha="center", va="center",
                        fontsize=18, weight="bold")
                ax.text(x + CELL / 2, y + CELL * 0.2, f"(d{d}, t{t})", ha="center", va="center", fontsize=8,
                        color="#444444")

    # Axis hints on the first stage: rows are the data axis, columns the tensor axis.
    x, y = cell_origin(0, 0, 0)
    ax.annotate("", xy=(x - 0.38, y - CELL - GAP + 0.1), xytext=(x - 0.38, y + CELL - 0.1),
                arrowprops=dict(arrowstyle="->", color=DATA_COLOR, lw=1.3))
    ax.text(x - 0.47, y + 0.1 - GAP / 2, "data axis", rotation=90, ha="right", va="center", fontsize=9,
            color=DATA_COLOR)
    ax.annotate("", xy=(x + 2 * CELL + GAP - 0.1, y + CELL + 0.38), xytext=(x + 0.1, y + CELL + 0.38),
                arrowprops=dict(arrowstyle="->", color=TENSOR_COLOR, lw=1.3))
    ax.text(x + CELL + GAP / 2, y + CELL + 0.45, "tensor axis", ha="center", va="bottom", fontsize=9,
            color=TENSOR_COLOR)

    # Pipeline groups: one arrow between the stages; rank r sends activations to rank r + dp * tp.
    for p in range(PP - 1):
        x_from = p * (stage_w + STAGE_GAP) + stage_w + 0.1
        x_to = (p + 1) * (stage_w + STAGE_GAP) - 0.1
        ax.annotate("", xy=(x_to, stage_h / 2), xytext=(x_from, stage_h / 2),
                    arrowprops=dict(arrowstyle="simple,head_width=0.9,head_length=0.7,tail_width=0.35",
                                    fc=PIPE_COLOR, ec=PIPE_COLOR))
        pairs = "\n".join(f"{rank_of(p, d, t)} \u2192 {rank_of(p + 1, d, t)}" for d in range(DP) for t in range(TP))
        ax.text((x_from + x_to) / 2, stage_h / 2 + 0.35, "activations", ha="center", va="bottom", fontsize=10,
                color=PIPE_COLOR)
        ax.text((x_from + x_to) / 2, stage_h / 2 - 0.35, pairs, ha="center", va="top", fontsize=10,
                color=PIPE_COLOR, family="monospace")

    legend = [
        plt.Line2D([], [], color=TENSOR_COLOR, lw=2.2, label="tensor groups [0,1] [2,3] [4,5] [6,7]  (inner axis)"),
        plt.Line2D([], [], color=DATA_COLOR, lw=2.0, ls="--", label="data groups [0,2] [1,3] [4,6] [5,7]"),
        plt.Line2D([], [], color=PIPE_COLOR, lw=3.0, label="pipeline groups [0,4] [1,5] [2,6] [3,7]  (outer axis)"),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=1, frameon=False, fontsize=10)
    ax.set_title("8 ranks, dp 2 x tp 2 x pp 2: mesh axes (\"pipeline\", \"data\", \"tensor\")", fontsize=12, pad=12)
    total_w = PP * stage_w + (PP - 1) * STAGE_GAP
    ax.set_xlim(-0.3, total_w + 0.3)
    ax.set_ylim(-0.3, stage_h + 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
