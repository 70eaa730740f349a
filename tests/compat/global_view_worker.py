"""Multi-process checks of the global-view helpers under pipeline parallelism (run by test_global_view.py).

    torchrun --nproc-per-node 2 tests/compat/global_view_worker.py

Every rank records what it sees; rank 0 prints one JSON list (one dict per rank, in rank order).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as torch_dist

from dufu.compat import libai as dist
from dufu.parallel.launch import finish_distributed
from dufu.errors import DufuError, LayoutError


def ranks(mesh) -> list:
    return mesh.mesh.tolist()


def main() -> None:
    ctx = dist.setup(pipeline_parallel_size=2, pipeline_num_layers=2)
    rank = ctx.rank
    seen = {
        "rank": rank,
        "pipeline_rank": ctx.pipeline_rank,
        "layer0": ranks(dist.get_layer_placement(0)),
        "layer1": ranks(dist.get_layer_placement(1)),
        "layer_last": ranks(dist.get_layer_placement(-1)),
        "axes": list(dist.get_layer_placement(-1).mesh_dim_names),
        # This rank's own stage mesh is the slice of the 3-D mesh that parallelize() shards on.
        "own_is_slice": ctx.stage_mesh == ctx.mesh["data", "tensor"],
        "own_contains_rank": dist.get_layer_placement(rank).get_coordinate() is not None,
    }
    # A tensor placed on this rank's stage holds data here; one placed on the other stage is empty here.
    mine = dist.to_global(torch.full((2, 3), float(rank)), dist.get_layer_placement(rank),
                          dist.get_nd_sbp([dist.broadcast, dist.broadcast]))
    other = dist.to_global(torch.full((2, 3), float(rank)), dist.get_layer_placement(1 - rank),
                           dist.get_nd_sbp([dist.broadcast, dist.broadcast]))
    seen["mine_local"] = dist.to_local(mine).tolist()
    seen["other_local_numel"] = dist.to_local(other).numel()
    try:
        dist.to_global(mine, placement=dist.get_layer_placement(1 - rank))
        seen["cross_stage_error"] = None
    except LayoutError as err:
        seen["cross_stage_error"] = str(err)

    # LiBai's custom_pipeline_stage_id through a dist dict: layers 0-2 on stage 0, layer 3 on stage 1.
    ctx2 = dist.setup({"pipeline_parallel_size": 2, "pipeline_num_layers": 4, "custom_pipeline_stage_id": [0, 0, 0, 1]})
    seen["custom"] = [ranks(ctx2.get_layer_placement(i)) for i in range(4)]
    # Without pipeline_num_layers, layers cannot be mapped to stages: a clear error.
    ctx3 = dist.setup(pipeline_parallel_size=2)
    try:
        ctx3.get_layer_placement(0)
        seen["no_layers_error"] = None
    except DufuError as err:
        seen["no_layers_error"] = str(err)

    gathered = [None] * ctx.world_size if rank == 0 else None
    torch_dist.gather_object(seen, gathered, dst=0)
    if rank == 0:
        print("RESULT " + json.dumps(gathered))


if __name__ == "__main__":
    main()
    finish_distributed(0)
