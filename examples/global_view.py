"""The global view in 60 lines: one logical tensor, four processes, each holding a quarter.

Run it on four processes (CPU is fine):

    torchrun --nproc-per-node 4 examples/global_view.py

With data_parallel_size=2 and tensor_parallel_size=2 the ranks form the 2 x 2 mesh
[[0, 1], [2, 3]] (rows: the "data" axis, columns: the "tensor" axis). A (16, 8) tensor with
SBP (split(0), split(1)) is cut in half along dim 0 over the data axis and in half along dim 1
over the tensor axis, so every rank holds an (8, 4) block. A module whose parameter has the same
layout adds noise to it; the sum keeps the layout, and no rank ever holds the whole tensor until
we ask for it with to_global(..., broadcast).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

from dufu.compat import libai as dist
from dufu.parallel.launch import finish_distributed
from dufu.errors import DufuError

ROWS, COLS = 16, 8


def noise_block(rank: int, shape) -> torch.Tensor:
    """Rank ``rank``'s own block of the noise: each rank draws different numbers."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + rank))


class AddNoise(nn.Module):
    """Single-device code: ``x + noise``. Only the parameter's layout makes it distributed."""

    def __init__(self, placement, sbp, rank: int):
        super().__init__()
        local_shape = (ROWS // placement.size(0), COLS // placement.size(1))
        # to_global of a local tensor: this rank's block *is* its shard of the global (16, 8) noise.
        self.noise = nn.Parameter(dist.to_global(noise_block(rank, local_shape), placement, sbp))

    def forward(self, x):
        return x + self.noise  # DTensor + DTensor with the same layout: a local add, no communication


def main() -> int:
    ctx = dist.setup(data_parallel_size=2, tensor_parallel_size=2)
    placement = dist.get_layer_placement(0)  # the 2-D mesh [[0, 1], [2, 3]], axes ("data", "tensor")
    sbp = dist.get_nd_sbp([dist.split(0), dist.split(1)])

    # The same full tensor on every rank; distribute_tensor keeps only this rank's (8, 4) block.
    # Made on this rank's device (ctx.device: cuda:<local rank> under NCCL), where its collectives run.
    full_x = torch.arange(ROWS * COLS, dtype=torch.float32, device=ctx.device).reshape(ROWS, COLS)
    x = distribute_tensor(full_x, placement, sbp)

    model = AddNoise(placement, sbp, ctx.rank)
    y = model(x)

    local = dist.to_local(y)
    line = (
        f"rank {ctx.rank}: mesh coordinate {tuple(placement.get_coordinate())}, global shape {tuple(y.shape)}, "
        f"local shape {tuple(local.shape)}, placements {y.placements}, local sum {local.sum().item():.6f}"
    )
    # Print in rank order: gather every rank's line on rank 0.
    lines = [None] * ctx.world_size if ctx.rank == 0 else None
    torch_dist.gather_object(line, lines, dst=0)

    # to_global on a DTensor redistributes: broadcast on both axes = every rank gets the whole (16, 8).
    whole = dist.to_local(dist.to_global(y, sbp=dist.get_nd_sbp([dist.broadcast, dist.broadcast])))
    if ctx.rank == 0:
        print(f"placement: mesh {placement.mesh.tolist()} with axes {placement.mesh_dim_names}, sbp {sbp}")
        for text in lines:
            print(text)
        print(f"after to_global(broadcast, broadcast): local shape {tuple(whole.shape)}, "
              f"sum {whole.sum().item():.6f}")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except DufuError as err:
        print(f"error: {err}\nThis example runs on 4 processes: torchrun --nproc-per-node 4 examples/global_view.py",
              file=sys.stderr)
        sys.exit(2)
    finish_distributed(code)  # all ranks meet, then leave (a no-op on one process)
    sys.exit(code)
