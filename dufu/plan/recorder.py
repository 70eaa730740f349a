"""The dispatch mode and module hooks that record a traced training step (see :mod:`dufu.plan.trace`).

Mixture-of-experts layers ask their data how many tokens each expert gets; the dispatch mode answers with the
planner's balanced routing (:mod:`dufu.plan.experts`), and the hooks on experts modules record the bytes an
expert-parallel exchange moves (and, under expert parallelism, stand in for the exchange); both are
:class:`dufu.plan.experts.MoERecording`'s."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dufu.layers.embedding import VocabEmbedding
from dufu.layers.linear import Linear
from dufu.layers.moe import MoE
from dufu.models.base import contract_of
from dufu.parallel.parallelize_utils import transformer_blocks
from dufu.parallel.tensor_parallel import tensor_parallel_plan
from dufu.plan.context import COLLECTIVES
from dufu.plan.experts import MoERecording, expert_modules
from dufu.plan.shapes import (DTYPE_NAMES, Attention, Gemm, PartOps, _ATTENTION, _GEMMS, _HEAVY, _MATERIALIZING,
                              _SKIP)


class Recorder(MoERecording):
    """The dispatch mode (and module hooks) that record a traced step; see the module docstring."""

    def __init__(self, model: nn.Module, mode, ep: int = 1):
        self.model, self.fake_mode = model, mode
        self.blocks = [b for _, b in transformer_blocks(model)]
        self.part = 0
        self.phase = "fwd"
        self.n_parts = len(self.blocks) + 2
        self.ops: dict = {}
        self.events: list = []
        self.storages: dict[int, dict] = {}
        self.live: dict[int, tuple] = {}  # storage _cdata -> (storage object, id)
        self.next_id = 0
        self.kind: dict[int, str] = {}  # storage id -> "rep" | "feat" | "seq"
        self.param_derived: dict[int, bool] = {}
        self.linears: list = []
        self.mem_ops: list = []  # (PartOps, kind, [(storage id or None, bytes, is output)]) of every other op
        self.matmul_touch: set = set()
        self.boundary: dict = {}
        self.module_stack: list = []
        self.handles: list = []
        self.param_storage: dict[int, str] = {}
        self.logits_part = -1
        # mixture of experts: the expert-parallel size traced, the values of the token counts the trace made up
        # (storage -> counts), the MoE layers running, and every experts call (see dufu.plan.experts)
        self.ep = ep
        self.values: dict[int, list] = {}
        self.moe_stack: list = []
        self.experts_calls: list = []
        self.kv_gathers: list = []  # context parallelism's K/V collectives (dufu.plan.context)
        head = contract_of(model).output_head()
        self.head = head
        plan = tensor_parallel_plan(model, False, head=head)
        styled = {}
        for name, style in plan.items():
            styled[id(model.get_submodule(name))] = type(style).__name__
        for mname, module in model.named_modules():
            style = styled.get(id(module))
            for pname, p in module.named_parameters(recurse=False):
                cdata = p.untyped_storage()._cdata
                split = style == "ColwiseParallel" or (style == "RowwiseParallel" and pname == "weight")
                self.param_storage[cdata] = "feat" if split else "rep"
        self._mode = None

    # ---------------------------------------------------------------- module hooks: parts and Linear calls
    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(self._enter_part(1 + i)))
            self.handles.append(block.register_forward_hook(self._leave_block(1 + i)))
            self.handles.append(block.register_full_backward_pre_hook(self._enter_part_bwd(1 + i)))
            self.handles.append(block.register_full_backward_hook(self._leave_part_bwd(1 + i)))
        for module in self.model.modules():
            if isinstance(module, (Linear, VocabEmbedding)) or getattr(module, "tensor_parallel_input", None):
                self.handles.append(module.register_forward_pre_hook(self._push, with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._pop, with_kwargs=True))
            if isinstance(module, MoE):
                self.handles.append(module.register_forward_pre_hook(self._enter_moe))
                self.handles.append(module.register_forward_hook(self._leave_moe))
            if getattr(module, "expert_parallel", False):
                self.handles.append(module.register_forward_pre_hook(self._experts_in))
                self.handles.append(module.register_forward_hook(self._experts_out))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _enter_part(self, index):
        def hook(module, args):
            if self.phase == "fwd":
                self.part = index
                # what the part before hands over: a pipeline stage boundary's point-to-point message
                self.boundary[index - 1] = sum(t.numel() * t.element_size() for t in _leaves(args)
                                               if isinstance(t, torch.Tensor) and t.is_floating_point())
        return hook

    def _leave_block(self, index):
        def hook(module, args, output):
            if self.phase == "fwd" and index == len(self.blocks):
                t = output[0] if isinstance(output, tuple) else output
                if isinstance(t, torch.Tensor):
                    self.boundary[index] = t.numel() * t.element_size()
                self.part = self.n_parts - 1
        return hook

    def _enter_part_bwd(self, index):
        def hook(module, grad_output):
            self.part = index
        return hook

    def _leave_part_bwd(self, index):
        def hook(module, grad_input, grad_output):
            self.part = index - 1
        return hook

    def _push(self, module, args, kwargs):
        self.module_stack.append(module)

    def _pop(self, module, args, kwargs, output):
        self.module_stack.pop()
        if not isinstance(module, (Linear, VocabEmbedding)):
            return
        x = args[0] if args else None
        out = output if isinstance(output, torch.Tensor) else None
        if x is None or out is None:
            return
        if isinstance(module, VocabEmbedding):
            style = "vocab"
        elif module is self.head:
            style = "col"
        else:
            style = getattr(module, "parallel", "data")
        if style not in ("col", "row", "vocab"):
            return
        inside = [m for m in self.module_stack if getattr(m, "tensor_parallel_input", None) == "replicate"]
        owner = inside[-1] if inside else None
        gathers = False
        if owner is not None and style == "col":
            token = (self._step_token, self.phase)
            gathers = getattr(owner, "_dufu_plan_gathered", None) != token
            owner._dufu_plan_gathered = token
        in_bytes = x.numel() * (x.element_size() if x.is_floating_point() else 0)
        grad_bytes = in_bytes
        self.linears.append(dict(part=self.part, style=style, in_bytes=in_bytes,
                                 out_bytes=out.numel() * out.element_size(), grad_in_bytes=grad_bytes,
                                 head=module is self.head, gathers_input=gathers and style == "col",
                                 recomputed=self.phase != "fwd"))
        if module is self.head:
            self.logits_part = self.part

    # ------------------------------------------------------------------------------------- the dispatch mode
    def __enter__(self):
        rec = self
        self._step_token = object()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = rec._data_dependent(func, args, kwargs or {})
                if out is not None:
                    return out
                out = func(*args, **(kwargs or {}))
                rec.record(func, args, kwargs or {}, out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    def _sid(self, t: torch.Tensor) -> Optional[int]:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        entry = self.live.get(s._cdata)
        return entry[1] if entry is not None else None

    def _poll_frees(self) -> None:
        use_count = torch._C._storage_Use_Count
        # the key is the storage's _cdata, kept valid by the storage object the entry holds
        dead = [c for c in self.live if use_count(c) <= 1]
        for c in dead:
            _, sid = self.live.pop(c)
            self.values.pop(c, None)
            self.events.append((self.part, self.phase, -1, sid))

    def _part_ops(self) -> PartOps:
        key = (self.part, self.phase)
        if key not in self.ops:
            self.ops[key] = PartOps()
        return self.ops[key]

    def _in_kind(self, t: torch.Tensor) -> tuple[str, bool]:
        """(tensor-parallel kind, derived from a parameter) of an input tensor."""
        try:
            c = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return "rep", False
        if c in self.param_storage:
            return self.param_storage[c], True
        entry = self.live.get(c)
        if entry is None:
            return "seq", False
        sid = entry[1]
        return self.kind.get(sid, "seq"), self.param_derived.get(sid, False)

    def record(self, func, args, kwargs, out) -> None:
        name = str(func)
        if name in _SKIP:
            return
        self._poll_frees()
        flat_in = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [t for t in _leaves(out) if isinstance(t, torch.Tensor)]
        kinds = [self._in_kind(t) for t in flat_in]
        ops = self._part_ops()
        returns = func._schema.returns
        # a view returns an alias it does not write; an in-place op's alias is written (and moves memory)
        is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        # tensor-parallel kind of the outputs: data flow from the parameters' split
        feat_params = [k for k, p in kinds if p and k == "feat"]
        feat_acts = [k for k, p in kinds if not p and k == "feat"]
        if name in _GEMMS or name in ("aten.embedding.default", "aten.embedding_dense_backward.default"):
            if name == "aten.embedding.default":
                out_kind = "seq"  # a vocabulary-parallel lookup is summed over the TP ranks
            elif name == "aten.embedding_dense_backward.default":
                out_kind = "feat"  # the table's gradient, split like the table (position tables are small)
            elif feat_params and feat_acts:
                out_kind = "seq"  # a contraction over the split dimension: reduced across the TP ranks
            elif feat_params or feat_acts:
                out_kind = "feat"
            else:
                out_kind = "seq" if any(k == "seq" for k, _ in kinds) else "rep"
        elif any(k == "feat" for k, _ in kinds):
            out_kind = "feat"
        elif any(k == "seq" for k, _ in kinds):
            out_kind = "seq"
        else:
            out_kind = "rep"
        # autocast's low-precision copy of a weight (a cast of a parameter)
        derived = name == "aten._to_copy.default" and bool(kinds) and kinds[0][1]
        if name in COLLECTIVES:  # context parallelism's K/V collectives (dufu.plan.context), whole-sequence bytes
            kind = COLLECTIVES[name]
            whole = outs[0] if kind == "all_gather" else flat_in[0]
            ranks = len(args[1]) if kind == "all_to_all" else int(args[1] if kind == "all_gather" else args[2])
            self.kv_gathers.append(dict(part=self.part, kind=kind, backward=self.phase != "fwd", ranks=ranks,
                                        nbytes=whole.numel() * whole.element_size(), split=kinds[0][0] == "feat"))
        if is_view:
            ops.views += 1
        else:
            ops.ops += 1
            if any(p for _, p in kinds):
                ops.param_ops += 1
            if name in _GEMMS:
                self._gemm(name, args, out, kinds, ops)
            elif name in _ATTENTION:
                self._attention(name, args, kwargs, ops, out_kind)
            else:
                io = [(self._sid(t), _nbytes(t, name), False) for t in flat_in]
                self.mem_ops.append((ops, out_kind, io, outs, any(w in name for w in _HEAVY)))
        for t in outs:
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            c = s._cdata
            if c in self.live or c in self.param_storage:
                continue
            sid = self.next_id
            self.next_id += 1
            self.live[c] = (s, sid)
            self.kind[sid] = out_kind
            self.param_derived[sid] = derived
            self.storages[sid] = dict(nbytes=s.nbytes(), kind=out_kind, category="wcast" if derived else "act",
                                      saved=False, gathered=False, op=name)
            self.events.append((self.part, self.phase, +1, sid))
        if name in _GEMMS or name in _ATTENTION or name in _MATERIALIZING:
            for t in flat_in + outs:
                sid = self._sid(t)
                if sid is not None:
                    self.matmul_touch.add(sid)
        if self.mem_ops and self.mem_ops[-1][3] is outs:
            entry = self.mem_ops[-1]
            self.mem_ops[-1] = (entry[0], entry[1], entry[2] + [(self._sid(t), _nbytes(t, name), True) for t in outs],
                                None, entry[4])
        if name in _GEMMS:
            # the activation operand of a projection with a split weight: under SP the kept input is the gathered copy
            for t, (k, p) in zip(flat_in, kinds):
                if not p and k == "seq" and feat_params:
                    sid = self._sid(t)
                    if sid is not None:
                        self.storages[sid]["gathered"] = True

    def _gemm(self, name, args, out, kinds, ops: PartOps) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in ("aten.mm.default",):
            a, b = tensors[0], tensors[1]
            m, k, n, batch = a.shape[0], a.shape[1], b.shape[1], 1
        elif name == "aten.addmm.default":
            a, b = tensors[1], tensors[2]
            m, k, n, batch = a.shape[0], a.shape[1], b.shape[1], 1
        elif name in ("aten.bmm.default", "aten.baddbmm.default"):
            a, b = tensors[-2], tensors[-1]
            batch, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
        else:
            a, b = tensors[0], tensors[1]
            m, k, n, batch = a.shape[0], a.shape[1], b.shape[1], 1
        split = ""
        pkinds = [(kk, p) for kk, p in kinds]
        if any(p and kk == "feat" for kk, p in pkinds):
            split = "k" if any((not p) and kk == "feat" for kk, p in pkinds) else "n"
        elif any(kk == "feat" for kk, p in pkinds):
            split = "n"
        ops.gemms.append(Gemm((m, 0), (n, 0), (k, 0), (batch, 0), DTYPE_NAMES.get(out.dtype, "fp32"), split,
                              self.phase))

    def _attention(self, name, args, kwargs, ops: PartOps, out_kind: str) -> None:
        q, k = args[0], args[1]
        backward = _ATTENTION[name] == "bwd"
        if backward:
            q, k = args[1], args[2]
        causal = bool(kwargs.get("is_causal", False))
        for a in args:
            if isinstance(a, bool):
                causal = causal or a
        B, H, T, D = q.shape
        ops.attention.append(Attention((B, 0), H, T, k.shape[2], D, causal, DTYPE_NAMES.get(q.dtype, "fp32"),
                                       backward, out_kind == "feat"))

    # ----------------------------------------------------------------------------------- phase boundaries
    def end_forward(self, loss) -> None:
        self._poll_frees()
        for c, (s, sid) in self.live.items():
            if self.storages[sid]["category"] == "act":
                self.storages[sid]["saved"] = True
        self.phase = "bwd"
        self.part = self.n_parts - 1

    def end_backward(self) -> None:
        self._poll_frees()
        grads = {p.grad.untyped_storage()._cdata for p in self.model.parameters() if p.grad is not None}
        expert_grads = {p.grad.untyped_storage()._cdata for m in expert_modules(self.model) for p in m.parameters()
                        if p.grad is not None}
        for c, (s, sid) in self.live.items():
            if c in grads:
                self.storages[sid]["category"] = "grad"
                self.storages[sid]["expert"] = c in expert_grads
        self.live.clear()
        born, died = {}, {}
        for part, phase, sign, sid in self.events:
            (born if sign > 0 else died).setdefault(sid, phase)

        def materialized(sid) -> bool:
            if sid is None or sid in self.matmul_touch:
                return True
            s = self.storages[sid]
            return s["saved"] or s["category"] != "act" or (born.get(sid) == "fwd" and died.get(sid) != "fwd")

        for ops, kind, io, _, heavy in self.mem_ops:
            kind = kind if kind in ops.traffic else "seq"
            total = sum(n for _, n, _ in io)
            ops.traffic[kind][0] += total
            ops.fused[kind][0] += sum(n for sid, n, _ in io if materialized(sid))
            if heavy:
                ops.heavy[kind][0] += total


def _nbytes(t: torch.Tensor, op: str) -> float:
    """Bytes an op moves for tensor ``t``: a lookup table's rows read, not the whole table."""
    if op == "aten.embedding.default" and t.dim() == 2 and t.is_floating_point():
        return 0.0  # counted through the output (the rows looked up)
    return float(t.numel() * t.element_size())


def _leaves(obj):
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _leaves(o)
    else:
        yield obj
