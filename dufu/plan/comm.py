"""What a layout's communication costs: ring collectives over a process group's link, and, per traced part and
micro-batch, the collectives tensor, expert and context parallelism put on the critical path, plus the process
groups data parallelism reduces over. The formulas and their sources are those of :mod:`dufu.plan.timing` (its module
docstring), which adds these times into the step time.
"""

from __future__ import annotations

from dufu.plan.experts import COUNT_BYTES
from dufu.plan.hardware import Hardware
from dufu.plan.layout import Layout
from dufu.plan.memory import expert_elems, part_elems
from dufu.plan.shapes import ModelInfo, Trace, lin


def collective(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of one ring collective of ``nbytes`` (the full tensor) over ``n`` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def group_link(hw: Hardware, size: int, stride: int) -> tuple[float, float]:
    """(bandwidth, latency per step) of a group of ``size`` ranks ``stride`` apart (ranks fill nodes in order)."""
    per_node = hw.devices_per_node
    if size * stride <= per_node:
        return hw.intra_node_bandwidth * hw.comm_efficiency, hw.intra_latency_s
    members_per_node = max(1, per_node // stride)
    bw = min(hw.intra_node_bandwidth, hw.inter_node_bandwidth * members_per_node)
    return bw * hw.comm_efficiency, hw.inter_latency_s


def tp_comm(trace: Trace, q: int, layout: Layout, hw: Hardware, share: float) -> tuple[float, float]:
    """(forward, backward) seconds of tensor-parallel collectives of traced part ``q`` for one micro-batch."""
    tp = layout.tensor_parallel_size
    if tp == 1:
        return 0.0, 0.0
    bw, lat = group_link(hw, tp, 1)
    b, sp = layout.micro_batch_size, layout.sequence_parallel
    fwd = bwd = 0.0
    for lc in trace.linears:
        if lc.part != q:
            continue
        out, inp, grad = lin(lc.out_bytes, b), lin(lc.in_bytes, b), lin(lc.grad_in_bytes, b)
        if lc.style in ("row", "vocab"):
            t = collective("reduce_scatter" if sp else "all_reduce", out, tp, bw, lat)
            if lc.recomputed:
                bwd += t
                continue
            fwd += t
            if sp:
                bwd += collective("all_gather", out, tp, bw, lat)
        elif lc.style == "col":
            gather = collective("all_gather", inp, tp, bw, lat) if sp and (lc.gathers_input or lc.head) else 0.0
            if lc.recomputed:
                bwd += gather
                continue
            fwd += gather
            if sp and lc.head:
                bwd += collective("reduce_scatter", grad, tp, bw, lat)
            else:
                bwd += collective("all_reduce", grad, tp, bw, lat)
    return fwd * share, bwd * share


def ep_comm(trace: Trace, q: int, layout: Layout, hw: Hardware, share: float) -> tuple[float, float]:
    """(forward, backward) seconds of the expert-parallel exchanges of traced part ``q`` for one micro-batch.

    :class:`dufu.parallel.expert_parallel.ExpertDispatch`, per MoE layer: forward, an all-to-all of the ``E``
    token counts, then the rank's token copies out (dispatch) and the experts' outputs back (combine); backward,
    the two again with their gradients. Balanced, a rank keeps ``1 / ep`` of its copies and sends the rest, as
    much as it receives: ``(ep - 1) / ep`` of the bytes each way, pairwise exchanges of ``ep - 1`` steps, priced as
    an all-gather's ring (:func:`collective`) at the link's bandwidth. On gloo that is the all-reduce's rate
    (measured on this project's CPU: ``all_to_all_single`` of 16 MiB between two processes moves its half at
    1.4-1.5 GB/s, as the all-reduce; the all-gather at 0.8). An expert group is ``ep`` neighbouring
    data-parallel ranks (stride ``tp``); under tensor parallelism every TP rank exchanges the whole sequence's
    tokens in its own group. Activation checkpointing repeats the forward's exchanges: under expert parallelism
    dufu checkpoints the blocks with a MoE layer in full even in selective mode (:mod:`dufu.parallel.parallelize`,
    and the trace likewise)."""
    ep = layout.expert_parallel_size
    if ep <= 1 or not trace.experts:
        return 0.0, 0.0
    bw, lat = group_link(hw, ep, layout.tensor_parallel_size)
    b = layout.micro_batch_size
    fwd = bwd = 0.0
    for call in trace.experts:
        if call.part != q:
            continue
        counts = collective("all_to_all", COUNT_BYTES * call.num_experts, ep, bw, lat)
        tokens = (collective("all_to_all", lin(call.in_bytes, b), ep, bw, lat)
                  + collective("all_to_all", lin(call.out_bytes, b), ep, bw, lat))
        if call.recomputed:
            bwd += counts + tokens  # blocks with MoE layers are recomputed in full under expert parallelism
            continue
        fwd += counts + tokens
        bwd += tokens  # the gradients of the combine's and of the dispatch's outputs
    return fwd * share, bwd * share


def data_parallel_groups(info: ModelInfo, parts: list[int], layout: Layout, hw: Hardware,
                         trainable: bool = False) -> list[tuple]:
    """What data parallelism reduces (and ZeRO gathers) for a rank holding ``parts``, by process group:
    [(fp32 bytes, group size, bandwidth, latency per step, FSDP units)]. Without expert parallelism one group of
    ``dp`` ranks holds every parameter; under it, the experts (``1 / ep`` of them per rank) form units of their
    own over the ``dp / ep`` ranks of ``expert_data`` (stride ``ep x tp``), the rest reduces over ``dp``. Under
    context parallelism the group is the data axis, dp x cp ranks (stride tp), which hold the same parameters
    (:class:`dufu.parallel.parallel_dims.ParallelDims`; it refuses cp with ep). ``trainable``: the bytes of what
    trains only, what the gradients' reduction moves (ZeRO gathers every parameter, frozen ones too)."""
    # under HSDP (data_parallel_replicate_size R) ZeRO gathers and reduce-scatters inside one replica's dp x cp / R
    # neighbouring ranks (the shard group, stride tp); the shards' all-reduce across the R replicas is
    # replica_all_reduce's
    tp, dp, pp, ep = (layout.tensor_parallel_size, layout.data_shard_size, layout.pipeline_parallel_size,
                      layout.expert_parallel_size)
    bw, lat = group_link(hw, dp, tp)
    elems = sum(part_elems(info, p, tp, ep, trainable) for p in parts)
    last = len(info.parts) - 1
    if info.tied and pp > 1 and last in parts and 0 not in parts and (info.tied_trainable or not trainable):
        elems += info.tied_elems / tp
    units = sum(1 for p in parts if info.parts[p].kind == "block") + 1
    experts = expert_elems(info, parts, ep, trainable)
    if ep == 1 or not experts:
        return [(4.0 * elems, dp, bw, lat, units)]
    expert_bw, expert_lat = group_link(hw, dp // ep, ep * tp)
    expert_units = sum(1 for p in parts if info.parts[p].experts)
    return [(4.0 * (elems - experts), dp, bw, lat, units),
            (4.0 * experts, dp // ep, expert_bw, expert_lat, expert_units)]


def replica_all_reduce(nbytes: float, units: int, layout: Layout, hw: Hardware) -> float:
    """Seconds of HSDP's all-reduce across replicas of the gradient shards of ``nbytes`` (unsharded fp32) in
    ``units`` FSDP units: each rank's ``1 / S`` shard (S = dp x cp / R) all-reduced over the R ranks at its place
    in the other replicas (stride S x tp; torch's FSDP2 with a 2-D mesh: reduce-scatter over ``dp_shard``, then
    all-reduce over ``dp_replicate``). 0 without HSDP."""
    R, S, tp = layout.data_parallel_replicate_size, layout.data_shard_size, layout.tensor_parallel_size
    if R <= 1:
        return 0.0
    bw, lat = group_link(hw, R, S * tp)
    return collective("all_reduce", nbytes / S, R, bw, 0.0) + units * 2 * (R - 1) * lat


def cp_comm(trace: Trace, q: int, layout: Layout, hw: Hardware, share: float) -> tuple[float, float]:
    """(forward, backward) seconds of the context-parallel collectives of traced part ``q`` for one micro-batch.

    :meth:`dufu.parallel.context_parallel.ContextParallel.attention`, per attention layer: forward, an all-gather
    of K and one of V over the ``cp`` ranks of the group (each output the whole sequence's, as the trace records
    it, :mod:`dufu.plan.context`); backward, a reduce-scatter of each one's gradient; full activation checkpointing
    gathers again when it recomputes the block (selective keeps the gathered tensors): the trace records each
    collective as it is dispatched. The attention waits for its keys, so all of it is on the critical
    path (dufu issues the collective and waits at once). A cp group is ``cp`` neighbouring ranks of the data axis,
    ``tp`` apart (rank order pp, dp, cp, tp): inside a node when ``cp x tp`` ranks fit in one. Under tensor
    parallelism each rank gathers its own heads (``1 / tp`` of the bytes). The all-gather runs at the device's
    all-gather bandwidth where it has a figure of its own (gloo's, measured apart), as ZeRO's gathers do.

    Under the all-to-all modes (``context_parallel_mode``) each attention layer exchanges its q, k and v and later
    its output by all-to-alls over A ranks (A = cp: Ulysses, Jacobs et al. 2023; else hierarchical, inside A
    neighbours, stride tp), each sending ``(A - 1) / A`` of its tensor (the bytes the trace records, priced as the
    all-gather's ring), the same again in backward; the hierarchical mode all-gathers K and V across the cp / A
    groups (stride A x tp). Per rank, layer and direction, in units of the local q's bytes: Ulysses moves
    (2 + 2 nkv' / nh) (cp - 1) / cp (nkv' the key/value heads repeated to a multiple of A), the all-gather mode
    2 (nkv / nh) (cp - 1)."""
    cp = layout.context_parallel_size
    if cp <= 1 or not trace.kv_gathers:
        return 0.0, 0.0
    b, tp, A = layout.micro_batch_size, layout.tensor_parallel_size, layout.context_a2a_size
    # all-to-alls inside A neighbouring cp ranks (stride tp); all-gathers and reduce-scatters across the cp / A
    # groups (stride A x tp; the whole cp group when A = 1)
    a2a_bw, a2a_lat = group_link(hw, A, tp)
    bw, lat = group_link(hw, cp // A, A * tp)
    gather_bw = min(bw, hw.all_gather_bandwidth) if hw.all_gather_bandwidth else bw
    fwd = bwd = 0.0
    for g in trace.kv_gathers:
        if g.part != q:
            continue
        nbytes = lin(g.nbytes, b) / (tp if g.split else 1)
        if g.kind == "all_to_all":
            t = collective("all_to_all", nbytes, A, a2a_bw, a2a_lat)
        else:
            t = collective(g.kind, nbytes, cp // A, gather_bw if g.kind == "all_gather" else bw, lat)
        if g.backward:
            bwd += t
        else:
            fwd += t
    return fwd * share, bwd * share
