"""One training step of the config's model, op by op, on fake tensors.

Forward, loss and backward of a micro-batch run on *fake* CPU tensors (``torch._subclasses.FakeTensorMode``:
shapes and dtypes, no data), under the run's autocast and activation checkpointing: exactly the code dufu runs. A
dispatch mode records every aten op: matrix multiplies with their (m, n, k), fused attention with its shape, every
other op's bytes, and the life of every tensor's storage (created by an op; freed when nothing references it any
more: ``torch._C._storage_Use_Count``). So GQA, untied heads, gated MLPs, T5's cross-attention, Swin's windows and
the fp32 logits of the loss are counted as they run, not as a formula says they might.
Each storage and op is tagged by how tensor parallelism would cut it, by data flow from the parameters (Megatron's
column/row split as torch's ``ColwiseParallel``/``RowwiseParallel`` apply it): ``feat`` (split over the tensor-
parallel ranks: outputs of column-parallel projections, attention heads, vocabulary-parallel logits), ``seq``
(the residual stream: whole on every rank, or split along the sequence under sequence parallelism) and ``rep``
(replicated). The collectives tensor parallelism adds follow from the same record (:class:`LinearCall`): torch
2.13's styles all-reduce a row-parallel output in forward and a column-parallel input's gradient in backward
(three all-reduces for separate Q, K and V); under sequence parallelism the forward all-gathers each
``tensor_parallel_input="replicate"`` module's input and reduce-scatters row-parallel outputs, and the backward
all-gathers those outputs' gradients and still all-reduces the column-parallel inputs' gradients (checked by
counting the ``_c10d_functional`` ops of a traced GPT block on a fake process group).

Transformer blocks of one stack are identical, so only three blocks of each run of alike blocks are traced, the
first, one in the middle that stands for all the middle ones, and the last (a 145B GPT traces in well under a
second; DeepSeek's dense first blocks and its MoE blocks are two runs); runs of three or fewer are traced whole.
Two traces, at micro-batch 2 and 3, make every size a linear function of the micro-batch (tables such as rotary
angles and weight casts do not grow with it).

Mixture-of-experts layers are traced with balanced routing, and under expert parallelism as one rank of ``ep``
(its ``E / ep`` experts, the token exchange stood in for): :mod:`dufu.plan.experts`. Under context parallelism the
step is that of one rank of ``cp`` (its ``T / cp`` tokens, the K/V all-gathers stood in for):
:mod:`dufu.plan.context`.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dufu.layers.attention import Attention as AttentionLayer
from dufu.models.base import contract_of
from dufu.parallel.activation_checkpoint import apply_activation_checkpointing
from dufu.parallel.parallelize_utils import transformer_blocks
from dufu.plan.context import KVGather, split_for_context_parallel
from dufu.plan.experts import expert_modules, localize
from dufu.plan.recorder import Recorder
from dufu.plan.shapes import (AUTOCAST, Attention, ExpertsCall, Gemm, LinearCall, ModelInfo, PartOps, Storage, Trace,
                              shortening)


def _shortened(info: ModelInfo) -> nn.Module:
    """A meta copy of the model keeping only the blocks :func:`dufu.plan.shapes.shortening` keeps."""
    model = info.model
    removed, _ = shortening(model)
    try:
        for cname, items in removed.items():
            container = model.get_submodule(cname)
            for key, _ in items:
                del container[key]
        reduced = copy.deepcopy(model)
    finally:
        for cname, items in removed.items():
            container = model.get_submodule(cname)
            restored = {**{k: m for k, m in container.items()}, **dict(items)}
            order = sorted(restored, key=lambda k: int(k) if k.isdigit() else k)
            container.clear()
            for k in order:
                container[k] = restored[k]
    return reduced


def _to_fake(model: nn.Module, mode) -> None:
    """Give every parameter and buffer of a meta model a fake CPU tensor of its shape (ties kept)."""
    done: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = done[id(p)]
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    # Buffers (rotary frequencies, masks) are computed at build time: the values do not matter.
                    module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)


def get_trace(info: ModelInfo, dtype: str, checkpoint: Optional[str], device: str = "cpu", ep: int = 1,
              cp: int = 1, a2a: int = 1) -> Trace:
    """The traced step of ``info``'s model in ``dtype`` ("fp32", "bf16", "fp16": autocast) with activation
    checkpointing ``checkpoint`` (None, "selective", "full"), as it runs on ``device`` ("cpu" or "cuda"), on one
    rank of ``ep`` expert-parallel ranks (a MoE model's; see :mod:`dufu.plan.experts`) and of ``cp`` context-
    parallel ranks with all-to-alls of heads over ``a2a`` of them (:mod:`dufu.plan.context`); computed once per
    model and variant.

    The devices differ in one kernel choice: with attention dropout, torch's CPU attention falls back to the
    unfused math (the (T, T) scores, softmax and dropout mask materialized), while CUDA's fused kernels
    (FlashAttention, memory-efficient attention) apply dropout inside the kernel from a saved RNG state. A
    "cuda" trace therefore runs attention without dropout, which takes the fused CPU kernel of the same shapes."""
    key = (dtype, checkpoint, device) + ((ep,) if ep != 1 else ()) + ((("cp", cp),) if cp != 1 else ()) + (
        (("a2a", a2a),) if a2a != 1 else ())
    with info.lock:
        if key not in info.traces:
            # micro-batches 2 and 3: at 1 some broadcasts need no reduction (a different op sequence)
            two = _trace_once(info, dtype, checkpoint, 2, device, ep, cp, a2a)
            three = _trace_once(info, dtype, checkpoint, 3, device, ep, cp, a2a)
            trace = _combine(two, three)
            trace.dtype, trace.checkpoint, trace.expert_parallel_size = dtype, checkpoint, ep
            trace.context_parallel_size = cp
            info.traces[key] = trace
        return info.traces[key]


def _trace_once(info: ModelInfo, dtype: str, checkpoint: Optional[str], batch: int, device: str,
                ep: int = 1, cp: int = 1, a2a: int = 1) -> "Recorder":
    reduced = _shortened(info)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _to_fake(reduced, mode)
    contract_of(reduced).tie_weights()
    with mode:
        localize(reduced, ep)  # one expert-parallel rank's experts
    if device == "cuda":
        for module in reduced.modules():
            if isinstance(module, AttentionLayer):
                module.attention_dropout = 0.0  # the fused kernels' dropout keeps no (T, T) tensor (see get_trace)
    rec = Recorder(reduced, mode, ep)
    with mode:
        inputs = info.inputs(batch)
        if cp > 1:  # before checkpointing, as dufu.parallel.parallelize applies them
            inputs = split_for_context_parallel(reduced, inputs, cp, device, a2a)
    if checkpoint:
        _checkpoint(reduced, checkpoint, ep)
    reduced.train()
    with mode:
        rec.install()
        try:
            with rec:
                autocast = (torch.autocast("cpu", dtype=AUTOCAST[dtype]) if dtype in AUTOCAST
                            else torch.autocast("cpu", enabled=False))
                with autocast:
                    out = reduced(**inputs)
                loss = out.loss if hasattr(out, "loss") else out["loss"]
                del out
                rec.end_forward(loss)
                loss.backward()
                rec.end_backward()
        finally:
            rec.remove()
    return rec


def _checkpoint(model: nn.Module, mode: str, ep: int) -> None:
    """Activation checkpointing as :func:`dufu.parallel.parallelize.parallelize` applies it: under expert
    parallelism, selective mode checkpoints the blocks with a MoE layer in full (the others stay selective)."""
    if ep <= 1 or mode != "selective":
        apply_activation_checkpointing(model, mode)
        return
    blocks = transformer_blocks(model)
    moe = [(n, b) for n, b in blocks if expert_modules(b)]
    rest = [(n, b) for n, b in blocks if not expert_modules(b)]
    if moe:
        apply_activation_checkpointing(model, "full", blocks=lambda m: moe)
    if rest:
        apply_activation_checkpointing(model, mode, blocks=lambda m: rest)


def _combine(one: Recorder, two: Recorder) -> Trace:
    """One trace whose sizes are linear in the micro-batch, from traces at micro-batch 2 (``one``) and 3 (``two``):
    every size is kept as (its value at micro-batch 1, its growth per sample)."""
    id_map = _align(one.events, two.events)

    def fit(v2: float, v3: Optional[float], grows: bool = True) -> tuple[float, float]:
        if v3 is None:
            slope = v2 / 2.0 if grows else 0.0
        else:
            slope = v3 - v2
        return (v2 - slope, slope)

    storages = {}
    for sid, s in one.storages.items():
        other = two.storages.get(id_map.get(sid, -1))
        grows = s["category"] == "act"
        v3 = float(other["nbytes"]) if other is not None else None
        storages[sid] = Storage(fit(float(s["nbytes"]), v3, grows), s["kind"], s["category"], s["saved"],
                                s["gathered"], s.get("expert", False))
    ops = {}
    for key, a in one.ops.items():
        b = two.ops.get(key)
        po = PartOps(ops=a.ops, views=a.views, param_ops=a.param_ops)
        for kind in a.traffic:
            for attr in ("traffic", "fused", "heavy"):
                v2 = getattr(a, attr)[kind][0]
                v3 = getattr(b, attr)[kind][0] if b is not None else None
                getattr(po, attr)[kind] = list(fit(v2, v3))
        g3 = b.gemms if b is not None and len(b.gemms) == len(a.gemms) else None
        for i, g in enumerate(a.gemms):
            other = g3[i] if g3 else None

            def grow(name, default_grows):
                v2 = getattr(g, name)[0]
                return fit(v2, getattr(other, name)[0] if other is not None else None, default_grows)

            po.gemms.append(Gemm(grow("m", True), grow("n", False), grow("k", False), grow("batch", False), g.dtype,
                                 g.split, g.phase))
        a3 = b.attention if b is not None and len(b.attention) == len(a.attention) else None
        for i, at in enumerate(a.attention):
            po.attention.append(Attention(fit(at.batch[0], a3[i].batch[0] if a3 else None), at.heads, at.t, at.tk,
                                          at.d, at.causal, at.dtype, at.backward, at.split))
        ops[key] = po
    linears = []
    for i, lc in enumerate(one.linears):
        other = two.linears[i] if len(two.linears) == len(one.linears) else None

        def lin(name):
            return fit(float(lc[name]), float(other[name]) if other is not None else None)

        linears.append(LinearCall(lc["part"], lc["style"], lin("in_bytes"), lin("out_bytes"), lin("grad_in_bytes"),
                                  lc["head"], lc["gathers_input"], lc["recomputed"]))
    boundary = {k: fit(float(v), float(two.boundary[k]) if k in two.boundary else None)
                for k, v in one.boundary.items()}
    experts = []
    for i, call in enumerate(one.experts_calls):
        other = two.experts_calls[i] if len(two.experts_calls) == len(one.experts_calls) else None

        def size(name):
            return fit(float(call[name]), float(other[name]) if other is not None else None)

        experts.append(ExpertsCall(call["part"], size("in_bytes"), size("out_bytes"), call["num_experts"],
                                   call["recomputed"]))
    gathers = []
    for i, call in enumerate(one.kv_gathers):
        other = two.kv_gathers[i] if len(two.kv_gathers) == len(one.kv_gathers) else None
        gathers.append(KVGather(call["part"], call["kind"], fit(float(call["nbytes"]),
                                                               float(other["nbytes"]) if other else None),
                                call["split"], call["backward"], call.get("ranks", 0)))
    parts = ["first"] + [f"block {i}" for i in range(len(one.blocks))] + ["last"]
    return Trace("", None, parts, ops, list(one.events), storages, linears, boundary, one.logits_part, experts,
                 kv_gathers=gathers)


def _align(a: list, b: list) -> dict:
    """Storage ids of trace ``a`` -> the same storages in trace ``b`` (same model, another micro-batch size), matched
    in order within every (part, phase) where the two record the same sequence of allocations and frees."""
    def groups(events):
        out: dict = {}
        for part, phase, sign, sid in events:
            out.setdefault((part, phase), []).append((sign, sid))
        return out

    ga, gb = groups(a), groups(b)
    id_map = {}
    for key, ea in ga.items():
        eb = gb.get(key, [])
        if len(ea) == len(eb) and all(x[0] == y[0] for x, y in zip(ea, eb)):
            for (sign, sid), (_, sid_b) in zip(ea, eb):
                if sign > 0:
                    id_map[sid] = sid_b
        else:
            # allocations matched in order (a reduction present at one size only shifts the frees)
            alloc_a = [sid for sign, sid in ea if sign > 0]
            alloc_b = [sid for sign, sid in eb if sign > 0]
            if len(alloc_a) == len(alloc_b):
                id_map.update(zip(alloc_a, alloc_b))
    return id_map
