"""Step time of a layout: the traced step's ops priced on a device, plus the communication the layout adds.

Per op of the traced step (:mod:`dufu.plan.shapes`), on the rank's share of the work:

* a matrix multiply of (m x k) by (k x n) takes ``2 m n k / (peak x e x f(m) f(n) f(k))``, f(d) = d / (d + d0)
  (or its bytes at memory bandwidth, if more: a roofline):
  ``e`` is how close a large GEMM comes to the dense peak and ``d0`` how fast small dimensions lose efficiency
  (tiles that are not filled, waves that are not whole; Nvidia's "Matrix Multiplication Background" guide);
  tensor parallelism divides n (column-parallel) or k (row-parallel) by tp;
* fused attention (FlashAttention, Dao 2023; torch's SDPA kernels) does 4 B h T Tk d FLOPs forward (halved by a
  causal mask, whose masked blocks the kernels skip) and 2.5 times that backward (it recomputes the scores), at
  ``attention_efficiency`` of the peak times f(T) f(Tk): the kernels tile queries and keys and hold the head
  dimension whole, so a head dimension of 64-160 is not a small matmul dimension (pricing it as one, f(d) = 0.18
  to 0.35 at d0 = 300, made attention 3 to 6 times slower than the kernels run, most of all for the small models
  whose FLOPs are most attention); heads are divided by tp;
* every other op moves its inputs and outputs through memory once: bytes / (bandwidth x efficiency);
* each op costs host time to dispatch (``op_overhead_s``; more for ops on DTensor parameters under tensor
  parallelism). On a GPU the host runs ahead and only the larger of host and device time counts; on a CPU both
  add up.

Communication (:mod:`dufu.plan.comm`; ring algorithms, Thakur et al. 2005; NCCL's bus-bandwidth convention): an
all-reduce of S bytes over n ranks moves 2 (n-1)/n S per rank, an all-gather or reduce-scatter (n-1)/n S, each step
paying a latency. A group inside one node runs at NVLink bandwidth, one across nodes at min(NVLink, k x the per-GPU
network bandwidth) for k members per node (NCCL drives every node's NICs in parallel).

* tensor parallelism: the collectives :class:`dufu.plan.shapes.LinearCall` lists, on the critical path;
* expert parallelism (:func:`dufu.plan.comm.ep_comm`): every MoE layer's token exchange, all-to-alls over the
  ``ep`` ranks of an expert group, on the critical path (the experts wait for their tokens);
* data parallelism: DDP all-reduces the fp32 gradients once per step; ZeRO gathers each FSDP unit's fp32
  parameters (stages 1-2 once per micro-batch, stage 3 in forward and again in backward) and reduce-scatters the
  gradients once per step (on gloo as an in-place all-reduce, :class:`dufu.parallel.data_parallel.
  InPlaceReduceScatter`). On GPUs these overlap the computation (``overlap``; the last unit's reduction cannot);
  under pipeline parallelism torch reduces after the last micro-batch, so nothing hides it. Under expert
  parallelism the experts' ``1 / ep`` share is reduced (and gathered) over the ``dp / ep`` ranks of
  ``expert_data``, everything else over ``dp``;
* context parallelism (:func:`dufu.plan.comm.cp_comm`): every attention layer's K and V all-gathered over the
  ``cp`` ranks of a context group in forward (again when checkpointing recomputes it), their gradients
  reduce-scattered in backward, on the critical path; the computation is that of the traced rank's ``T / cp``
  tokens (:mod:`dufu.plan.context`), and data parallelism's group is the data axis, dp x cp ranks;
* pipeline parallelism: each micro-batch sends its activations forward and their gradients back at every stage
  boundary; 1F1B and GPipe take (m + pp - 1) slots of the slowest stage's forward + backward, interleaved 1F1B
  with v chunks m + (pp - 1) / v (Narayanan et al. 2021, eq. 1 and 2); the V schedules (ZB-V, Qi et al. 2024;
  DualPipeV, DeepSeek-V3's DualPipe cut in half) m + (pp - 1) / 6: torch's action lists leave each rank (pp - 1)
  idle units of a stage's forward (F = I = W, a slot being 6: two stages' F, I and W), the simulated bubble of
  benchmarks/results/pipeline_bubble-2026-11-29.md (2.0% at pp 2, 5.9% at pp 4, 8 micro-batches).

Muon (:func:`muon_step`) streams one momentum buffer for its matrices (4 B read and written less than AdamW), and
adds their Newton-Schulz iterations, whole on every rank, and the all-gathers of the sharded ones' updates; SGD
streams 4 + 4 + 4 read and 4 + 4 written per parameter (no momentum: 4 + 4 and 4).

The optimizer step (fused AdamW, and the gradient-norm clip) streams the rank's parameters, gradients and moments
through memory: 4 + 4 + 8 bytes read and 4 + 8 written per parameter it updates (in a delta run, the delta's only;
data parallelism then reduces the delta's gradients, while ZeRO still gathers every parameter).

On a CPU running several processes, each gets one thread (torchrun's default; ``OMP_NUM_THREADS`` of the planning
process overrides it), and processes beyond the number of cores share them: every time is multiplied by processes /
cores. Computation is multiplied by the calibration factor (:func:`calibration_factor`), and with
``MALLOC_MMAP_THRESHOLD_`` set every large allocation pays its page faults.
"""

from __future__ import annotations

import os

from dufu.config import LazyConfig, resolve_config_path
from dufu.plan.comm import (collective, cp_comm, data_parallel_groups, ep_comm, group_link, replica_all_reduce,
                            tp_comm)
from dufu.plan.cpu import CALIBRATION_BATCH, CALIBRATION_MODEL
from dufu.parallel.pipeline import V_SCHEDULES
from dufu.plan.hardware import Hardware
from dufu.plan.layout import MULTI_STAGE_SCHEDULES, Layout, Setup
from dufu.plan.memory import (_events_by_part, _storage_bytes, expert_elems, owned, part_elems,
                              rank_parts)
from dufu.plan.optimizer import muon_elems
from dufu.plan.shapes import ModelInfo, Trace, build_model_info, lin
from dufu.plan.trace import get_trace


_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class Pricer:
    """Prices the traced ops for one layout on one device."""

    def __init__(self, info: ModelInfo, trace: Trace, layout: Layout, hw: Hardware, world_size: int,
                 compiled: bool = False, calibrate: bool = True):
        self.info, self.trace, self.layout, self.hw = info, trace, layout, hw
        self.compiled = compiled
        self.page_faults = True
        # MALLOC_MMAP_THRESHOLD_ of the planning process (as for the runs it predicts), where the device has a
        # figure for new memory; None: allocations reuse freed memory
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
        self.mmap_threshold = int(threshold) if threshold.isdigit() and hw.page_fault_bandwidth else None
        self.tp = layout.tensor_parallel_size
        self.b = layout.micro_batch_size
        if hw.cores:
            # torchrun gives every worker one thread; one process takes all cores, unless OMP_NUM_THREADS (the
            # planning process's, e.g. a benchmark that pins it for its runs) says otherwise
            omp = os.environ.get("OMP_NUM_THREADS", "")
            self.threads = (min(int(omp), hw.cores) if omp.isdigit() and int(omp) > 0
                            else hw.cores if world_size == 1 else 1)
            self.share = max(1.0, world_size * self.threads / hw.cores)
        else:
            self.threads, self.share = 0, 1.0
        self.rates = hw.rates(self.threads)
        self._cache: dict = {}
        self.calibration = calibration_factor(hw, self.threads) if hw.calibration and calibrate else 1.0

    def rate(self, dtype: str, m: float, n: float, k: float) -> float:
        d0 = self.hw.gemm_half_size
        f = (m / (m + d0)) * (n / (n + d0)) * (k / (k + d0))
        return self.hw.peak(dtype, self.threads) * self.hw.gemm_efficiency * f

    def attention_rate(self, dtype: str, t: float, tk: float) -> float:
        """FLOP/s of fused attention over ``t`` queries and ``tk`` keys: ``attention_efficiency`` of the dense peak,
        less for short sequences (tiles of queries and keys not filled: f(t) f(tk)). Its head dimension is no
        matmul dimension to fill: the kernels hold it whole in every tile (FlashAttention, Dao 2023)."""
        d0 = self.hw.gemm_half_size
        return self.hw.peak(dtype, self.threads) * self.hw.attention_efficiency * (t / (t + d0)) * (tk / (tk + d0))

    def _fresh_pages(self, q: int, phase: str) -> float:
        """Seconds of page faults of traced part ``q``'s ``phase``: with glibc handing large blocks back to the
        system, every traced allocation of at least ``MALLOC_MMAP_THRESHOLD_`` bytes is new memory."""
        if not self.page_faults or self.mmap_threshold is None:
            return 0.0
        fresh = 0.0
        for sign, sid in _events_by_part(self.trace).get((q, phase), ()):
            if sign > 0:
                n = _storage_bytes(self.trace, sid, self.layout)
                fresh += n if n >= self.mmap_threshold else 0.0
        return self.fresh(fresh)

    def fresh(self, nbytes: float) -> float:
        """Seconds of page faults of ``nbytes`` allocated in blocks above ``MALLOC_MMAP_THRESHOLD_`` (0 without it,
        or on a device without page-fault figures)."""
        return 0.0 if self.mmap_threshold is None else nbytes / self.hw.page_fault_bandwidth

    def part(self, q: int, phase: str) -> tuple[float, float]:
        """(compute seconds, FLOPs) of traced part ``q``'s ``phase`` for one micro-batch."""
        key = (q, phase)
        if key in self._cache:
            return self._cache[key]
        ops = self.trace.ops.get(key)
        if ops is None:
            self._cache[key] = (0.0, 0.0)
            return self._cache[key]
        b, tp = self.b, self.tp
        t_dev, flops = 0.0, 0.0
        for g in ops.gemms:
            m, n, k, batch = lin(g.m, b), lin(g.n, b), lin(g.k, b), lin(g.batch, b)
            if g.split == "n":
                n = n / tp
            elif g.split == "k":
                k = k / tp
            f = 2.0 * m * n * k * batch
            flops += f
            # a roofline: a matmul also reads its operands and writes its output (a weight gradient of a few
            # tokens moves more bytes than it computes)
            moved = (m * k + k * n + m * n) * batch * _BYTES.get(g.dtype, 4)
            t_dev += max(f / self.rate(g.dtype, m, n, k), moved / self.rates["stream"])
        for a in ops.attention:
            heads = a.heads / tp if a.split else a.heads
            f = 4.0 * lin(a.batch, b) * heads * a.t * a.tk * a.d
            if a.backward:
                f *= 2.5
            flops += f
            work = f * (0.5 if a.causal and a.t == a.tk else 1.0)
            t_dev += work / self.attention_rate(a.dtype, a.t, a.tk)
        for kind, pair in (ops.fused if self.compiled else ops.traffic).items():
            v, heavy = max(lin(pair, b), 0.0), max(lin(ops.heavy[kind], b), 0.0)
            if self.compiled:  # fused kernels: what remains is memory traffic
                heavy = 0.0
            heavy = min(heavy, v)
            if kind == "feat" or (kind == "seq" and self.layout.sequence_parallel):
                v, heavy = v / tp, heavy / tp
            t_dev += (v - heavy) / self.rates["elementwise"] + heavy / self.rates["transcendental"]
        t_dev += self._fresh_pages(q, phase)
        host = (ops.ops + 0.5 * ops.views) * self.hw.op_overhead_s
        if tp > 1:
            host += ops.param_ops * self.hw.param_op_overhead_s
        t = t_dev + host if self.hw.synchronous else max(t_dev, host)
        self._cache[key] = (t * self.share * self.calibration, flops)
        return self._cache[key]


_CALIBRATION: dict = {}


def calibration_factor(hw: Hardware, threads: int) -> float:
    """Measured / predicted time of the calibration step (:data:`dufu.plan.cpu.CALIBRATION_MODEL`) on one thread:
    what a real step costs beyond the per-op prices, taken to hold on every thread count (one thread's readings
    hold still on a shared machine, several threads' do not). Computed once per device."""
    measured = hw.calibration.get(1) or hw.calibration.get("1")
    if not measured:
        return 1.0
    key = (hw.name, measured)
    if key not in _CALIBRATION:
        cfg = LazyConfig.load(str(resolve_config_path("gpt_debug")))
        b, t = CALIBRATION_BATCH
        cfg.model.update(CALIBRATION_MODEL)
        cfg.dataloader.train.seq_length = t
        info = build_model_info(cfg)
        trace = get_trace(info, "fp32", None, "cpu")
        layout = Layout(1, 1, 1, False, 1, "1f1b", b, 1, b, 0, False)
        pricer = Pricer(info, trace, layout, hw, 2, calibrate=False)
        pricer.threads, pricer.share, pricer.page_faults = 1, 1.0, False  # measured in the probing process
        pricer.rates = hw.rates(1)
        predicted = sum(pricer.part(info.mapping[p], phase)[0] for p in range(len(info.parts))
                        for phase in ("fwd", "bwd"))
        _CALIBRATION[key] = max(1.0, measured / predicted) if predicted > 0 else 1.0
    return _CALIBRATION[key]


def fsdp_copies(nbytes: float, dp: int, zero: int, m: int, gathers: int, pricer: Pricer) -> float:
    """Seconds of FSDP2's own memory traffic in one step for ``nbytes`` of fp32 parameters (the rank's, unsharded):

    * every gather of a unit (ZeRO: ``gathers`` per step) copies the local shard into a new all-gather buffer
      (``nbytes`` new, ``nbytes / dp`` copied) and the gathered data out into new unsharded parameters (``nbytes``
      new and copied); ``replicate`` (DDP) has nothing to gather but still copies the parameters into new
      unsharded ones before each micro-batch's forward;
    * the gradient reduction once per step concatenates the gradients into a new buffer (``nbytes`` new and
      copied); ``replicate`` then copies it into the all-reduce output (``nbytes`` again), ZeRO copies out its
      ``1/dp`` shard.

    A copy reads and writes its bytes (the probe's stream bandwidth counts both). Memory new from the system pays
    its page faults when glibc hands large blocks back (``MALLOC_MMAP_THRESHOLD_``; see :meth:`Pricer.fresh`);
    a GPU's caching allocator reuses its blocks. Read off FSDP2's ``foreach_all_gather``, ``foreach_reduce`` and
    the unshard path of torch 2.13 (``torch/distributed/fsdp/_fully_shard``); on this project's CPU runs these
    copies took a quarter of a ZeRO-3 step, more than the gloo collectives themselves."""
    if dp <= 1:
        return 0.0
    if zero:
        fresh = gathers * 2 * nbytes + nbytes + nbytes / dp
        copied = gathers * (nbytes / dp + nbytes) + nbytes + nbytes / dp
    else:
        fresh = m * nbytes + 2 * nbytes
        copied = m * nbytes + 2 * nbytes
    return 2.0 * copied / pricer.rates["stream"] + pricer.fresh(fresh)


def muon_step(info: ModelInfo, parts: list[int], layout: Layout, setup: Setup, hw: Hardware,
              pricer: Pricer) -> float:
    """Seconds of what Muon adds to the optimizer step of a rank holding ``parts`` (:mod:`dufu.optim.muon`): every
    rank orthogonalises every one of its matrices whole, 5 Newton-Schulz steps of an (A, B) matrix (A <= B): the
    Gram matrix (2 A^2 B FLOPs), its polynomial (2 A^3) and the product with the iterate (2 A^2 B), each priced as a
    matmul of its shape in the Newton-Schulz dtype; before that, one all-gather of each sharded matrix's update
    (fp32): over the ZeRO shard group, and over the tensor-parallel ranks for the matrices they split."""
    dtype = setup.muon_ns_dtype
    if dtype == "auto":  # dufu.optim.muon.ns_dtype_for: bf16 where the device multiplies it fast
        dtype = "bf16" if hw.peak("bf16", pricer.threads) >= 1.5 * hw.peak("fp32", pricer.threads) else "fp32"
    t = 0.0
    for p in parts:
        for a, b in info.parts[p].muon_shapes:
            t += 5 * (2 * (2.0 * a * a * b) / pricer.rate(dtype, a, a, b) + 2.0 * a ** 3 / pricer.rate(dtype, a, a, a))
    t *= pricer.calibration
    tp, S = layout.tensor_parallel_size, layout.data_shard_size
    elems, _ = muon_elems(info, parts, tp, layout.expert_parallel_size)
    if layout.zero_stage and S > 1:
        bw, lat = group_link(hw, S, tp)
        bw = min(bw, hw.all_gather_bandwidth) if hw.all_gather_bandwidth else bw
        t += collective("all_gather", 4.0 * elems, S, bw, lat)
    if tp > 1:
        split = sum(info.parts[p].muon_tp_split for p in parts)
        t += collective("all_gather", 4.0 * split, tp, *group_link(hw, tp, 1))
    return t


def estimate_time(info: ModelInfo, trace: Trace, layout: Layout, setup: Setup, hw: Hardware,
                  world_size: int) -> tuple[dict, dict]:
    """(seconds per optimizer step by part, details) for ``layout``; see the module docstring."""
    pricer = Pricer(info, trace, layout, hw, world_size, compiled=setup.compiled_on(hw))
    # dp: the data axis, dp x cp ranks (context-parallel ranks hold the same parameters and reduce gradients)
    tp, dp, pp, v = (layout.tensor_parallel_size, layout.data_axis_size, layout.pipeline_parallel_size,
                     layout.virtual_pipeline_size)
    m, b = layout.num_accumulation_steps, layout.micro_batch_size
    share = pricer.share
    per_rank = []
    flops_total = 0.0
    p2p_bw, p2p_lat = group_link(hw, 2, dp * tp)
    if pp * dp * tp <= hw.devices_per_node:
        p2p_bw, p2p_lat = hw.intra_node_bandwidth * hw.comm_efficiency, hw.intra_latency_s
    all_parts = rank_parts(info, layout, setup)
    for r, parts in enumerate(all_parts):
        comp_f = comp_b = comm_f = comm_b = ep_f = ep_b = cp_f = cp_b = 0.0
        fl = 0.0
        for p in parts:
            q = info.mapping[p]
            tf, ff = pricer.part(q, "fwd")
            tb, fb = pricer.part(q, "bwd")
            cf, cb = tp_comm(trace, q, layout, hw, share)
            ef, eb = ep_comm(trace, q, layout, hw, share)
            comp_f, comp_b, comm_f, comm_b = comp_f + tf, comp_b + tb, comm_f + cf, comm_b + cb
            ep_f, ep_b = ep_f + ef, ep_b + eb
            kf, kb = cp_comm(trace, q, layout, hw, share)
            cp_f, cp_b = cp_f + kf, cp_b + kb
            fl += ff + fb
        p2p = 0.0
        if pp > 1:
            sends = 0
            for p in parts:
                if info.parts[p].kind == "block" and p - 1 not in parts:
                    bnd = trace.boundary.get(info.mapping[p] - 1, (0.0, 0.0))
                    nbytes = lin(bnd, b) / (tp if layout.sequence_parallel else 1)
                    p2p += 2 * (nbytes / p2p_bw + p2p_lat)  # activation in, its gradient back
                    sends += 1
            p2p *= share
        per_rank.append(dict(compute_f=comp_f, compute_b=comp_b, tp_f=comm_f, tp_b=comm_b, ep_f=ep_f, ep_b=ep_b,
                             cp_f=cp_f, cp_b=cp_b, p2p=p2p, flops=fl))
        flops_total = max(flops_total, fl)
    # the slowest pipeline rank sets the pace
    slot = [r["compute_f"] + r["compute_b"] + r["tp_f"] + r["tp_b"] + r["ep_f"] + r["ep_b"] + r["cp_f"] + r["cp_b"]
            + r["p2p"] for r in per_rank]
    worst = max(range(len(per_rank)), key=lambda i: slot[i])
    w = per_rank[worst]
    t_slot = slot[worst]
    if pp > 1 and layout.pipeline_schedule in V_SCHEDULES:
        # torch's ZB-V / DualPipeV action lists leave each rank idle for (pp - 1) stage-forwards (F = I = W); a
        # slot, the rank's two stages' forward and backward, is 6 of them
        bubble = (pp - 1) * t_slot / 6
    elif pp > 1 and layout.pipeline_schedule in MULTI_STAGE_SCHEDULES and v > 1:
        bubble = (pp - 1) / v * t_slot
    elif pp > 1:
        bubble = (pp - 1) * t_slot
    else:
        bubble = 0.0
    compute = m * (w["compute_f"] + w["compute_b"])
    tp_time = m * (w["tp_f"] + w["tp_b"])
    ep_time = m * (w["ep_f"] + w["ep_b"])
    cp_time = m * (w["cp_f"] + w["cp_b"])
    if ep_time and setup.clip_grad:
        # the gradient norm of the experts' DTensors (dufu.parallel.grads): one more all-reduce of a value, over
        # the ranks their shards span (the expert group; all dp ranks under ZeRO)
        span = dp if layout.zero_stage else layout.expert_parallel_size
        ep_time += collective("all_reduce", 4.0, span, *group_link(hw, span, tp)) * share
    # point-to-point: asynchronous sends overlap the steady state's computation (on GPUs); the pipeline's fill
    # and drain wait for them (already in the bubble's slots)
    p2p = m * w["p2p"] * (1.0 - hw.overlap)
    if bubble and share > 1:
        # More processes than cores: a stage idling in the bubble gives its core to another rank, so the bubble
        # costs only what the critical path adds beyond all ranks' work shared out over the cores (every time
        # above already counts the sharing): max(slots at full speed, busy time shared) - busy time.
        busy = compute + tp_time + ep_time + cp_time + p2p
        bubble = max(0.0, (busy + bubble) / share - busy)
    # data parallelism, per step, on the worst-memory rank's parameters (the largest stage)
    dp_comm = dp_exposed = dp_copies = 0.0
    if dp > 1:
        groups = data_parallel_groups(info, all_parts[worst], layout, hw)
        grads = data_parallel_groups(info, all_parts[worst], layout, hw, trainable=True)  # a delta run: its delta
        units = sum(g[4] for g in groups)
        zero = layout.zero_stage
        gloo = hw.synchronous
        reduce_kind = "all_reduce" if (not zero or gloo) else "reduce_scatter"
        reduce = sum(collective(reduce_kind, nbytes, n, bw, 0.0) + u * 2 * (n - 1) * lat
                     + replica_all_reduce(nbytes, u, layout, hw) for nbytes, n, bw, lat, u in grads)
        gather_one = 0.0
        if zero:
            for nbytes, n, bw, lat, u in groups:
                gather_bw = min(bw, hw.all_gather_bandwidth) if hw.all_gather_bandwidth else bw  # gloo: measured apart
                gather_one += collective("all_gather", nbytes, n, gather_bw, 0.0) + u * (n - 1) * lat
        if zero and pp > 1:
            gathers_fwd, gathers_bwd = 1, (m if zero >= 3 else 0)
        elif zero:
            gathers_fwd, gathers_bwd = m, (m if zero >= 3 else 0)
        else:
            gathers_fwd = gathers_bwd = 0
        reduce *= share
        gather_one *= share
        dp_comm = reduce + gather_one * (gathers_fwd + gathers_bwd)
        # under pipelining torch's stages keep the units unsharded for the whole step: one copy per step
        dp_copies = sum(fsdp_copies(nbytes, n, zero, 1 if pp > 1 else m, gathers_fwd + gathers_bwd, pricer)
                        for nbytes, n, _, _, _ in groups) * share
        if pp > 1:
            # torch's stages reduce after the last micro-batch; gathers overlap the forward
            hidden = hw.overlap * min(gather_one * (gathers_fwd + gathers_bwd), compute)
            dp_exposed = dp_comm - hidden
        else:
            last_unit = 1.0 / units
            fwd_window = m * w["compute_f"]
            bwd_window = m * w["compute_b"]
            g_f, g_b = gather_one * gathers_fwd, gather_one * gathers_bwd
            hidden = hw.overlap * (min(g_f * (1 - last_unit), fwd_window)
                                   + min((g_b + reduce) * (1 - last_unit), bwd_window))
            dp_exposed = max(dp_comm - hidden, 0.0)
    # accumulating gradients over micro-batches adds each new one to the kept one (12 bytes per parameter that
    # trains: a delta run's delta only)
    parts = all_parts[worst]
    ep = layout.expert_parallel_size
    trained = sum(part_elems(info, p, tp, ep, trainable=True) for p in parts)
    compute += (m - 1) * 12.0 * trained / pricer.rates["elementwise"] * share
    # the optimizer step: fused AdamW and the gradient-norm clip stream the owned state of what trains
    mine = owned(1.0, trained, expert_elems(info, parts, ep, trainable=True), layout)
    streamed = 28.0 * mine
    if setup.optimizer == "sgd":
        streamed = (20.0 if setup.sgd_momentum else 12.0) * mine
    elif setup.optimizer == "muon":
        streamed -= 8.0 * owned(1.0, *muon_elems(info, parts, tp, ep), layout)  # one buffer, not two moments
    optimizer = (streamed / pricer.rates["optimizer"]
                 + (4.0 * mine / pricer.rates["elementwise"] if setup.clip_grad else 0.0)
                 + 40 * hw.op_overhead_s) * share
    if setup.optimizer == "muon":
        optimizer += muon_step(info, parts, layout, setup, hw, pricer) * share
    # FSDP2's copies into and out of its communication buffers run on the critical path, between the computation
    step = compute + dp_copies + tp_time + ep_time + cp_time + p2p + bubble + dp_exposed + optimizer
    times = {"compute": compute, "dp_copies": dp_copies, "tp_comm": tp_time, "ep_comm": ep_time, "cp_comm": cp_time,
             "dp_comm": dp_comm,
             "dp_comm_exposed": dp_exposed,
             "bubble": bubble, "p2p": p2p, "optimizer": optimizer}
    details = {"step_time_s": step, "flops_per_rank_step": m * flops_total, "slowest_pipeline_rank": worst,
               "slot_s": t_slot,
               "threads_per_process": pricer.threads, "core_share": share}
    return times, details
