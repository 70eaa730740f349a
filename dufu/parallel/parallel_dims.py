"""All distributed state in one explicit object.

``ParallelDims`` turns the degrees from ``train.dist`` into a validated,
named ``DeviceMesh``. Rank order follows LiBai: pipeline is the outermost
axis, then data, then tensor (innermost, so tensor-parallel peers are
neighbouring ranks, on one node when possible). With 8 ranks and
dp=2, tp=2, pp=2::

    pipeline stage 0: ranks 0 1 2 3     tensor groups [0,1] [2,3]
    pipeline stage 1: ranks 4 5 6 7     data groups   [0,2] [1,3]

Context parallelism (``context_parallel_size``, cp) is a fourth factor of the world, dp x cp x tp x pp, between
data and tensor: the trainer's 3-D mesh has a data axis of dp x cp ranks (cp inner), over which gradients are
averaged and ZeRO shards (cp ranks hold the same parameters, as in torchtitan), and the context view of
:meth:`build_world` sees the same ranks as ("pipeline", "samples", "context", "tensor"). With 8 ranks and dp 2, cp 2, tp 2: context
groups [0,2] [1,3] [4,6] [5,7], data groups (the same samples' other half) [0,4] [1,5] [2,6] [3,7], gradient
averaging over [0,2,4,6] and [1,3,5,7] (:mod:`dufu.parallel.context_parallel`).

Expert parallelism (``expert_parallel_size``, ep) is carved out of the data axis, as in Megatron-core and
torchtitan: the world stays dp x tp x pp, and the ``dp`` data-parallel ranks are ``dp / ep`` x ``ep``
(ep inner): dp 4, ep 2 -> expert groups [0,1] [2,3] of data ranks (see :mod:`dufu.parallel.expert_parallel`).

Hybrid sharding (HSDP, ``data_parallel_replicate_size`` R, under ZeRO) splits the data axis once more, replicas
outermost, as torchtitan's dp_replicate x dp_shard: the dp x cp ranks are R replicas of dp / R x cp shards (the cp
ranks of a sample always shard together, as torchtitan shards over dp_shard x cp). FSDP2 shards each parameter over
a replica's ranks and all-reduces the gradient shards across replicas; the gradient is still the average over all
dp x cp ranks. With 8 ranks, dp 4, cp 2, R 2: data-axis positions 0..7 (position = dp rank x cp + cp rank),
shard groups [0,1,2,3] [4,5,6,7], replica groups [0,4] [1,5] [2,6] [3,7]::

    data axis (dp x cp)   0  1  2  3 | 4  5  6  7      ("data", 8 ranks: gradients averaged, losses counted)
    dp_replicate          0  0  0  0 | 1  1  1  1      all-reduce of gradient shards across  (R = 2)
    dp_shard              0  1  2  3 | 0  1  2  3      parameters sharded within             (dp / R x cp = 4)

Context parallelism's all-to-all modes (``context_parallel_mode``, :mod:`dufu.parallel.context_parallel`) split
the context axis too when the all-to-all is over part of it (hierarchical, ``context_parallel_a2a_size`` A): cp
rank c is (c // A, c % A) in ("context_outer", "context_inner"), all-to-all inside the A neighbours of an inner
group, all-gather of K/V across the cp / A groups. cp 4, A 2: inner groups [0,1] [2,3], outer groups [0,2] [1,3]
(cp ranks)::

    context (cp)      0  1  2  3
    context_outer     0  0  1  1      all-gather of K/V across   (cp / A = 2)
    context_inner     0  1  0  1      all-to-all of heads within (A = 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import init_device_mesh

from dufu.errors import LayoutError


@dataclass
class ParallelDims:
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    data_parallel_replicate_size: int = 1
    context_parallel_mode: str = "all_gather"
    context_parallel_a2a_size: int = 1

    def __post_init__(self):
        self._resolve()
        self._resolve_hsdp()
        self._resolve_context_mode()

    @classmethod
    def from_config(cls, dist_cfg, world_size: int) -> "ParallelDims":
        """From ``train.dist`` (the degrees and modes are its keys of the same names; other keys are not read)."""
        names = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size",
                 "context_parallel_size", "data_parallel_replicate_size", "context_parallel_mode",
                 "context_parallel_a2a_size")
        return cls(world_size=world_size, **{name: dist_cfg[name] for name in names if name in dist_cfg})

    def _resolve(self) -> None:
        names = ("data_parallel_size", "context_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")
        sizes = {n: getattr(self, n) for n in names}
        for n, v in sizes.items():
            if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
                raise LayoutError(
                    f"train.dist.{n} = {v!r} is not valid: use a positive integer, or -1 to infer it from the world size."
                )
        inferred = [n for n, v in sizes.items() if v == -1]
        if len(inferred) > 1:
            default = (" (data_parallel_size is -1 by default: it takes the processes the other sizes leave)"
                       if "data_parallel_size" in inferred else "")
            raise LayoutError(
                f"train.dist: only one size may be -1 (inferred), but {', '.join(inferred)} all are{default}. "
                f"Set all but one of them explicitly, e.g. train.dist.{inferred[0]}=1."
            )
        known = 1
        for n, v in sizes.items():
            if v != -1:
                known *= v
        if inferred:
            if self.world_size % known != 0:
                raise LayoutError(
                    f"cannot infer train.dist.{inferred[0]}: the world size {self.world_size} is not divisible by "
                    f"the product of the other sizes ({self._arith(sizes, skip=inferred[0])} = {known}). "
                    "Change the other sizes or the number of processes."
                )
            setattr(self, inferred[0], self.world_size // known)
            sizes[inferred[0]] = self.world_size // known
        product = (self.data_parallel_size * self.context_parallel_size * self.tensor_parallel_size
                   * self.pipeline_parallel_size)
        if product != self.world_size:
            raise LayoutError(
                f"the parallel sizes do not multiply to the world size: {self._arith(sizes)} = {product}, "
                f"but WORLD_SIZE is {self.world_size}. Launch {product} process{'es' if product != 1 else ''} "
                f"(dufu train ... --nproc {product}), or change train.dist.* (a size of -1 is inferred from the "
                "world size; data_parallel_size=-1, the default, takes the processes the other sizes leave)."
            )
        ep = self.expert_parallel_size
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise LayoutError(f"train.dist.expert_parallel_size = {ep!r} is not valid: use a positive integer "
                              "that divides train.dist.data_parallel_size.")
        if self.data_parallel_size % ep:
            raise LayoutError(
                f"train.dist.expert_parallel_size {ep} must divide train.dist.data_parallel_size "
                f"{self.data_parallel_size} (expert parallelism is carved out of data parallelism): "
                f"{self.data_parallel_size} / {ep} = {self.data_parallel_size / ep:g}. Use an expert-parallel size "
                f"among {_divisors(self.data_parallel_size)}, or more data-parallel ranks.")
        if ep > 1 and self.context_parallel_size > 1:
            raise LayoutError(
                f"train.dist.expert_parallel_size {ep} with context_parallel_size {self.context_parallel_size}: "
                "the two are not supported together (experts are carved out of the data ranks, which context "
                "parallelism splits further); set one of them to 1.")

    def _resolve_hsdp(self) -> None:
        """``data_parallel_replicate_size`` R: a positive divisor of dp (whether ZeRO is on is checked with the
        rest of the run's config, :func:`dufu.parallel.checks.validate_layout`)."""
        R, dp = self.data_parallel_replicate_size, self.data_parallel_size
        if not isinstance(R, int) or isinstance(R, bool) or R < 1:
            raise LayoutError(f"train.dist.data_parallel_replicate_size = {R!r} is not valid: use a positive integer "
                              "that divides train.dist.data_parallel_size (1: shard over every data-parallel rank).")
        if dp % R:
            raise LayoutError(
                f"train.dist.data_parallel_replicate_size {R} must divide train.dist.data_parallel_size {dp} (hybrid "
                f"sharding makes {R} replicas of dp / {R} shards each): {dp} / {R} = {dp / R:g}. Use a replicate "
                f"size among {_divisors(dp)}, or another data_parallel_size.")
        if R > 1 and self.ep_enabled:
            raise LayoutError(
                f"train.dist.data_parallel_replicate_size {R} with expert_parallel_size {self.expert_parallel_size}: "
                "hybrid sharding and expert parallelism are not supported together (both split the data-parallel "
                "ranks); set one of them to 1.")

    def _resolve_context_mode(self) -> None:
        """``context_parallel_mode`` and ``context_parallel_a2a_size`` against cp (heads: checks.py, which sees
        the model)."""
        mode, A, cp = self.context_parallel_mode, self.context_parallel_a2a_size, self.context_parallel_size
        if mode not in CONTEXT_PARALLEL_MODES:
            raise LayoutError(f"train.dist.context_parallel_mode = {mode!r} is not known; use one of "
                              f"{', '.join(CONTEXT_PARALLEL_MODES)}.")
        if not isinstance(A, int) or isinstance(A, bool) or A < 1:
            raise LayoutError(f"train.dist.context_parallel_a2a_size = {A!r} is not valid: use a positive integer "
                              "that divides train.dist.context_parallel_size.")
        if mode != "hierarchical" or (cp == 1 and A == 1):  # (a recipe may set the mode once, for any cp)
            if A != 1:
                raise LayoutError(
                    f"train.dist.context_parallel_a2a_size = {A} is read by context_parallel_mode=hierarchical only, "
                    f"but the mode is {mode!r}. Set train.dist.context_parallel_mode=hierarchical, or leave "
                    "context_parallel_a2a_size at 1.")
            return
        if cp % A:
            raise LayoutError(
                f"hierarchical context parallelism runs all-to-alls inside groups of context_parallel_a2a_size {A} "
                f"ranks, which must divide context_parallel_size {cp}: {cp} / {A} = {cp / A:g}. Use an a2a size "
                f"among {[d for d in _divisors(cp) if 1 < d < cp] or _divisors(cp)}.")
        if A in (1, cp):
            same = "all_gather" if A == 1 else "all_to_all"
            between = [d for d in _divisors(cp) if 1 < d < cp]
            raise LayoutError(
                f"hierarchical context parallelism with context_parallel_a2a_size {A} and context_parallel_size {cp} "
                f"is {'no all-to-all' if A == 1 else 'one all-to-all over every rank'}: use "
                f"train.dist.context_parallel_mode={same}"
                f"{f', or a context_parallel_a2a_size among {between}' if between else ''}.")

    @property
    def context_a2a_size(self) -> int:
        """How many cp ranks each all-to-all of attention spans: 1 (all-gather only), cp (Ulysses) or the
        hierarchical mode's ``context_parallel_a2a_size``."""
        if not self.cp_enabled:
            return 1
        return {"all_gather": 1, "all_to_all": self.context_parallel_size,
                "hierarchical": self.context_parallel_a2a_size}[self.context_parallel_mode]

    @property
    def hsdp_enabled(self) -> bool:
        return self.data_parallel_replicate_size > 1

    @property
    def data_shard_size(self) -> int:
        """The ranks FSDP shards a parameter over: dp / R x cp (all of the data axis without HSDP)."""
        return self.data_axis_size // self.data_parallel_replicate_size

    @staticmethod
    def _arith(sizes: dict, skip: Optional[str] = None) -> str:
        short = {"data_parallel_size": "dp", "context_parallel_size": "cp", "tensor_parallel_size": "tp",
                 "pipeline_parallel_size": "pp"}
        return " x ".join(f"{short[n]} {v}" for n, v in sizes.items()
                          if n != skip and not (n == "context_parallel_size" and v == 1))

    @property
    def dp_enabled(self) -> bool:
        """Gradients are averaged (and ZeRO can shard) over more than one rank: dp x cp > 1."""
        return self.data_axis_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline_parallel_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.context_parallel_size > 1

    @property
    def data_axis_size(self) -> int:
        """The ranks gradients are averaged over (and ZeRO shards over): dp x cp."""
        return self.data_parallel_size * self.context_parallel_size

    def describe(self) -> str:
        notes = f" (experts over ep {self.expert_parallel_size} within dp)" if self.ep_enabled else ""
        cp = f" x cp {self.context_parallel_size}" if self.cp_enabled else ""
        A = self.context_a2a_size
        if self.cp_enabled and A == self.context_parallel_size:
            notes += " (context: all-to-all of heads)"
        elif self.cp_enabled and A > 1:
            notes += f" (context: all-to-all within {A}, all-gather across {self.context_parallel_size // A})"
        if self.hsdp_enabled:
            notes += (f" (hybrid sharding: {self.data_parallel_replicate_size} replicas x {self.data_shard_size} "
                      "shards)")
        return (
            f"dp {self.data_parallel_size}{cp} x tp {self.tensor_parallel_size} x pp {self.pipeline_parallel_size}"
            f" = {self.world_size} process{'es' if self.world_size > 1 else ''}{notes}"
        )

    def build_mesh(self, device_type: str):
        """The 3-D mesh with axes ("pipeline", "data", "tensor"), LiBai's rank order; its data axis holds dp x cp
        ranks (module docstring)."""
        return init_device_mesh(
            device_type,
            (self.pipeline_parallel_size, self.data_axis_size, self.tensor_parallel_size),
            mesh_dim_names=("pipeline", "data", "tensor"),
        )

    def build_world(self, device_type: str) -> "World":
        """The run's one device mesh (:meth:`build_mesh`) and the named views of its data axis, unflattened from it
        (torchtitan's way: one root mesh, its process groups created once):

        * context parallelism: ("pipeline", "samples", "context", "tensor"), the data axis seen as dp x cp (cp
          inner): the context-parallel groups, and each rank's sample rank;
        * expert parallelism: ("pipeline", "expert_data", "expert", "tensor"), the data axis seen as dp / ep x ep
          (ep inner): the experts' DTensors and their data-parallel units live on it (FSDP2 needs both on one
          root mesh), everything else on the 3-D mesh;
        * hierarchical context parallelism: ("pipeline", "samples", "context_outer", "context_inner", "tensor"),
          the context axis seen as cp / A x A (A inner);
        * hybrid sharding: ("pipeline", "dp_replicate", "dp_shard", "tensor"), the data axis seen as R x dp / R x
          cp; :attr:`World.fsdp_mesh` is this rank's ("dp_replicate", "dp_shard") slice, FSDP2's 2-D mesh.

        Every rank calls this (each view creates its process groups).
        """
        mesh = self.build_mesh(device_type)
        # the data axis by index (1): torch 2.11's _unflatten refuses an axis given by name (fixed in 2.12)
        context = (mesh._unflatten(1, (self.data_parallel_size, self.context_parallel_size),
                                   ("samples", "context")) if self.cp_enabled else None)
        A = self.context_a2a_size
        levels = (context._unflatten(2, (self.context_parallel_size // A, A), ("context_outer", "context_inner"))
                  if 1 < A < self.context_parallel_size else None)
        ep = self.expert_parallel_size
        expert = (mesh._unflatten(1, (self.data_parallel_size // ep, ep), ("expert_data", "expert"))
                  if self.ep_enabled else None)
        R = self.data_parallel_replicate_size
        hsdp = mesh._unflatten(1, (R, self.data_shard_size), ("dp_replicate", "dp_shard")) if R > 1 else None
        fsdp = hsdp["dp_replicate", "dp_shard"] if hsdp is not None else None
        return World(mesh, context, expert, levels, fsdp)


@dataclass
class World:
    """The device meshes of a run, all views of one root mesh (:meth:`ParallelDims.build_world`); the context and
    expert views are None when that parallelism is off."""

    mesh: object  # DeviceMesh ("pipeline", "data", "tensor")
    context_mesh: Optional[object] = None  # ("pipeline", "samples", "context", "tensor")
    expert_mesh: Optional[object] = None  # ("pipeline", "expert_data", "expert", "tensor")
    # hierarchical context parallelism: ("pipeline", "samples", "context_outer", "context_inner", "tensor")
    context_levels_mesh: Optional[object] = None
    # hybrid sharding: this rank's ("dp_replicate", "dp_shard") mesh, what FSDP2 shards over in place of
    # mesh["data"] (dufu.parallel.data_parallel.apply_fsdp); None: FSDP shards over the whole data axis
    fsdp_mesh: Optional[object] = None


CONTEXT_PARALLEL_MODES = ("all_gather", "all_to_all", "hierarchical")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
