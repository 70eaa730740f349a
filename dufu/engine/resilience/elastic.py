"""Start-up checks of an elastic job (``dufu train --nnodes MIN:MAX``), run by the launcher before any worker
starts."""

from __future__ import annotations

from dufu.engine.preflight import preflight
from dufu.errors import LayoutError


def check_elastic_range(cfg, nproc: int, min_nodes: int, max_nodes: int, resume) -> None:
    """An elastic job (``--nnodes MIN:MAX``) restarts at whatever world size its nodes make: every one from the
    smallest to the largest must hold the layout (a size of -1, usually data_parallel_size, is inferred each
    time; the global batch stays, the accumulation steps follow)."""
    for nodes in range(min_nodes, max_nodes + 1):
        try:
            preflight(cfg, world_size=nproc * nodes, resume=resume)
        except LayoutError as e:
            raise LayoutError(
                f"--nnodes {min_nodes}:{max_nodes} lets the job run on {nodes} node(s) x {nproc} processes = "
                f"{nodes * nproc}, and that world cannot hold the layout: {e} For an elastic job, set the "
                "size that should follow the world to -1 (e.g. train.dist.data_parallel_size=-1) and a "
                "train.global_batch_size every world divides.") from None
