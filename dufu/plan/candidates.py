"""The candidate layouts a search (:func:`dufu.plan.search.search`) enumerates: every combination of the values
the ``auto`` fields may take (tensor, pipeline and data-parallel sizes whose product is the world size, sequence
parallelism, virtual pipeline stages and their schedule, ZeRO stage, activation checkpointing and, for a model with
mixture-of-experts layers, the expert-parallel size), each with the micro-batch sizes to try, small to large.
"""

from __future__ import annotations

import itertools

from dufu.config.overrides import is_auto
from dufu.errors import ConfigError, DufuError
from dufu.plan.layout import MULTI_STAGE_SCHEDULES, Layout, Setup
from dufu.plan.shapes import ModelInfo

# The expert-parallel size: searched for MoE models under train.dist.auto=True (or when a config sets it to auto).
EP_KEY = "train.dist.expert_parallel_size"


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
    return m < pp or (layout.pipeline_schedule in MULTI_STAGE_SCHEDULES and m % pp != 0)


def structures(cfg, world_size: int, autos: list[str], info: ModelInfo):
    """Candidate (dp, tp, pp, sp, v, schedule, zero, checkpoint, ep) tuples, micro-batch still open."""
    t = cfg.train
    d = t.dist

    def options(key: str, fixed, candidates):
        return candidates if key in autos else [fixed]

    tps = options("train.dist.tensor_parallel_size", d.get("tensor_parallel_size", 1), _divisors(world_size))
    pps = options("train.dist.pipeline_parallel_size", d.get("pipeline_parallel_size", 1),
                  [p for p in _divisors(world_size) if p <= max(info.num_layers, 1)])
    dps = options("train.dist.data_parallel_size", d.get("data_parallel_size", 1), [None])
    schedule = d.get("pipeline_schedule", "1f1b")
    zero = t.zero_optimization
    zeros = options("train.zero_optimization.stage", int(zero.stage) if zero.enabled else 0, [0, 2, 3])
    mode = t.activation_checkpoint.get("mode", "selective")
    ckpts = options("train.activation_checkpoint.enabled", mode if t.activation_checkpoint.enabled is True else False,
                    [False, mode])
    for tp, pp, dp_value in itertools.product(tps, pps, dps):
        if any(is_auto(x) for x in (tp, pp)):
            continue
        tp, pp = fixed_int(tp, "train.dist.tensor_parallel_size"), fixed_int(pp, "train.dist.pipeline_parallel_size")
        if tp == -1 or pp == -1 or dp_value in (None, -1) or is_auto(dp_value):
            known = tp * pp if tp > 0 and pp > 0 else None
            if known is None:
                # one of tp/pp inferred (-1): the data-parallel size must be given
                dp = fixed_int(dp_value, "train.dist.data_parallel_size")
                rest = world_size // dp if world_size % dp == 0 else 0
                if tp == -1:
                    tp = rest // pp if pp > 0 and rest % pp == 0 else 0
                else:
                    pp = rest // tp if tp > 0 and rest % tp == 0 else 0
                if not tp or not pp:
                    continue
            elif world_size % known:
                continue
            else:
                dp = world_size // known
        else:
            dp = fixed_int(dp_value, "train.dist.data_parallel_size")
            if dp * tp * pp != world_size:
                continue
        sps = options("train.dist.sequence_parallel", bool(d.get("sequence_parallel", False)),
                      [False, True] if tp > 1 else [False])
        if "train.dist.virtual_pipeline_size" in autos:
            vs = [1] + ([v for v in range(2, 9) if info.num_layers % (pp * v) == 0] if pp > 1 else [])
        else:
            vs = [int(d.get("virtual_pipeline_size", 1) or 1)]
        if EP_KEY in autos:
            eps = info.expert_parallel_sizes(dp)
        else:
            eps = [fixed_int(d.get("expert_parallel_size", 1), EP_KEY)]
        for sp, v, z, ck, ep in itertools.product(sps, vs, zeros if dp > 1 else [0], ckpts, eps):
            if is_auto(v):
                continue
            sched = schedule
            if "train.dist.virtual_pipeline_size" in autos:
                if v > 1 and schedule not in MULTI_STAGE_SCHEDULES:
                    sched = "interleaved_1f1b"
                elif v == 1 and schedule in MULTI_STAGE_SCHEDULES:
                    sched = "1f1b"
            yield dict(dp=dp, tp=tp, pp=pp, sp=bool(sp), v=int(v), schedule=sched, zero=int(z), ckpt=ck, ep=ep)


def with_micro_batches(cfg, s: dict, autos: list[str], setup: Setup, max_micro: int, rejected: list):
    """The structure's layouts with each micro-batch size to try, small to large."""
    from dufu.engine.validate import resolve_batch_sizes

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
                     s["ep"])
