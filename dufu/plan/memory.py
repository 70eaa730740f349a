"""Per-rank peak memory of a layout: dufu's mechanisms replayed over the traced step.

What a rank holds at rest (per parameter it owns after tensor/pipeline splitting, fp32 master weights whatever the
compute dtype, as dufu's autocast keeps them):

* parameters 4 B, gradients 4 B, AdamW's two moments 8 B: the 16 B of Rajbhandari et al. 2020's model states
  (2 + 2 + K, K = 12, with fp16 weights and gradients beside fp32 master weights; dufu's split is 4 + 4 + 8).
  Muon (``dufu.optim.Muon``) keeps one momentum buffer (4 B) for the hidden matrices it updates, AdamW's 8 B for
  the rest, and its step orthogonalises each matrix whole (about 20 B per element of the largest one, for a
  moment); SGD keeps one momentum buffer (4 B) or nothing. A
  delta run's frozen parameters (:mod:`dufu.delta`) have no gradient and no moments: those are counted for the
  parameters that train only;
* under ZeRO (FSDP2 ``fully_shard``) all three are shards, 1/dp each (1/(dp x cp) under context parallelism,
  whose ranks hold the same parameters: "dp" below is the data axis, dp x cp; under hybrid sharding, HSDP with
  ``data_parallel_replicate_size`` R, the shards are those of one replica's dp x cp / R ranks). dufu runs stage 1
  with stage-2
  sharding (:mod:`dufu.parallel.data_parallel`), so stages 1 and 2 hold the same;
* every expert of a mixture-of-experts layer (all ``E``, though a token uses ``top_k``); under expert parallelism
  (``ep``) a rank holds ``E / ep`` of them, data-parallel over the ``dp / ep`` ranks of its ``expert_data`` group
  (:mod:`dufu.parallel.expert_parallel`): replicated there, or ZeRO shards of ``1 / (dp / ep)``;
* a last pipeline stage with a tied head keeps its own copy of the embedding (and its gradient and moments); under
  ZeRO-3 without pipelining the output unit keeps a sharded copy (4/dp B per table entry).

What comes and goes, replayed event by event over the traced step (:mod:`dufu.plan.shapes`), scaled to the
layout (tensor-parallel kinds, micro-batch size):

* activations (kept for backward) and temporaries (everything else the step allocates: the fp32 logits and their
  log-softmax, activation gradients, a checkpointed block's recomputation, autocast's low-precision weight copies);
* autocast's low-precision weight copies: a copy a matmul keeps for backward lives until then; the others stay in
  autocast's cache until the forward's autocast region ends (:func:`autocast_caches_weights`), every block's; under
  ZeRO-3 the runtime runs autocast without its cache, so a gathered block's copies go with its forward;
* gradients as autograd creates them, block by block in backward. With ZeRO, FSDP2 reduce-scatters a unit's
  gradient when its backward ends: the full-size gradient is copied into a reduce-scatter input buffer and dropped,
  the rank keeps its shard, and the buffer lives until the next unit's is made (one in flight,
  ``FSDPCommContext.reduce_scatter_states``), so at any moment one unit's full-size gradient and one buffer exist,
  never the blocks' gradients together; while gradients accumulate over micro-batches FSDP2 keeps the full-size
  gradient (``set_requires_gradient_sync(False)``, as dufu's trainer sets it). ``replicate`` (DDP) copies a
  unit's gradient into an all-reduce buffer and, while gradients accumulate, keeps the accumulated one apart from
  the one being computed (measured: 4 B more per parameter);
* under ZeRO with bf16 or fp16, FSDP2 gathers every unit in the compute dtype, 2 B per parameter
  (``train.amp.param_dtype``'s default, :func:`dufu.parallel.data_parallel.mixed_precision_policy`,
  :func:`low_precision_units`): autocast makes no copy of the weights, the full-size gradients are 2 B per
  parameter and their reduce-scatter input 4 B (reduced in fp32), gradients accumulated over micro-batches 4 B;
* communication buffers: FSDP units' gathered parameters (stages 1-2: each block from its forward to its backward,
  the root unit - embeddings, head, final norm - for the whole step; stage 3: a block during its forward (on a
  GPU together with the next one, whose all-gather FSDP2 issues while the host runs ahead), and during its backward
  together with the next one, prefetched; the embedding tables only in forward; the output end from its forward to
  its backward), following :func:`dufu.parallel.data_parallel.apply_fsdp`. Under
  pipeline parallelism torch's stages keep units gathered for the whole step (``set_reshard_after_backward(False)``);
* pipeline in-flight micro-batches: a rank's activations of the micro-batches it has run forward but not yet
  backward: 1F1B stage r holds min(pp - r, m) (Narayanan et al. 2021), GPipe all m, interleaved 1F1B torch's
  warm-up count ((v - 1) * pp + 2 (pp - r - 1), capped at m v) plus one, in chunks of 1/v of the rank's layers;
  the V schedules (rank r holds stages r and 2 pp - 1 - r) pp on every rank (ZB-V, Qi et al. 2024: 1F1B's peak,
  balanced), DualPipeV pp + 1/2 (counted off torch's action lists, a stage's activations kept until its weight
  gradient).

The peak is the largest total over the replay of the first micro-batch (no gradients yet) and of a later one
(gradients of earlier micro-batches present), and the optimizer step. The replay repeats the traced middle block
for every middle block; tensors that outlive their block (autocast's cached copies) are counted once per block.
Checked against measured FSDP2 runs of a 24-layer model (tests/plan/test_plan_fsdp_measured.py) and against the
ZeRO paper's formulas from 7B to 1T parameters (tests/plan/test_plan_zero_scale.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dufu.parallel.pipeline import V_SCHEDULES, layer_stage_ids, rank_stages
from dufu.plan.layout import MULTI_STAGE_SCHEDULES, Layout, Setup
from dufu.plan.optimizer import optimizer_state, optimizer_step_temporaries
from dufu.plan.shapes import ModelInfo, Trace

KEYS = ("parameters", "gradients", "optimizer", "activations", "communication", "pipeline_in_flight", "temporaries")


@dataclass
class RankMemory:
    """The peak of one pipeline rank (every data/tensor-parallel rank of a stage holds the same)."""

    rank: int
    peak: float
    breakdown: dict
    where: str
    parts: list = field(default_factory=list)
    held_params: float = 0.0
    states: dict = field(default_factory=dict)  # model states at rest (the optimizer step): parameters, ...


def rank_parts(info: ModelInfo, layout: Layout, setup: Setup) -> list[list[int]]:
    """The model parts (indices into ``info.parts``) each pipeline rank holds, in forward order."""
    pp, v = layout.pipeline_parallel_size, layout.virtual_pipeline_size
    if pp == 1:
        return [list(range(len(info.parts)))]
    stages = pp * v
    ids = layer_stage_ids(info.num_layers, stages, setup.custom_stage_ids)
    out = []
    for r in range(pp):
        mine = set(rank_stages(layout.pipeline_schedule, pp, r, v))  # looped, or a V (zbv, dualpipev)
        parts = [0] if 0 in mine else []
        parts += [1 + i for i, s in enumerate(ids) if s in mine]
        if stages - 1 in mine:
            parts.append(len(info.parts) - 1)
        out.append(parts)
    return out


def part_elems(info: ModelInfo, p: int, tp: int, ep: int = 1, trainable: bool = False) -> float:
    """Parameters of part ``p`` one rank holds before ZeRO: a ``1 / tp`` share of those tensor parallelism splits,
    ``1 / ep`` of the experts; with ``trainable``, of those that train only (a delta run's)."""
    part = info.parts[p]
    if trainable:
        total, split, experts = part.trainable, part.trainable_tp_split, part.trainable_experts
    else:
        total, split, experts = part.params, part.tp_split, part.experts
    elems = total - split + split / tp
    if experts and ep > 1:
        elems -= experts - experts / ep
    return elems


def expert_elems(info: ModelInfo, parts: list[int], ep: int = 1, trainable: bool = False) -> float:
    """Parameters of MoE experts a rank holding ``parts`` has before ZeRO (``E / ep`` experts per layer); with
    ``trainable``, of those that train only."""
    return sum(info.parts[p].trainable_experts if trainable else info.parts[p].experts for p in parts) / ep


def held_elems(info: ModelInfo, parts: list[int], layout: Layout, trainable: bool = False) -> float:
    """Parameters (with ``trainable``: that train) a pipeline rank holding ``parts`` has before ZeRO, the last
    stage's own copy of a tied embedding included."""
    tp, pp, ep = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.expert_parallel_size
    last = len(info.parts) - 1
    elems = sum(part_elems(info, p, tp, ep, trainable) for p in parts)
    if info.tied and pp > 1 and last in parts and 0 not in parts and (info.tied_trainable or not trainable):
        elems += info.tied_elems / tp  # the last stage's own copy of the tied embedding
    return elems


def owned(nbytes: float, elems: float, experts: float, layout: Layout) -> float:
    """Bytes of ``nbytes`` per parameter the rank owns of the ``elems`` it holds (``experts`` of them MoE
    experts') under the layout's ZeRO: ``1 / dp`` of the others, ``1 / (dp / ep)`` of the experts (sharded over
    ``expert_data``)."""
    if not layout.zero_stage:
        return nbytes * elems
    dp, ep = layout.data_shard_size, layout.expert_parallel_size  # under HSDP, one replica's ranks
    if not experts or ep == 1:
        return nbytes * elems / dp
    return nbytes * (elems - experts) / dp + nbytes * experts / (dp // ep)


def in_flight(layout: Layout, rank: int) -> float:
    """Micro-batches of activations pipeline rank ``rank`` holds at once, in units of its whole share of layers."""
    pp, m, v = layout.pipeline_parallel_size, layout.num_accumulation_steps, layout.virtual_pipeline_size
    if pp == 1:
        return 1.0
    if layout.pipeline_schedule == "gpipe":
        return float(m)
    if layout.pipeline_schedule in V_SCHEDULES:
        # torch's action lists (ScheduleZBVZeroBubble, ScheduleDualPipeV), a stage's activations kept from its
        # forward to its weight gradient: every rank peaks at 2 pp stage-forwards (pp of its whole share), DualPipeV
        # at one more (its paired forward runs before the backward beside it frees)
        return float(min(pp + (0.5 if layout.pipeline_schedule == "dualpipev" else 0.0), m))
    if layout.pipeline_schedule in MULTI_STAGE_SCHEDULES and v > 1:
        rounds = max(1, m // pp)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        return (warmup + 1) / v
    return float(min(pp - rank, m))


class _Units:
    """The FSDP units of one rank's parts and when their parameters are gathered."""

    def __init__(self, info: ModelInfo, parts: list[int], layout: Layout, low: bool = False):
        self.info, self.parts = info, parts
        tp, stage, ep = layout.tensor_parallel_size, layout.zero_stage, layout.expert_parallel_size
        last = len(info.parts) - 1
        self.bytes_of: dict = {}  # unit name -> gathered bytes
        self.unit_of: dict = {}  # part -> unit name
        for p in parts:
            if info.parts[p].kind == "block":
                self.unit_of[p] = f"block{p}"
                # under expert parallelism the block's experts are a unit of their own, gathered with it
                self.bytes_of[f"block{p}"] = 4.0 * part_elems(info, p, tp, ep)
        ends = [p for p in parts if info.parts[p].kind != "block"]
        if stage >= 3:
            first, lastp = info.parts[0], info.parts[last]
            if 0 in parts and first.embedding_unit:
                split = min(first.tp_split, first.embedding_unit)
                self.bytes_of["embeddings"] = 4.0 * (first.embedding_unit - split + split / tp)
            if last in parts and lastp.last_unit:
                split = lastp.last_unit_tp_split
                self.bytes_of["last"] = 4.0 * (lastp.last_unit - split + split / tp)
            rest = sum(4.0 * part_elems(info, p, tp) for p in ends)
            rest -= self.bytes_of.get("embeddings", 0.0)
            if info.tied and "last" in self.bytes_of and 0 in parts:
                rest += 4.0 * info.tied_elems / tp  # the head's weight, counted in the first part, is in "last"
            rest -= self.bytes_of.get("last", 0.0)
            self.bytes_of["root"] = max(rest, 0.0)
            if 0 in parts:
                self.unit_of[0] = "embeddings" if "embeddings" in self.bytes_of else "root"
            if last in parts:
                self.unit_of[last] = "last" if "last" in self.bytes_of else "root"
        else:
            self.bytes_of["root"] = sum(4.0 * part_elems(info, p, tp) for p in ends)
            for p in ends:
                self.unit_of[p] = "root"
        # ``low`` (a bf16 / fp16 run, :func:`low_precision_units`): every unit is gathered in the compute dtype
        self.low: set = set(self.bytes_of) if low else set()
        if low:
            self.bytes_of = {u: n / 2 for u, n in self.bytes_of.items()}


def estimate_memory(info: ModelInfo, trace: Trace, layout: Layout, setup: Setup,
                    asynchronous: bool = False) -> tuple[RankMemory, list]:
    """(the worst rank's peak, every pipeline rank's) for ``layout``; ``asynchronous``: a device whose host runs
    ahead of its kernels (a GPU), where FSDP2 gathers the next unit while the current one computes."""
    ranks = []
    for r, parts in enumerate(rank_parts(info, layout, setup)):
        ranks.append(_rank_memory(info, trace, layout, setup, r, parts, asynchronous))
    worst = max(ranks, key=lambda x: x.peak)
    return worst, ranks


def _storage_bytes(trace: Trace, sid: int, layout: Layout) -> float:
    s = trace.storages[sid]
    b = layout.micro_batch_size
    n = s.nbytes[0] + s.nbytes[1] * (b - 1)
    tp = layout.tensor_parallel_size
    if s.kind == "feat":
        n /= tp
    elif s.kind == "seq" and layout.sequence_parallel and not s.gathered:
        n /= tp
    return max(n, 0.0)


def _rank_memory(info: ModelInfo, trace: Trace, layout: Layout, setup: Setup, rank: int,
                 parts: list[int], asynchronous: bool = False) -> RankMemory:
    tp, dp, pp = layout.tensor_parallel_size, layout.data_axis_size, layout.pipeline_parallel_size
    zero, ep = layout.zero_stage, layout.expert_parallel_size
    m = layout.num_accumulation_steps
    elems, trained = held_elems(info, parts, layout), held_elems(info, parts, layout, trainable=True)
    experts, trained_experts = expert_elems(info, parts, ep), expert_elems(info, parts, ep, trainable=True)
    static = {k: 0.0 for k in KEYS}
    static["parameters"] = owned(4.0, elems, experts, layout)
    static["optimizer"] = sum(owned(nbytes, n, n_experts, layout)  # AdamW's moments, Muon's or SGD's momentum
                              for nbytes, n, n_experts in optimizer_state(info, parts, layout, setup, trained,
                                                                          trained_experts))
    if zero >= 3 and info.tied and pp == 1:
        static["parameters"] += 4.0 * info.tied_elems / tp / layout.data_shard_size  # the output unit's sharded copy
        static["optimizer"] += 0.0  # the copy is left out of the optimizer (TiedCopies)
    units = _Units(info, parts, layout, low=low_precision_units(layout, setup)) if zero else None
    if zero and pp > 1:
        static["communication"] += sum(units.bytes_of.values())  # torch's stages keep units gathered
    cast_cache = trace_dtype_low(setup) and (
        pp > 1 or (m >= 2 and setup.cache_weight_casts and dp == 1))
    if cast_cache:
        static["temporaries"] += sum(_storage_bytes(trace, sid, layout) for sid in _wcast_sids(info, trace, parts))
    events = _events_by_part(trace)
    replay = dict(cast_cache=cast_cache, prefetch_forward=asynchronous, autocast_cache=autocast_caches_weights(layout))
    # pass 1: one micro-batch's saved activations (for the in-flight ones)
    saved_one = _replay(info, trace, layout, parts, events, static, units, accumulated=False, sync=False,
                        inflight=0.0, saved_only=True, **replay)
    recv = 0.0
    if pp > 1 and 0 not in parts:
        first_block = next(p for p in parts if info.parts[p].kind == "block")
        q = info.mapping[first_block] - 1
        bnd = trace.boundary.get(q, (0.0, 0.0))
        recv = bnd[0] + bnd[1] * (layout.micro_batch_size - 1)
        if layout.sequence_parallel:
            recv /= tp
    k = in_flight(layout, rank)
    inflight = max(k - 1.0, 0.0) * (saved_one + recv)
    results = []
    sync_first = m == 1 and pp == 1
    results.append(_replay(info, trace, layout, parts, events, static, units, accumulated=False, sync=sync_first,
                           inflight=inflight, recv=recv, **replay))
    if m >= 2 or pp > 1:
        results.append(_replay(info, trace, layout, parts, events, static, units, accumulated=True,
                               sync=(pp == 1), inflight=inflight, recv=recv, **replay))
    # the optimizer step: model states with the (reduced) gradients of what trains
    opt = dict(static)
    opt["gradients"] = owned(4.0, trained, trained_experts, layout)
    if zero and pp == 1:
        opt["communication"] = 0.0
    opt["temporaries"] += optimizer_step_temporaries(info, parts, setup)
    results.append((sum(opt.values()), opt, "optimizer step"))
    peak, breakdown, where = max(results, key=lambda x: x[0])
    states = {k: opt[k] for k in ("parameters", "gradients", "optimizer")}
    return RankMemory(rank, peak, breakdown, where, parts, elems, states)


def autocast_caches_weights(layout: Layout) -> bool:
    """Whether the run's autocast keeps its cache of low-precision weight copies for the whole forward, as
    ``dufu.engine.runtime.Runtime.autocast`` enters ``torch.autocast``: with the cache, except under ZeRO-3. With
    the cache every block's copy is alive when the forward ends; under ZeRO-3 with fp32 gathers
    (``train.amp.param_dtype=fp32``) that would be a copy of every gathered weight (2 B per parameter of the whole
    model, not of a shard), so the runtime turns it off there. (With the default gathers in the compute dtype the
    weights need no copy at all: :func:`low_precision_units`.)
    Measured: tests/plan/test_plan_fsdp_measured.py."""
    return layout.zero_stage < 3


def low_precision_units(layout: Layout, setup: Setup) -> bool:
    """Whether ZeRO's units are gathered in the compute dtype: a bf16 / fp16 run under ZeRO, with
    ``train.amp.param_dtype`` at its default ("auto"; :func:`dufu.parallel.data_parallel.mixed_precision_policy`).
    Their weights then need no autocast copy, their full-size gradients are in the compute dtype, and they are
    reduced in fp32. (``Setup`` does not carry ``param_dtype``: a run with ``param_dtype=fp32`` is planned as this.)"""
    return bool(layout.zero_stage) and trace_dtype_low(setup)


def trace_dtype_low(setup: Setup) -> bool:
    return setup.dtype in ("bf16", "fp16")


def _wcast_sids(info: ModelInfo, trace: Trace, parts: list[int]) -> list[int]:
    traced = {info.mapping[p] for p in parts}
    sids = []
    count = {}
    for p in parts:
        count[info.mapping[p]] = count.get(info.mapping[p], 0) + 1
    for part, phase, sign, sid in trace.events:
        if sign > 0 and part in traced and trace.storages[sid].category == "wcast" and phase == "fwd":
            sids.extend([sid] * count[part])
    return sids


def _events_by_part(trace: Trace) -> dict:
    if getattr(trace, "_by_part", None) is None:
        by: dict = {}
        born: dict = {}
        died: dict = {}
        for part, phase, sign, sid in trace.events:
            by.setdefault((part, phase), []).append((sign, sid))
            (born if sign > 0 else died)[sid] = (part, phase)
        trace._by_part = by
        trace._born, trace._died = born, died
        trace._segments = {}
    return trace._by_part


_COUNTERS = ("saved", "temp", "wcast", "grad", "held")


def _held_cast(trace: Trace, sid: int) -> bool:
    """A weight cast made in forward that autocast's cache keeps until the forward ends: freed in the forward of
    a later part (in the trace, when the forward's autocast region exits), not kept for backward. Every block makes
    its own, so all of them are alive when the forward ends, however few blocks were traced."""
    born, died = trace._born.get(sid), trace._died.get(sid)
    return (trace.storages[sid].category == "wcast" and born is not None and born[1] == "fwd" and died is not None
            and died[1] == "fwd" and died[0] != born[0])


def _segment(trace: Trace, q: int, phase: str, layout: Layout, cast_cache: bool, accumulated: bool,
             low: bool = False) -> tuple:
    """One traced part's events in one phase, summarised for the replay: (net change per counter, the largest
    excursion of the total above its starting value, the counters at that moment, the part's own gradients, of
    those the MoE experts'). Computed once per traced part, phase and the layout's sizes. Weight casts autocast's
    cache keeps (:func:`_held_cast`) count as ``held`` where they are made, and their frees are left to the end of
    the forward (:func:`_replay`)."""
    key = (q, phase, layout.micro_batch_size, layout.tensor_parallel_size, layout.sequence_parallel, cast_cache,
           accumulated, low)
    cache = trace._segments
    if key in cache:
        return cache[key]
    storages = trace.storages
    run = dict.fromkeys(_COUNTERS, 0.0)
    best, at = 0.0, dict(run)
    expert_grads = 0.0
    for sign, sid in trace._by_part.get((q, phase), ()):
        s = storages[sid]
        n = _storage_bytes(trace, sid, layout)
        if s.category == "wcast":
            if cast_cache or low:  # low: the weights are gathered in the compute dtype, autocast copies nothing
                continue
            if _held_cast(trace, sid):
                if sign < 0:
                    continue  # freed with every other block's when the forward ends
                k = "held"
            else:
                k = "wcast"
        elif s.category == "grad":
            if low:
                n /= 2  # the gradient of a parameter gathered in bf16 / fp16 (traced: fp32's)
            if accumulated:
                if sign > 0:  # added to the accumulated gradient, then freed: a moment's extra
                    value = sum(run.values()) + n
                    if value > best:
                        best, at = value, dict(run)
                        at["temp"] += n
                continue
            k = "grad"
            if s.expert:
                expert_grads += sign * n
        else:
            k = "saved" if s.saved else "temp"
        run[k] += sign * n
        if sign > 0:
            value = sum(run.values())
            if value > best:
                best, at = value, dict(run)
    cache[key] = (dict(run), best, at, run["grad"], expert_grads)
    return cache[key]


def _replay(info, trace, layout, parts, events, static, units, *, accumulated: bool, sync: bool, cast_cache: bool,
            inflight: float, recv: float = 0.0, saved_only: bool = False, prefetch_forward: bool = False,
            autocast_cache: bool = True):
    """Walk one micro-batch's forward and backward over this rank's parts; returns (peak, breakdown, where), or with
    ``saved_only`` the activations kept at the end of the forward.

    FSDP units (ZeRO, see the module docstring) are gathered and freed around each part: under ZeRO-3 a block's
    parameters only for its forward (with ``prefetch_forward``, a GPU's, together with the next block's, whose
    all-gather FSDP2 issues while this one computes) and for its backward (together with the next block's,
    FSDP2's backward prefetch). When a unit's backward ends, its gradients are reduce-scattered
    (:func:`_end_of_backward`)."""
    tp, pp, zero = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.zero_stage
    c = {"saved": 0.0, "temp": 0.0, "wcast": 0.0, "grad": 0.0, "held": 0.0, "comm": 0.0}
    base = dict(static)
    base["pipeline_in_flight"] += inflight
    trained_total = held_elems(info, parts, layout, trainable=True)
    if accumulated:
        base["gradients"] += 4.0 * trained_total  # the full-size gradients of earlier micro-batches
        if units is None and layout.data_axis_size > 1:
            # replicate (DDP on FSDP2) keeps what earlier micro-batches accumulated apart from the gradient being
            # computed, summing them when the unit's backward ends (measured: 4 B more per parameter)
            base["gradients"] += 4.0 * trained_total
    c["comm"] += recv
    base_total = sum(base.values())
    best = [-1.0, None, ""]

    def breakdown(counters: dict, extra: float, extra_key: str) -> dict:
        bd = dict(base)
        bd["activations"] += counters["saved"]
        bd["temporaries"] += counters["temp"] + counters["wcast"] + counters["held"]
        bd["gradients"] += counters["grad"]
        bd["communication"] += counters["comm"]
        bd[extra_key] += extra
        return bd

    def check(where: str, extra: float = 0.0, extra_key: str = "communication") -> None:
        value = base_total + sum(c.values()) + extra
        if value > best[0]:
            best[0], best[1], best[2] = value, breakdown(c, extra, extra_key), where

    gathered: set = set()
    zero_pp = zero and pp > 1

    def gather(unit: str) -> None:
        if units is None or zero_pp or unit in gathered:
            return
        gathered.add(unit)
        c["comm"] += units.bytes_of.get(unit, 0.0)

    def release(unit: str) -> None:
        if units is None or zero_pp or unit not in gathered:
            return
        gathered.discard(unit)
        c["comm"] -= units.bytes_of.get(unit, 0.0)

    part_grads: dict = {}
    expert_grads: dict = {}  # of part_grads, the MoE experts'
    for phase in ("fwd", "bwd"):
        order = parts if phase == "fwd" else list(reversed(parts))
        if phase == "fwd" and units is not None and "root" in units.bytes_of:
            gather("root")
        for idx, p in enumerate(order):
            q = info.mapping[p]
            unit = units.unit_of.get(p) if units is not None else None
            nxt = order[idx + 1] if idx + 1 < len(order) else None
            if unit is not None:
                if phase == "fwd":
                    gather(unit)
                    if prefetch_forward and zero >= 3 and nxt is not None and info.parts[nxt].kind == "block":
                        gather(units.unit_of[nxt])  # FSDP2's all-gather of the next unit, issued ahead
                elif zero >= 3 and unit != "embeddings":
                    gather(unit)
                    if nxt is not None and info.parts[nxt].kind == "block":
                        gather(units.unit_of[nxt])  # FSDP2's backward prefetch of the next unit
            low = units is not None and unit in units.low
            net, excursion, at, grads, experts = _segment(trace, q, phase, layout, cast_cache, accumulated, low)
            if not saved_only and excursion > 0:
                value = base_total + sum(c.values()) + excursion
                if value > best[0]:
                    moment = {k: c[k] + at.get(k, 0.0) for k in c}
                    best[0], best[1] = value, breakdown(moment, 0.0, "communication")
                    best[2] = f"{'forward' if phase == 'fwd' else 'backward'} of {info.parts[p].name}"
            for k, v in net.items():
                c[k] += v
            if grads:
                part_grads[p] = part_grads.get(p, 0.0) + grads
            if experts:
                expert_grads[p] = expert_grads.get(p, 0.0) + experts
            if not autocast_cache:
                c["held"] = 0.0  # without autocast's cache a weight cast is freed once its block's forward ends
            if phase == "fwd" and saved_only and idx == len(order) - 1:
                return c["saved"]
            if phase == "fwd" and unit is not None and zero >= 3 and (
                    unit == "embeddings" or info.parts[p].kind == "block"):
                release(unit)
            if phase == "bwd":
                _end_of_backward(info, layout, p, units, part_grads, c, check, release, sync, accumulated, parts,
                                 expert_grads)
        if phase == "fwd":
            c["held"] = 0.0  # the forward's autocast region ends: its cache of weight casts is dropped
    c["comm"] -= part_grads.pop("reduce-scatter input", 0.0)  # FSDP2's last one, released as backward ends
    if saved_only:
        return c["saved"]
    return best[0], best[1], best[2]


def _end_of_backward(info, layout, p, units, part_grads, c, check, release, sync, accumulated, parts,
                     expert_grads) -> None:
    """What data parallelism does when part ``p``'s backward ends (see the module docstring).

    FSDP2 (ZeRO) copies the unit's full-size gradients into a reduce-scatter input buffer, reduces, keeps this
    rank's shard and drops the full-size gradients; the buffer itself is kept until the next unit's
    reduce-scatter is issued (``FSDPCommContext.reduce_scatter_states``, one buffer in flight by default), so
    one unit's worth of it is alive through the next unit's backward."""
    zero, ep = layout.zero_stage, layout.expert_parallel_size
    dp = layout.data_axis_size if units is None else layout.data_shard_size  # ZeRO keeps a shard of one replica's
    if units is None:
        if dp > 1 and sync:
            # replicate (DDP on FSDP2): the unit's gradient is copied into an all-reduce buffer, and the previous
            # unit's buffer is only released when this one's reduction is issued
            unit_parts = [p] if info.parts[p].kind == "block" else ([q for q in parts if info.parts[q].kind != "block"]
                                                                   if p == min(parts) else [])
            buf = sum(max(part_grads.get(q, 0.0), 0.0) for q in unit_parts)
            if buf:
                check(f"end of the backward of {info.parts[p].name} (all-reduce buffers)",
                      buf + part_grads.get("previous buffer", 0.0))
                part_grads["previous buffer"] = buf
        return
    unit = units.unit_of.get(p)
    block = info.parts[p].kind == "block"
    ends_unit = block or (unit == "root" and p == min(parts)) or unit in ("last", "embeddings") or \
        (unit == "root" and zero < 3 and p == min(parts))
    if not ends_unit:
        return
    if unit == "root":
        members = [q for q in parts if units.unit_of.get(q) == "root"]
    else:
        members = [p]
    if sync:
        tp = layout.tensor_parallel_size
        if accumulated:
            # the last micro-batch: the accumulated full-size gradient (in the replay's base) is reduced
            grads = {q: 4.0 * part_elems(info, q, tp, ep, trainable=True) for q in members}
            experts = {q: 4.0 * info.parts[q].trainable_experts / ep for q in members}
        else:
            grads = {q: max(part_grads.get(q, 0.0), 0.0) for q in members}
            experts = {q: max(expert_grads.get(q, 0.0), 0.0) for q in members}
        held = dict(grads)  # the bytes the full-size gradients take
        if not accumulated and unit in units.low:
            # in the compute dtype (2 B), copied into an fp32 reduce-scatter input, whose shard the rank keeps
            grads = {q: 2.0 * g for q, g in grads.items()}
            experts = {q: 2.0 * e for q, e in experts.items()}
        full = sum(grads.values())
        if full:
            c["comm"] -= part_grads.pop("reduce-scatter input", 0.0)  # the previous unit's buffer is reclaimed
            check(f"end of the backward of {info.parts[p].name} (reduce-scatter)", full)
            c["comm"] += full
            part_grads["reduce-scatter input"] = full
        for q in members:
            g = grads[q]
            e = min(experts[q], g)
            # the experts' shard is 1 / (dp / ep) of their gradients (over expert_data), the rest's 1 / dp
            kept = g / dp if not e or ep == 1 else (g - e) / dp + e / (dp // ep)
            c["grad"] -= held[q] - kept
            if not accumulated:
                part_grads[q] = kept
    if unit != "embeddings" or zero < 3:
        release(unit)
    if zero >= 3 and unit == "last":
        release("last")
