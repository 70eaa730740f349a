"""LiBai's placement and SBP vocabulary as torch DTensor placements, and LiBai's layer-to-stage rule.

No process group is needed here: these are names and checks. :mod:`dufu.compat.libai` re-exports all
of it next to ``setup()`` and ``DistContext``, so ported code keeps writing ``dist.split(0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from dufu.errors import LayoutError
from dufu.parallel.pipeline import layer_stage_ids

#: The axes of a layer's placement (one pipeline stage's 2-D mesh), in LiBai's order.
STAGE_AXES = ("data", "tensor")


def split(dim: int) -> Shard:
    """LiBai's ``split(dim)``: each rank along the mesh axis holds one slice of tensor dim ``dim``."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"split(dim) takes a tensor dim (an int), got {dim!r}")
    return Shard(dim)


#: LiBai's ``broadcast``: every rank along the mesh axis holds the whole tensor.
broadcast: Replicate = Replicate()
#: LiBai's ``partial_sum``: every rank holds a summand; the tensor is their sum.
partial_sum: Partial = Partial("sum")


# ------------------------------------------------------------- stage mapping


def layer_pipeline_rank(
    layer_idx: int,
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_pipeline_size: int = 1,
    custom_pipeline_stage_id: Optional[Sequence[int]] = None,
) -> int:
    """The pipeline rank (index along the "pipeline" mesh axis) that holds layer ``layer_idx``.

    Layers go to stages as the trainer places them (``dufu.parallel.pipeline.layer_stage_ids``):
    equal consecutive runs, or ``custom_pipeline_stage_id``. With ``virtual_pipeline_size`` v there
    are pp x v stages and stage s lives on pipeline rank s % pp. ``layer_idx`` may be negative
    (-1 = the last layer), as in LiBai.
    """
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
        raise TypeError(f"layer_idx must be an int, got {layer_idx!r}")
    if not -num_layers <= layer_idx < num_layers:
        raise LayoutError(
            f"layer_idx {layer_idx} is out of range for pipeline_num_layers {num_layers}: use 0..{num_layers - 1}, "
            "or -1 for the last layer."
        )
    stages = pipeline_parallel_size * virtual_pipeline_size
    stage_ids = layer_stage_ids(num_layers, stages, custom_pipeline_stage_id)
    return stage_ids[layer_idx] % pipeline_parallel_size


# ------------------------------------------------------------ placements


def describe_mesh(mesh) -> str:
    names = getattr(mesh, "mesh_dim_names", None)
    ranks = mesh.mesh.tolist() if hasattr(mesh, "mesh") else mesh
    return f"the mesh {ranks}" + (f" (axes {', '.join(names)})" if names else "")


def get_nd_sbp_for(sbp_list, ndim: int, axes: Sequence[str]) -> tuple[Placement, ...]:
    """Check ``sbp_list`` (one placement per mesh axis) and return it as a tuple."""
    if isinstance(sbp_list, Placement) or not isinstance(sbp_list, Sequence):
        raise LayoutError(
            f"get_nd_sbp takes a list with one SBP per mesh axis ({', '.join(axes)}), e.g. "
            f"get_nd_sbp([split(0), broadcast]); got {sbp_list!r}."
        )
    if len(sbp_list) != ndim:
        raise LayoutError(
            f"get_nd_sbp got {len(sbp_list)} SBP(s) but a layer's placement has {ndim} axes ({', '.join(axes)}); "
            f"give one per axis, e.g. get_nd_sbp([split(0), broadcast])."
        )
    for p in sbp_list:
        if not isinstance(p, Placement):
            raise LayoutError(
                f"{p!r} is not an SBP: use dufu.compat.libai.split(dim), broadcast or partial_sum "
                "(or torch's Shard / Replicate / Partial)."
            )
    return tuple(sbp_list)


def placements_for(sbp, mesh, tensor_ndim: int) -> tuple[Placement, ...]:
    """``sbp`` as placements for ``mesh``: a tuple with one per axis, or one broadcast / partial_sum for all."""
    axes = mesh.mesh_dim_names or tuple(f"axis {i}" for i in range(mesh.ndim))
    if isinstance(sbp, Placement):
        if isinstance(sbp, Shard) and mesh.ndim > 1:
            raise LayoutError(
                f"sbp={sbp} is ambiguous on {describe_mesh(mesh)}: give one SBP per mesh axis, e.g. "
                f"get_nd_sbp([split({sbp.dim}), broadcast]) to split over the first axis only."
            )
        placements = (sbp,) * mesh.ndim
    else:
        placements = get_nd_sbp_for(sbp, mesh.ndim, axes)
    for p in placements:
        if isinstance(p, Shard) and not -tensor_ndim <= p.dim < tensor_ndim:
            raise LayoutError(f"sbp split({p.dim}) is out of range for a tensor with {tensor_ndim} dim(s).")
    return placements
