"""What a worker of ``benchmarks/context_parallel.py`` attaches to its Trainer (``train.hooks``): the memory and time
of every step, and what autograd saves for the backward during the first, sorted by kind. It changes nothing the
run computes; each rank writes ``rank<R>.json`` to its folder at the end of the run.

* **Step memory**: at ``on_step_start`` the high-water mark of resident memory is reset and ``VmRSS`` read; at
  ``after_optimizer`` (after the step's last collective) ``VmHWM`` is read: the step's peak above what was
  resident before it (weights, optimizer state, data).
* **Saved tensors** (the first step only, a warm-up for the timing): ``torch.autograd.graph.saved_tensors_hooks``
  see every tensor autograd saves, each storage counted once, parameters left out. A tensor saved while a
  context-parallel attention runs is sorted into the whole sequence's keys and values, the causal masks, or the
  rank's own queries, outputs and log-sum-exps (:meth:`SavedTensors.category`); every other one is "the rest".
  That attention runs from its first all-gather of the keys (``ContextParallel.gather`` calls torch's
  ``all_gather_tensor`` of ``torch.distributed._functional_collectives``, which this probe wraps with a marker
  where dufu's context-parallel module calls it) to the attention module's output projection (a forward
  pre-hook on ``out_proj``).
"""

from __future__ import annotations

import time

import torch

from dufu.engine.hooks import Hook
from harness import launch, proc

CATEGORIES = ("gathered K/V", "masks", "attention, local", "rest")


class SavedTensors:
    """Bytes autograd saves for the backward during one step, each storage once, by :data:`CATEGORIES`."""

    def __init__(self):
        self.storages: dict = {}  # data_ptr -> (category, bytes, dtype)
        self.skip: set = set()  # parameters' storages (weights saved for a matmul's backward are not activations)
        self.attention = None  # (head dim, local tokens, chunk) while a context-parallel attention runs

    def category(self, t: torch.Tensor) -> str:
        if self.attention is None:
            return "rest"
        hs, local, chunk = self.attention
        if t.dtype == torch.bool:
            return "masks"
        if t.dim() >= 3 and t.shape[-1] == hs:  # (B, heads, tokens, hs)
            # a chunk's queries and outputs hold `chunk` tokens, the rank's `local`; longer: keys of the sequence
            return "attention, local" if t.shape[-2] in (chunk, local) else "gathered K/V"
        if t.dim() == 3 or t.dim() <= 1:  # (B, heads, chunk): a log-sum-exp; (n,): the gather's token order
            return "attention, local"
        return "masks"  # (chunk, keys) or (B, 1, chunk, keys): boolean, or an additive float made from one

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        try:
            storage = t.untyped_storage()
            storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a DTensor's wrapper)
            return t
        if t.is_leaf and t.requires_grad:  # a weight (a parameter's unsharded copy among them)
            return t
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.storages:
            self.storages[ptr] = (self.category(t), storage.nbytes(), str(t.dtype).replace("torch.", ""))
        return t

    def summary(self) -> dict:
        by = dict.fromkeys(CATEGORIES, 0)
        dtypes: dict = {}
        for cat, nbytes, dtype in self.storages.values():
            by[cat] += nbytes
            if cat == "masks":
                dtypes[dtype] = dtypes.get(dtype, 0) + nbytes
        return {"bytes": by, "total_bytes": sum(by.values()), "mask_bytes_by_dtype": dtypes,
                "tensors": len(self.storages)}


def _local(t):
    """A DTensor's local tensor (parameters under data x context parallelism are DTensors), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _mark_gathers(saved: SavedTensors) -> None:
    """Open ``saved``'s attention scope at the all-gather of a context-parallel attention's keys: (B, heads,
    local tokens, head dim), gathered along the tokens. The gather function is wrapped where
    ``dufu.parallel.context_parallel`` looks it up (its ``_all_gather``, which gathers along dim 0 and reorders
    after the wait; an older module's ``all_gather_tensor`` along dim 2), else in torch's module."""
    import torch.distributed._functional_collectives as funcol

    import dufu.parallel.context_parallel as cp_mod

    name = next((n for n in ("_all_gather", "all_gather_tensor") if hasattr(cp_mod, n)), None)
    owner, name = (cp_mod, name) if name is not None else (funcol, "all_gather_tensor")
    gather = getattr(owner, name)

    def marked(x, gather_dim, *args, **kwargs):
        # K or V: 4-D with more than one token on dim 2 (a gathered additive bias (B|1, 1, 1, T/cp) has one row)
        if saved.attention is None and isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[2] > 1:
            saved.attention = (x.shape[-1], x.shape[2], x.shape[2] // 2)  # (head dim, local tokens, chunk)
        return gather(x, gather_dim, *args, **kwargs)

    setattr(owner, name, marked)


class ActivationProbe(Hook):
    """Step memory and time on every step, the first step's saved tensors by kind (module docstring)."""

    def __init__(self, out_dir: str):
        self.out_dir, self.steps, self.saved = out_dir, [], SavedTensors()
        self._hooks = None

    def on_start(self, trainer) -> None:
        from dufu.layers.attention import Attention

        self.saved.skip = {_local(p).untyped_storage().data_ptr() for part in trainer.model_parts
                           for p in part.parameters()}
        for part in trainer.model_parts:
            for module in part.modules():
                if isinstance(module, Attention) and getattr(module, "context_parallel", None) is not None:
                    module.out_proj.register_forward_pre_hook(self._attention_done)
        _mark_gathers(self.saved)

    def _attention_done(self, module, args) -> None:
        self.saved.attention = None

    def on_step_start(self, trainer) -> None:
        if not self.steps:  # the warm-up step: sort what autograd saves (the timed last step runs without hooks)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, lambda t: t)
            self._hooks.__enter__()
        self._reset = proc.reset_high_water_mark()
        self._rss0 = proc.status_kib("VmRSS")
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()

    def after_optimizer(self, trainer, loss, grad_norm) -> None:
        loss = float(loss)  # a host read: on a GPU the step has ended when it returns
        wall, cpu = time.perf_counter() - self._wall0, time.process_time() - self._cpu0
        hwm, rss1 = proc.status_kib("VmHWM"), proc.status_kib("VmRSS")
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self.steps.append({"rss_before_kib": self._rss0, "hwm_kib": hwm, "rss_after_kib": rss1,
                           "peak_delta_kib": hwm - self._rss0, "hwm_reset": self._reset, "wall_s": wall,
                           "cpu_s": cpu, "loss": loss})

    def on_end(self, trainer, summary) -> None:
        rt = trainer.runtime
        record = {"rank": rt.rank, "cp": rt.dims.context_parallel_size if rt.dims.cp_enabled else 1,
                  "seq_length": rt.seq_length, "steps": self.steps, "saved": self.saved.summary(),
                  "parameters": rt.num_parameters, "threads": torch.get_num_threads()}
        launch.write_rank_file(self.out_dir, rt.rank, record)
