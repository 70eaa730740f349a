"""Draw docs/expert_layout.png: 4 data-parallel ranks with expert_parallel_size 2 and 8 experts.

    python docs/make_expert_picture.py

The data axis of dp ranks is seen as dp / ep x ep, ep inner: data ranks 0 1 | 2 3 are the expert groups (each
holds all 8 experts, 4 per rank, tokens travel by all-to-all inside a group), and 0 2 | 1 3 the expert_data
groups (the same experts on different data: their gradients are averaged there). Every other parameter is
data-parallel over all 4 ranks.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

DP, EP, EXPERTS = 4, 2, 8
GROUP_COLOR = "#d62728"  # expert groups (all-to-all)
DATA_COLOR = "#1f77b4"  # expert_data groups (gradient average of the same experts)
EXPERT_COLORS = plt.get_cmap("tab10").colors


def main(out: Path = Path(__file__).resolve().parent / "expert_layout.png") -> Path:
    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=150)
    w, h, gap = 2.0, 2.2, 0.5
    local = EXPERTS // EP
    xs = []
    for d in range(DP):
        x = d * (w + gap) + (0.6 if d >= EP else 0.0)  # a wider gap between the two expert groups
        xs.append(x)
        ax.add_patch(FancyBboxPatch((x, 0), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc="#f3f3f3",
                                    ec="black", lw=1.3))
        e = d % EP
        ax.text(x + w / 2, h - 0.25, f"data rank {d}", ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + w / 2, h - 0.6, "router, attention, norms:\nall ranks (data)", ha="center", va="center",
                fontsize=7)
        for j in range(local):
            k = e * local + j
            ax.add_patch(FancyBboxPatch((x + 0.15 + j * 0.44, 0.35), 0.36, 0.8, boxstyle="round,pad=0.01",
                                        fc=EXPERT_COLORS[k], ec="black", lw=0.6))
            ax.text(x + 0.33 + j * 0.44, 0.75, f"E{k}", ha="center", va="center", fontsize=7, color="white",
                    weight="bold")
    for g in range(DP // EP):  # expert groups: red outline
        x0 = xs[g * EP] - 0.15
        x1 = xs[g * EP + EP - 1] + w + 0.15
        ax.add_patch(FancyBboxPatch((x0, -0.2), x1 - x0, h + 0.4, boxstyle="round,pad=0,rounding_size=0.15",
                                    fc="none", ec=GROUP_COLOR, lw=2.2))
        ax.text((x0 + x1) / 2, -0.45, f"expert group {g}: all-to-all of token copies", ha="center", va="top",
                fontsize=9, color=GROUP_COLOR)
        ax.add_patch(FancyArrowPatch((xs[g * EP] + w - 0.1, 1.45), (xs[g * EP + 1] + 0.1, 1.45),
                                     arrowstyle="<|-|>", mutation_scale=12, color=GROUP_COLOR, lw=1.5))
    for e in range(EP):  # expert_data groups: blue arc above
        a, b = xs[e] + w / 2, xs[e + EP] + w / 2
        ax.add_patch(FancyArrowPatch((a, h + 0.1), (b, h + 0.1), connectionstyle=f"arc3,rad={-0.12 - 0.06 * e}",
                                     arrowstyle="<|-|>", mutation_scale=12, color=DATA_COLOR, lw=1.5,
                                     linestyle="--"))
        ax.text((xs[0] + xs[-1] + w) / 2, h + 1.6 - 0.35 * e, f"expert_data group {e} (dashed): experts E{e * local}-E{e * local + local - 1}"
                f" averaged (or ZeRO-sharded) over ranks {e} and {e + EP}", ha="center",
                fontsize=8, color=DATA_COLOR)
    ax.set_xlim(-0.5, xs[-1] + w + 0.5)
    ax.set_ylim(-1.0, h + 1.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"dp {DP}, expert_parallel_size {EP}, {EXPERTS} experts: experts split inside each group of "
                 f"{EP} neighbouring data ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
