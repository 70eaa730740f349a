"""LiBai's global view (placement + SBP) on PyTorch's DeviceMesh and DTensor.

LiBai describes every tensor by a *placement* (the grid of ranks that holds
it) and an *SBP* per grid axis (split, broadcast or partial-sum). PyTorch has
the same two ideas natively, so this module is a thin dictionary between the
two vocabularies, not a second implementation (the vocabulary itself, which needs no process group,
is in :mod:`dufu.compat.sbp`; this module re-exports it next to ``setup()`` and ``DistContext``):

=====================================  ==================================================
LiBai / OneFlow                        here (torch)
=====================================  ==================================================
``flow.placement`` of a layer          ``get_layer_placement(i)``: the stage's 2-D
                                       ``DeviceMesh`` with axes ("data", "tensor")
``flow.sbp.split(d)``                  ``split(d)`` = ``Shard(d)``
``flow.sbp.broadcast``                 ``broadcast`` = ``Replicate()``
``flow.sbp.partial_sum``               ``partial_sum`` = ``Partial()``
``dist.get_nd_sbp([a, b])``            ``get_nd_sbp([a, b])``: a placements tuple
``tensor.to_global(placement, sbp)``   ``to_global(tensor, placement, sbp)``:
                                       ``DTensor.from_local`` / ``DTensor.redistribute``
``tensor.to_local()``                  ``to_local(tensor)``
=====================================  ==================================================

``setup()`` starts (or joins) the process group, validates the layout with
:class:`~dufu.parallel.parallel_dims.ParallelDims` and builds the 3-D mesh ("pipeline", "data",
"tensor") in LiBai's rank order. It returns a :class:`DistContext`, which holds
all of this state and offers every helper as a method. The module-level
functions delegate to the context most recently returned by ``setup()``: that
one process-wide reference mirrors ``torch.distributed``'s own process-global
default group (which ``setup()`` creates), and exists so that LiBai-style code
(``dist.get_layer_placement(0)``) reads the same. Library code should take a
``DistContext`` (or a ``DeviceMesh``) as an argument instead.

``to_global`` of a local tensor follows OneFlow's ``Tensor.to_global``: the
tensor is this rank's *local component* (its shard under ``split``), and the
global shape is inferred from it (an even split is assumed; pass ``shape=`` for
uneven ones). Under ``broadcast`` the first rank's data along that mesh axis is
sent to the others, as OneFlow does. To scatter a full tensor that every rank
holds, use torch's ``distribute_tensor(full, placement, sbp)``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from dufu.compat.sbp import (
    STAGE_AXES,
    describe_mesh,
    placements_for,
    broadcast,
    get_nd_sbp_for,
    layer_pipeline_rank,
    partial_sum,
    split,
)
from dufu.errors import DufuError, LayoutError
from dufu.parallel import env
from dufu.parallel.launch import init_distributed
from dufu.parallel.parallel_dims import ParallelDims

__all__ = [
    "DistContext",
    "broadcast",
    "get_layer_placement",
    "get_nd_sbp",
    "layer_pipeline_rank",
    "partial_sum",
    "setup",
    "split",
    "to_global",
    "to_local",
]


# ------------------------------------------------------------------ context


class DistContext:
    """The distributed state of a program that uses the global view: made by :func:`setup`.

    ``mesh`` is the 3-D ("pipeline", "data", "tensor") ``DeviceMesh``; ``dims`` the validated
    :class:`ParallelDims`. Use it as a context manager, or call :meth:`close`, to release what
    ``setup()`` created.
    """

    def __init__(
        self,
        dims: ParallelDims,
        mesh,
        device: torch.device,
        *,
        pipeline_num_layers: Optional[int] = None,
        virtual_pipeline_size: int = 1,
        custom_pipeline_stage_id: Optional[Sequence[int]] = None,
        owns_process_group: bool = False,
    ):
        self._dims = dims
        self._mesh = mesh
        self._device = device
        self.pipeline_num_layers = pipeline_num_layers
        self.virtual_pipeline_size = virtual_pipeline_size
        self.custom_pipeline_stage_id = list(custom_pipeline_stage_id) if custom_pipeline_stage_id else None
        self._owns_process_group = owns_process_group
        self._closed = False
        self._stage_meshes = self._build_stage_meshes()

    def _build_stage_meshes(self) -> list:
        """One 2-D (data, tensor) mesh per pipeline rank, identical on every rank.

        This rank's own stage is a slice of the 3-D mesh, so it is *the same* mesh that
        ``parallelize`` shards parameters on (DTensor ops need equal meshes). The other stages are
        built with the public ``DeviceMesh`` constructor, which every rank calls in the same order
        (creating process groups is collective); this rank is not a member of them, so a DTensor
        placed there is empty here, like a OneFlow global tensor whose placement excludes the rank.
        """
        own = self._mesh.get_coordinate()[0]
        meshes = []
        for stage in range(self._dims.pipeline_parallel_size):
            if self._dims.pipeline_parallel_size == 1:
                meshes.append(self._mesh[STAGE_AXES])
                continue
            other = DeviceMesh(self._mesh.device_type, self._mesh.mesh[stage], mesh_dim_names=STAGE_AXES)
            meshes.append(self._mesh[STAGE_AXES] if stage == own else other)
        return meshes

    # ------------------------------------------------------------ properties
    @property
    def mesh(self):
        """The 3-D ``DeviceMesh`` with axes ("pipeline", "data", "tensor"), LiBai's rank order."""
        return self._mesh

    @property
    def dims(self) -> ParallelDims:
        return self._dims

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self._dims.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pipeline_rank(self) -> int:
        """This rank's index along the "pipeline" axis (its pipeline stage when there is one stage per rank)."""
        return self._mesh.get_coordinate()[0]

    @property
    def stage_mesh(self):
        """This rank's own 2-D (data, tensor) mesh: where its layers' parameters live."""
        return self._stage_meshes[self.pipeline_rank]

    # ------------------------------------------------------------ LiBai API
    def get_layer_placement(self, layer_idx: int = 0):
        """The 2-D ``DeviceMesh`` (axes "data", "tensor") of the pipeline stage that holds layer ``layer_idx``.

        ``-1`` is the last layer (the last stage). Without pipeline parallelism every layer is on the
        one stage. With it, ``pipeline_num_layers`` (``setup`` argument or ``train.dist.pipeline_num_layers``)
        decides which stage holds which layer.
        """
        self._check_open()
        pp = self._dims.pipeline_parallel_size
        if self.pipeline_num_layers is None:
            if pp > 1:
                raise LayoutError(
                    f"get_layer_placement({layer_idx}) needs to know how layers map to the {pp} pipeline stages, "
                    "but pipeline_num_layers is not set. Pass setup(..., pipeline_num_layers=N) or set "
                    "train.dist.pipeline_num_layers (or model.num_layers) in the config."
                )
            if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
                raise TypeError(f"layer_idx must be an int, got {layer_idx!r}")
            return self._stage_meshes[0]
        stage = layer_pipeline_rank(
            layer_idx, self.pipeline_num_layers, pp, self.virtual_pipeline_size, self.custom_pipeline_stage_id
        )
        return self._stage_meshes[stage]

    def get_nd_sbp(self, sbp_list) -> tuple[Placement, ...]:
        """A placements tuple for a layer's 2-D placement: one SBP per axis, ("data", "tensor") in that order.

        ``get_nd_sbp([split(0), broadcast])`` is LiBai's data-parallel input: split along the batch over
        the data axis, whole on every tensor-parallel rank.
        """
        self._check_open()
        return get_nd_sbp_for(sbp_list, ndim=len(STAGE_AXES), axes=STAGE_AXES)

    def to_global(self, tensor: torch.Tensor, placement=None, sbp=None, *, shape=None) -> DTensor:
        """LiBai's ``to_global``.

        * ``tensor`` is a plain tensor: it is this rank's local component, and the result is the
          global ``DTensor`` it belongs to (``DTensor.from_local``; no communication, except that
          ``broadcast`` axes take the first rank's data). ``placement`` defaults to this rank's stage
          mesh; ``sbp`` is required. Give ``shape`` when a split is uneven.
        * ``tensor`` is a ``DTensor``: it is redistributed to ``sbp`` (``DTensor.redistribute``) on the
          same mesh. Moving between meshes (pipeline stages) is not a redistribution: pipeline stages
          exchange activations through the pipeline schedule.

        ``sbp`` is one placement per mesh axis (a tuple, e.g. from ``get_nd_sbp``) or a single
        ``broadcast`` / ``partial_sum`` meaning that SBP on every axis.
        """
        self._check_open()
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if placement is not None and placement != mesh:
                raise LayoutError(
                    f"to_global cannot move a tensor from {describe_mesh(mesh)} to {describe_mesh(placement)}: a "
                    "DTensor is redistributed within its own mesh only. Between pipeline stages, activations "
                    "travel through the pipeline schedule (dufu.parallel.pipeline); to change only the SBP, "
                    "call to_global(tensor, sbp=...) without a placement."
                )
            if sbp is None:
                return tensor
            return tensor.redistribute(mesh, placements_for(sbp, mesh, tensor.ndim))
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"to_global takes a torch.Tensor or DTensor, got {type(tensor).__name__}")
        if sbp is None:
            raise LayoutError(
                "to_global of a local tensor needs sbp= (how the local tensors make up the global one), e.g. "
                "sbp=get_nd_sbp([split(0), broadcast])."
            )
        mesh = placement if placement is not None else self.stage_mesh
        placements = placements_for(sbp, mesh, tensor.ndim)
        if tensor.device != self._device and not tensor.is_meta:
            # The local component joins collectives over the mesh (run_check's broadcast, any later
            # redistribute): it must be on this rank's device, e.g. cuda:<local rank> under NCCL, not on
            # whichever CUDA device happens to be current or on the CPU it was created on.
            tensor = tensor.to(self._device)
        # from_local's run_check broadcasts the first rank's data along Replicate axes (OneFlow's behaviour).
        run_check = any(isinstance(p, Replicate) for p in placements)
        return DTensor.from_local(tensor, mesh, placements, run_check=run_check, shape=shape)

    @staticmethod
    def to_local(tensor: torch.Tensor) -> torch.Tensor:
        """This rank's local component of a ``DTensor`` (a plain tensor is returned unchanged)."""
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Forget this context; destroy the process group if ``setup()`` created a single-process one.

        A multi-process group is left to the launcher's end of run (``dufu.parallel.launch.finish_distributed``):
        tearing gloo down while peers still exit was seen to abort a rank.
        """
        if self._closed:
            return
        self._closed = True
        if _CURRENT.get("context") is self:
            _CURRENT["context"] = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "DistContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DufuError("this DistContext was closed; call dufu.compat.libai.setup(...) again for a new one.")

    def __repr__(self) -> str:
        return f"DistContext({self._dims.describe()}, rank {self.rank}, device {self._device})"



# ------------------------------------------------------------------ setup


# The context most recently returned by setup(): the one process-wide reference, as torch.distributed
# keeps its default process group. The module-level helpers below read it.
_CURRENT: dict = {"context": None}


def _dist_settings(cfg) -> tuple[Mapping, Optional[int]]:
    """(the dist dict, the model's layer count if the config has one) from a full config or a dist dict."""
    if isinstance(cfg, Mapping) and "train" in cfg:
        model = cfg.get("model") or {}
        layers = model.get("num_layers") if isinstance(model, Mapping) else None
        return cfg["train"]["dist"], layers
    if isinstance(cfg, Mapping):
        return cfg, None
    if hasattr(cfg, "train"):  # an attribute-style config object
        layers = getattr(getattr(cfg, "model", None), "num_layers", None)
        return cfg.train.dist, layers
    raise TypeError(f"setup(cfg) takes a full config (with train.dist) or a dist dict, got {type(cfg).__name__}")


def setup(
    cfg=None,
    *,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_num_layers: Optional[int] = None,
) -> DistContext:
    """Join (or start) the process group, validate the layout and build the mesh: LiBai's ``setup_dist_util``.

    ``cfg`` is a full dufu config (its ``train.dist`` is used) or a dist dict with LiBai's keys;
    without it, the keyword sizes are used. A size of -1 is inferred from the world size. Run under
    ``torchrun`` for several processes; on one process a 1 x 1 x 1 mesh is built on a private
    single-process group.
    """
    if cfg is not None:
        given = {"data_parallel_size": data_parallel_size, "tensor_parallel_size": tensor_parallel_size,
                 "pipeline_parallel_size": pipeline_parallel_size}
        changed = [k for k, v in given.items() if v != 1] + (["pipeline_num_layers"] if pipeline_num_layers else [])
        if changed:
            raise DufuError(
                f"setup() got both a config and {', '.join(changed)}; put the sizes in the config "
                "(train.dist.*) or pass only keywords."
            )
        dist_cfg, model_layers = _dist_settings(cfg)
        get = dist_cfg.get
        data_parallel_size = get("data_parallel_size", 1)
        tensor_parallel_size = get("tensor_parallel_size", 1)
        pipeline_parallel_size = get("pipeline_parallel_size", 1)
        pipeline_num_layers = get("pipeline_num_layers") or model_layers
        virtual = get("virtual_pipeline_size", 1) or 1
        custom = get("custom_pipeline_stage_id")
    else:
        virtual, custom = 1, None

    _, local_rank, world_size = env.world_info()
    if dist.is_initialized():
        world_size = dist.get_world_size()
    # Validate before any rendezvous, so a bad layout fails the same way on every rank.
    dims = ParallelDims(data_parallel_size, tensor_parallel_size, pipeline_parallel_size, world_size=world_size)
    if dims.pipeline_parallel_size > 1 and pipeline_num_layers is not None:
        # The same checks the trainer makes: enough layers, a well-formed custom_pipeline_stage_id.
        layer_pipeline_rank(0, pipeline_num_layers, dims.pipeline_parallel_size, virtual, custom)

    device = env.pick_device(local_rank)
    owns = False
    if not dist.is_initialized():
        if world_size > 1:
            init_distributed(device)
        else:
            # One process: DeviceMesh still needs a process group. An in-memory store needs no port and
            # no file, so it cannot collide with anything else on the machine.
            dist.init_process_group(
                backend=env.pick_backend(device),
                store=dist.HashStore(), rank=0, world_size=1,
                timeout=datetime.timedelta(minutes=10),
                device_id=device if device.type == "cuda" else None,
            )
            owns = True
    mesh = dims.build_mesh(device.type)
    ctx = DistContext(
        dims, mesh, device, pipeline_num_layers=pipeline_num_layers, virtual_pipeline_size=virtual,
        custom_pipeline_stage_id=custom, owns_process_group=owns,
    )
    _CURRENT["context"] = ctx
    return ctx


def current_context() -> DistContext:
    """The context of the last :func:`setup` call (raises if there is none)."""
    ctx = _CURRENT["context"]
    if ctx is None:
        raise DufuError(
            "no distributed context: call dufu.compat.libai.setup(...) first (e.g. "
            "dufu.compat.libai.setup(data_parallel_size=2, tensor_parallel_size=2) under torchrun), then use "
            "get_layer_placement / get_nd_sbp / to_global."
        )
    return ctx


# ------------------------------------------------------- module-level (LiBai) API


def get_layer_placement(layer_idx: int = 0):
    """:meth:`DistContext.get_layer_placement` of the context from the last :func:`setup`."""
    return current_context().get_layer_placement(layer_idx)


def get_nd_sbp(sbp_list) -> tuple[Placement, ...]:
    """:meth:`DistContext.get_nd_sbp` of the context from the last :func:`setup`."""
    return current_context().get_nd_sbp(sbp_list)


def to_global(tensor: torch.Tensor, placement=None, sbp=None, *, shape=None) -> DTensor:
    """:meth:`DistContext.to_global` of the context from the last :func:`setup`."""
    return current_context().to_global(tensor, placement, sbp, shape=shape)


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local component of a ``DTensor``; needs no context."""
    return DistContext.to_local(tensor)
