"""Linear layer that carries its tensor-parallel style as data.

The style is LiBai's ``parallel`` argument of ``Linear1D``:

* ``"col"``  – column parallel: the weight is split along the output features
  (Megatron-LM's ColumnParallelLinear, torch ``ColwiseParallel``).
* ``"row"``  – row parallel: the weight is split along the input features and
  the partial outputs are summed (``RowwiseParallel``).
* ``"data"`` – replicated on every tensor-parallel rank (the default).

The layer itself is a plain ``nn.Linear`` on one device; it never talks to
process groups. :func:`dufu.parallel.parallelize` reads ``parallel`` and
applies the matching DTensor plan.
"""

from __future__ import annotations

from torch import nn

PARALLEL_STYLES = ("col", "row", "data")


class Linear(nn.Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        parallel: str = "data",
        device=None,
        dtype=None,
    ):
        if parallel not in PARALLEL_STYLES:
            raise ValueError(f"Linear(parallel={parallel!r}): expected one of {PARALLEL_STYLES}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.parallel = parallel

    def extra_repr(self) -> str:
        return super().extra_repr() + f", parallel={self.parallel}"
