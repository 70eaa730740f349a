"""The candidate layouts a search (:func:`dufu.plan.search.search`) enumerates: every combination of the values
the ``auto`` fields may take (tensor, pipeline and data-parallel sizes whose product is the world size, sequence
parallelism, virtual pipeline stages and their schedule, ZeRO stage, activation checkpointing and, for a model with
mixture-of-experts layers, the expert-parallel size; the context-parallel size), each with the micro-batch sizes to
try, small to large.
"""

from __future__ import annotations

import itertools

from dufu.engine.schema import is_auto
from dufu.engine.validate import resolve_batch_sizes
from dufu.errors import ConfigError, DufuError
from dufu.parallel.pipeline import SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES
from dufu.plan.layout import MULTI_STAGE_SCHEDULES, Layout, Setup
from dufu.plan.shapes import ModelInfo

# The expert-parallel size: searched for MoE models under train.dist.auto=True (or when a config sets it to auto).
EP_KEY = "train.dist.expert_parallel_size"
# The context-parallel size: searched when a config sets it to auto, and under train.dist.auto=True by the rule of
# dufu.plan.search.search (models that support it, sequences its chunks divide, only when cp = 1 leaves a need).
CP_KEY = "train.dist.context_parallel_size"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fixed_int(value, name: str) -> int:
    """``value`` of config key ``name``, which must be an integer (not ``auto``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} = {value!r}: use a positive integer or auto.")
    return value


def pipeline_counts_differ(layout: Layout) -> bool:
    """Whether the micro-batch count alone may make ``validate_layout`` refuse the layout."""
    pp, m = layout.pipeline_parallel_size, layout.num_accumulation_steps
    if pp == 1:
        return False
    schedule = layout.pipeline_schedule
    return m < pp or (schedule in MULTI_STAGE_SCHEDULES and m % pp != 0) or (schedule == "dualpipev" and m < 2 * pp)


def context_parallel_sizes(world_size: int, seq_length: int, every: bool) -> list[int]:
    """The context-parallel sizes to try: every divisor of the world size (``every``: a config's explicit auto,
    those dufu would refuse are then counted with its message), or only those whose 2 x cp load-balanced chunks
    divide the sequence (:func:`dufu.parallel.checks.check_context_parallel`)."""
    return [c for c in _divisors(world_size) if every or seq_length % (2 * c) == 0]


def _degrees(world_size: int, tp, pp, cp, dp_value):
    """(dp, tp, pp, cp) of one combination, the one size that is -1 (or dp left auto) inferred as ParallelDims
    infers it; None when the world size does not divide."""
    if tp == -1 or pp == -1 or cp == -1:
        dp = fixed_int(dp_value, "train.dist.data_parallel_size")  # one of tp/pp/cp inferred: dp must be given
        sizes = [tp, pp, cp]
        known = dp * tp * pp * cp * -1  # the product of the given sizes (exactly one of them is -1)
        if sizes.count(-1) != 1 or known <= 0 or world_size % known:
            return None
        tp, pp, cp = (world_size // known if x == -1 else x for x in sizes)
        return dp, tp, pp, cp
    if dp_value in (None, -1) or is_auto(dp_value):
        known = tp * pp * cp
        return (world_size // known, tp, pp, cp) if known > 0 and world_size % known == 0 else None
    dp = fixed_int(dp_value, "train.dist.data_parallel_size")
    return (dp, tp, pp, cp) if dp * tp * pp * cp == world_size else None


def structures(cfg, world_size: int, autos: list[str], info: ModelInfo, cps=None):
    """Candidate (dp, tp, pp, sp, v, schedule, zero, checkpoint, ep, cp) tuples, micro-batch still open. ``cps``:
    the context-parallel sizes to try (default: the config's, or :func:`context_parallel_sizes` for auto)."""
    t = cfg.train
    d = t.dist

    def options(key: str, fixed, candidates):
        return candidates if key in autos else [fixed]

    tps = options("train.dist.tensor_parallel_size", d.tensor_parallel_size, _divisors(world_size))
    pps = options("train.dist.pipeline_parallel_size", d.pipeline_parallel_size,
                  [p for p in _divisors(world_size) if p <= max(info.num_layers, 1)])
    dps = options("train.dist.data_parallel_size", d.data_parallel_size, [None])
    schedule = d.pipeline_schedule
    zero = t.zero_optimization
    zeros = options("train.zero_optimization.stage", int(zero.stage) if zero.enabled else 0, [0, 2, 3])
    mode = t.activation_checkpoint.mode
    ckpts = options("train.activation_checkpoint.enabled", mode if t.activation_checkpoint.enabled is True else False,
                    [False, mode])
    if cps is None:
        cps = (context_parallel_sizes(world_size, info.seq_length, every=is_auto(d.context_parallel_size))
               if CP_KEY in autos else [d.context_parallel_size])
    for tp, pp, cp, dp_value in itertools.product(tps, pps, cps, dps):
        if any(is_auto(x) for x in (tp, pp, cp)):
            continue
        tp, pp = fixed_int(tp, "train.dist.tensor_parallel_size"), fixed_int(pp, "train.dist.pipeline_parallel_size")
        degrees = _degrees(world_size, tp, pp, fixed_int(cp, CP_KEY), dp_value)
        if degrees is None:
            continue
        dp, tp, pp, cp = degrees
        sps = options("train.dist.sequence_parallel", bool(d.sequence_parallel),
                      [False, True] if tp > 1 else [False])
        if "train.dist.virtual_pipeline_size" in autos and schedule in V_SCHEDULES:
            vs = [2] if pp > 1 else [1]  # a V places exactly two stages on every rank
        elif "train.dist.virtual_pipeline_size" in autos:
            vs = [1] + ([v for v in range(2, 9) if info.num_layers % (pp * v) == 0] if pp > 1 else [])
        else:
            vs = [int(d.virtual_pipeline_size or 1)]
        if EP_KEY in autos:
            eps = info.expert_parallel_sizes(dp)
        else:
            eps = [fixed_int(d.expert_parallel_size, EP_KEY)]
        # the config's hybrid sharding and context-parallel mode (kept as they are: not searched); a searched
        # context-parallel size of 1 has no mode
        R = d.data_parallel_replicate_size
        mode, a2a = d.context_parallel_mode, d.context_parallel_a2a_size
        if cp == 1 and CP_KEY in autos:
            mode, a2a = "all_gather", 1
        searched_zero = "train.zero_optimization.stage" in autos
        for sp, v, z, ck, ep in itertools.product(sps, vs, zeros if dp * cp > 1 else [0], ckpts, eps):
            if is_auto(v):
                continue
            sched = schedule
            if "train.dist.virtual_pipeline_size" in autos:
                if v > 1 and schedule not in MULTI_STAGE_SCHEDULES + V_SCHEDULES:
                    sched = "interleaved_1f1b"
                elif v == 1 and schedule in MULTI_STAGE_SCHEDULES + V_SCHEDULES:
                    sched = "1f1b"
            if searched_zero and ((R > 1 and not z) or (z >= 3 and pp > 1 and sched in SPLIT_BACKWARD_SCHEDULES)):
                continue  # what dufu train refuses: HSDP without ZeRO; a split backward under ZeRO-3
            yield dict(dp=dp, tp=tp, pp=pp, sp=bool(sp), v=int(v), schedule=sched, zero=int(z), ckpt=ck, ep=ep,
                       cp=cp, R=R, cp_mode=mode, a2a=a2a)


def with_micro_batches(cfg, s: dict, autos: list[str], setup: Setup, max_micro: int, rejected: list):
    """The structure's layouts with each micro-batch size to try, small to large."""
    t = cfg.train
    dp = s["dp"]
    global_ = setup.global_batch_size
    if "train.train_micro_batch_size" in autos:
        if global_ is None:
            raise ConfigError(
                "train.train_micro_batch_size=auto needs a fixed global batch to divide: set "
                "train.global_batch_size (e.g. train.global_batch_size=512), so every layout trains the same batch."
            )
        if global_ % dp:
            rejected.append(({"data_parallel_size": dp, "tensor_parallel_size": s["tp"],
                              "pipeline_parallel_size": s["pp"]},
                             f"global batch {global_} is not divisible by data_parallel_size {dp}"))
            return
        micros = [mb for mb in _divisors(global_ // dp) if mb <= max_micro]
    else:
        micros = [fixed_int(t.train_micro_batch_size, "train.train_micro_batch_size")]
    for mb in micros:
        try:
            micro, g, accum = resolve_batch_sizes(mb, global_, setup.num_accumulation_steps
                                                  if global_ is None else None, dp)
        except DufuError as e:
            rejected.append(({"data_parallel_size": dp, "micro_batch_size": mb}, " ".join(str(e).split())))
            continue
        yield Layout(dp, s["tp"], s["pp"], s["sp"], s["v"], s["schedule"], micro, accum, g, s["zero"], s["ckpt"],
                     s["ep"], s.get("cp", 1), s.get("R", 1), s.get("cp_mode", "all_gather"), s.get("a2a", 1))
