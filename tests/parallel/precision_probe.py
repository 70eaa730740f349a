"""A hook that records the dtypes FSDP's mixed-precision policy leaves in a run (test_loss_parity.py reads them).

While each transformer block runs forward, the dtype of its first weight (FSDP has gathered the block then) and of
its input; the same for the input embedding tables; after every backward, the dtypes of the sharded parameters
and of their gradients. Each rank writes what it saw to ``OUTPUT_DIR/dtypes-rank{R}.json`` at the end of the run.
Attached through ``train.hooks`` (:func:`probe_dtypes`); the workers of tests/parity.py's SharedRuns run from
tests/, so they import this module as ``parallel.precision_probe``.
"""

from __future__ import annotations

import json
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dufu.engine.hooks import Hook
from dufu.parallel.data_parallel import end_units
from dufu.parallel.parallelize_utils import transformer_blocks


def _first_leaf_with_weights(module: nn.Module) -> nn.Module:
    return next(m for m in module.modules() if any(True for _ in m.parameters(recurse=False)))


def _names(dtypes) -> list[str]:
    return sorted({str(d).replace("torch.", "") for d in dtypes})


class RecordDtypes(Hook):
    def __init__(self):
        self.forward: dict[str, dict] = {}  # module -> {"weight": dtype, "input": dtype, "gathered": bool}
        self.sharded: dict[str, list] = {}  # "params" / "grads" -> dtype names of the sharded tensors
        self.output_dir, self.rank = None, 0

    def on_start(self, trainer) -> None:
        rt = trainer.runtime
        self.output_dir, self.rank = rt.output_dir, rt.rank
        for part in rt.model_parts:
            embeddings, _ = end_units(part)
            watched = [(name, _first_leaf_with_weights(block)) for name, block in transformer_blocks(part)]
            watched += [(f"embedding{i}", m) for i, m in enumerate(embeddings)]
            for name, module in watched:
                module.register_forward_pre_hook(partial(self._record, name))

    def _record(self, name: str, module: nn.Module, args) -> None:
        weight = next(module.parameters(recurse=False))
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.forward[name] = {"weight": _names([weight.dtype])[0], "gathered": not isinstance(weight, DTensor),
                              "input": _names([x.dtype])[0] if x is not None and x.is_floating_point() else None}

    def after_backward(self, trainer, local_loss):
        params = [p for part in trainer.runtime.model_parts for p in part.parameters() if p.requires_grad]
        self.sharded = {"params": _names(p.dtype for p in params),
                        "grads": _names(p.grad.dtype for p in params if p.grad is not None),
                        "dtensors": all(isinstance(p, DTensor) for p in params)}
        return None

    def on_end(self, trainer, summary: dict) -> None:
        out = self.output_dir / f"dtypes-rank{self.rank}.json"
        out.write_text(json.dumps({"forward": self.forward, "sharded": self.sharded}, indent=1))


def probe_dtypes() -> str:
    """The override that attaches :class:`RecordDtypes` to a run."""
    return "train.hooks=" + json.dumps([{"_target_": "parallel.precision_probe.RecordDtypes"}])
