"""Fit the constants of ``dufu plan``'s GPU time model to a named subset of published training results, and report
its accuracy on the published results the fit did not use.

    python benchmarks/plan_fit.py                  # fit, evaluate every row, write benchmarks/results/plan_fit-<date>.*
    python benchmarks/plan_fit.py --no-fit         # evaluate every row with the constants dufu/plan/hardware.py holds
    python benchmarks/plan_fit.py --no-fit --tag before   # ... written as plan_fit-<date>-before.*
    python benchmarks/plan_fit.py --dufu-work --tag earlier-check   # every row priced as the earlier check did

About two minutes on two cores (one search per row, then the fit's few hundred re-pricings).

**The constants** are those of :data:`dufu.plan.hardware.GPU_CONSTANTS` (the fields of
:class:`dufu.plan.device.Hardware` that are not published figures): how close a large matmul comes to the dense
peak and how fast small dimensions lose efficiency (``gemm_efficiency``, ``gemm_half_size``), fused attention's
fraction of the peak, the fractions of memory and link bandwidth kernels and collectives reach, the
share of overlappable communication hidden, the host time of an op and the latency of a ring step inside a node
and between nodes. Every one is fitted.

**The rows** (:data:`PUBLISHED`) are published end-to-end training throughputs with their layouts, each with its
source and how sure the mapping to a dufu config is (``certainty``: "high" when every setting the planner needs is
published; "medium" names what is inferred). The fit uses :data:`FIT_ROWS` only: every other row of Table 1 of
Narayanan et al. 2021 (1.7B, 7.5B, 39.1B, 145.6B, 529.6B); every other row is held out. Published results left out
because they cannot be mapped precisely are listed in :data:`LEFT_OUT` with the reason.

**A row's prediction** is the planner's: the row's model as a dufu GPT (learned positions, GELU MLP, vocabulary
padded as published), bf16, full activation recomputation (all these runs recompute; Megatron's FLOP count, eq. 3
of the paper, includes it), the published tensor, pipeline and data-parallel sizes and global batch. What the
source does not publish the planner chooses as ``dufu plan`` would (the fastest predicted layout that fits): the
micro-batch size, and the interleaved schedule's stages per rank where the source says the schedule is
interleaved but not with how many (Megatron supports interleaving from 3 pipeline stages). The search's memory
model does not depend on the constants, so the layouts that fit are found once per row and each trial of the fit
takes the fastest of them.

**The published runs' own work.** The planner prices dufu's step; the published systems did some things with
other kernels or fewer bytes, and a row is priced with what its system did, through the planner's own matmul,
memory and ring models and the same constants (:func:`as_published`). Otherwise the fit would fold those
differences into the device's constants, and they would grow with model size: that was the drift of the earlier
check (predicted / published 1.11 at 1.7B down to 0.86 beyond 300B). (1) Attention: every run here (2021-2022)
computed it unfused, two batched matmuls over all T x T positions around Megatron's fused scale-mask-softmax and
dropout (section 4.2 of Narayanan et al.), where dufu runs a FlashAttention kernel; its share of the FLOPs is
s / (6 h), 15% at 1.7B and 1% at 1T (:func:`unfused_attention`). No row therefore tells the efficiency of dufu's
fused kernels (``attention_efficiency``): the fit leaves it at its prior and says so (posterior sd 1). (2) Tensor
parallelism: Megatron reduces one input gradient per attention and per MLP in the compute dtype, dufu three for
attention (q, k and v projections) and one for the MLP in fp32: twice the bytes, a share of the step that shrinks
as 1 / h. (3) Pipeline sends in the compute dtype, with Megatron's scatter/gather where the paper says it was on.
(4) The schedule: Table 1 ran the interleaved schedule (section 5.1), not 1F1B.

**The fit** is least squares in the log of predicted / published step time (a published TFLOP/s per GPU is turned
into the step time it implies by eq. 3 of Narayanan et al., the count every source here uses), each fit row with a
2% standard deviation (throughputs are published to three digits; run-to-run spread). The fit rows are fewer than
the constants, and several constants act alike on them, so each constant also carries a wide prior centred on the
value dufu used before this fit (:data:`PRIOR`; one unit in the transformed coordinate: the log of a time or size,
the logit of a fraction, which keeps every efficiency below 1): a constant the rows do not determine stays near that
value instead of drifting along a flat valley. The output gives every constant's posterior standard deviation, so
it says which ones the rows determine. The solver is ``scipy.optimize.least_squares`` when scipy is installed;
scipy is not a dependency of dufu, so without it a small Levenberg-Marquardt on numpy (:func:`levenberg_marquardt`,
the same objective) runs instead.

**Output**: the fitted constants (to paste into ``GPU_CONSTANTS``; ``tests/plan/test_plan_heldout.py`` checks that
a fit reproduces them), and per row the published and predicted TFLOP/s per GPU, their ratio and the layout chosen,
fit rows and held-out rows apart; ``benchmarks/results/plan_fit-<date>[-tag].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dufu.config import LazyConfig, resolve_config_path  # noqa: E402
from dufu.plan import search  # noqa: E402
from dufu.plan.hardware import CATALOG, GPU_CONSTANTS  # noqa: E402
from dufu.plan.layout import MULTI_STAGE_SCHEDULES, Layout, setup_from_config  # noqa: E402
from dufu.plan.search import model_info  # noqa: E402
from dufu.plan.shapes import Gemm  # noqa: E402
from dufu.plan.timing import estimate_time  # noqa: E402
from dufu.plan.trace import get_trace  # noqa: E402

MEGATRON_2021 = ("Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU Clusters Using "
                 "Megatron-LM\" (SC21, arXiv:2104.04473)")
MT_NLG = ("Smith et al. 2022, \"Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B\" (arXiv:2201.11990), "
          "section 2.4, and the Microsoft/NVIDIA blog post of 2021-10-11")
BLOOM = ("BigScience tr11-176B-ml (BLOOM), github.com/bigscience-workshop/bigscience train/tr11-176B-ml: README "
         "(log line of iteration 85376) and tr11-176B-ml.slurm")

# BLOOM's cluster (Jean Zay, gpu_p5): A100 SXM4 80GB, 8 per node, 4 Omni-Path 100 Gb/s links per node (README,
# "Hardware"): 50 GB/s per node, 6.25 GB/s per GPU between nodes.
JEAN_ZAY = dataclasses.replace(CATALOG["a100-80gb"], name="a100-80gb-jean-zay", inter_node_bandwidth=6.25e9,
                               description="A100 SXM4 80GB, 8 per node, 4 x 100 Gb/s Omni-Path per node",
                               source="BigScience tr11-176B-ml README (hardware)")
DEVICES = {"a100-80gb": CATALOG["a100-80gb"], "a100-80gb-jean-zay": JEAN_ZAY}


@dataclass(frozen=True)
class Published:
    """One published training run: the model, the layout, and its throughput (TFLOP/s per GPU as eq. 3 of
    Narayanan et al. counts them) or iteration time."""

    key: str
    source: str  # paper or repository, table / figure / line
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    tflops: Optional[float] = None  # published TFLOP/s per GPU
    step_s: Optional[float] = None  # published seconds per iteration
    seq: int = 2048
    vocab: int = 51200
    micro: Optional[int] = None  # published micro-batch size; None: not published, the planner chooses
    schedule: str = "1f1b"  # "1f1b", "interleaved" (stages per rank not published: the planner chooses >= 2), "any"
    zero: int = 0
    stage_ids: Optional[tuple] = None  # a published uneven layer -> stage assignment
    device: str = "a100-80gb"
    attention: str = "unfused"  # as Megatron-LM computed it until 2022 (:func:`unfused_attention`), or "fused"
    p2p: str = "plain"  # pipeline sends; "scatter_gather": Megatron's section 4.1, each tp rank sends 1/tp of them
    certainty: str = "high"
    note: str = ""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def flops(self) -> float:
        """FLOPs per iteration as eq. 3 of Narayanan et al. 2021 counts them (matmuls, recomputation included)."""
        b, s, l, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    def published_step_s(self) -> float:
        return self.step_s if self.step_s is not None else self.flops() / (self.gpus * self.tflops * 1e12)

    def published_tflops(self) -> float:
        return self.tflops if self.tflops is not None else self.flops() / (self.gpus * self.step_s) / 1e12


def _t1(params, heads, hidden, layers, tp, pp, gpus, batch, tflops, **kw) -> Published:
    # Table 1 (section 5.1): "we use the interleaved pipeline schedule with the scatter/gather optimization
    # enabled"; Megatron-LM does not interleave 2 stages (its README), so pp 2 runs 1F1B.
    return Published(f"megatron21-t1-{params}B", MEGATRON_2021 + ", Table 1", params, heads, hidden, layers, tp, pp,
                     gpus, batch, tflops=tflops, schedule="interleaved" if pp > 2 else "1f1b", p2p="scatter_gather",
                     **kw)


def _t2(params, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Published:
    return Published(f"megatron21-t2-{params}B-{gpus}", MEGATRON_2021 + ", Table 2 (PTD parallelism)", params,
                     heads, hidden, layers, tp, pp, gpus, batch, tflops=tflops, micro=1, schedule="any",
                     p2p="scatter_gather", certainty="medium",
                     note=f"model-parallel size {tp * pp} published, taken as tp {tp} x pp {pp} (Table 1's rule: tp = "
                          "the 8 GPUs of a node); the schedule is not stated for Table 2: the planner chooses; "
                          "scatter/gather sends as in Table 1")


PUBLISHED: list[Published] = [
    _t1(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _t1(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    _t1(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    _t1(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    _t1(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    _t1(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _t1(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _t1(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _t1(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _t1(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    _t2(174.6, 96, 12288, 96, 8, 12, 384, 1536, 153),
    _t2(174.6, 96, 12288, 96, 8, 12, 768, 1536, 149),
    _t2(174.6, 96, 12288, 96, 8, 12, 1536, 1536, 141),
    _t2(529.6, 128, 20480, 105, 8, 35, 560, 2240, 171),
    _t2(529.6, 128, 20480, 105, 8, 35, 1120, 2240, 167),
    _t2(529.6, 128, 20480, 105, 8, 35, 2240, 2240, 159),
    *[Published(f"mt-nlg-530B-{gpus}", MT_NLG, 529.6, 128, 20480, 105, 8, 35, gpus, 1920, step_s=step,
                schedule="1f1b", certainty="medium",
                note="tensor 8 x pipeline 35 and the iteration times are published; DeepSpeed's pipeline engine runs "
                     "1F1B; the micro-batch size is not published: the planner chooses; vocabulary GPT-2's, padded "
                     "to 51,200 as Megatron pads it for tp 8")
      for gpus, step in ((2240, 60.1), (2800, 50.2), (3360, 44.4))],
    Published("bloom-176B", BLOOM, 176.2, 112, 14336, 70, 4, 12, 384, 2048, step_s=104.70, vocab=250880, micro=2,
              schedule="1f1b", zero=1, stage_ids=tuple([0] * 5 + [s for s in range(1, 11) for _ in range(6)]
                                                       + [11] * 5),
              device="a100-80gb-jean-zay", certainty="medium",
              note="layout, micro-batch, batch, vocabulary (250,880 padded), partition (5, 6 x 10, 5 layers: the "
                   "tied embedding counted as a layer) and 104.70 s per iteration (149.77 TFLOP/s) are published; "
                   "BLOOM used ALiBi through Megatron's fused softmax, not a fused attention kernel, and its "
                   "bf16 optimizer's ZeRO-1 (dufu: stage 1); network 4 x 100 Gb/s Omni-Path per node"),
]

# Held-out rows by source (the summary's groups): key prefix.
GROUPS = {"Megatron-LM 2021 Table 1": "megatron21-t1-", "Megatron-LM 2021 Table 2": "megatron21-t2-",
          "MT-NLG (DeepSpeed)": "mt-nlg-", "BLOOM (Megatron-DeepSpeed)": "bloom-"}

# Fitted on these; every other row is held out.
FIT_ROWS = ("megatron21-t1-1.7B", "megatron21-t1-7.5B", "megatron21-t1-39.1B", "megatron21-t1-145.6B",
            "megatron21-t1-529.6B")

LEFT_OUT = {
    "Megatron-LM 2021 Table 2, ZeRO-3 rows": "DeepSpeed's ZeRO-3 gathers fp16 parameters, dufu's FSDP2 fp32 ones; "
        "the planner prices dufu's, so the rows would measure the implementations' difference, not the model",
    "OPT-175B (Zhang et al. 2022: 147 TFLOP/s per GPU on 992 A100 80GB)": "published as 'up to'; the global batch "
        "(about 2M tokens) does not divide the 124 data-parallel ranks and the FLOP count is not stated",
    "Llama 3 405B (Llama 3 Herd of Models, Table 4: 430 / 400 / 380 TFLOP/s per H100)": "the FLOP count behind the "
        "MFU is not stated, and the runs use a modified interleaved schedule, uneven first and last stages and "
        "FSDP variants the planner does not model",
    "Korthikanti et al. 2022 (sequence parallelism, MFU 41.5-56.3%)": "layouts and batch sizes of the MFU table "
        "could not be confirmed from a source at hand",
}

BY_KEY = {r.key: r for r in PUBLISHED}

# Every fitted field of Hardware, how it is transformed for the fit (log: a positive size or time; logit: a
# fraction in (0, 1)) and its bounds.
TRANSFORMS = {
    "gemm_efficiency": "logit", "gemm_half_size": "log", "attention_efficiency": "logit",
    "memory_efficiency": "logit", "comm_efficiency": "logit", "overlap": "logit", "op_overhead_s": "log",
    "intra_latency_s": "log", "inter_latency_s": "log",
}
# The centres of the priors: the values dufu used before this fit (hand-set), but for gemm_efficiency, which was
# 1.0: as a fraction of the peak it is fitted in the logit, whose centre must lie below 1 (0.9; the prior is wide).
PRIOR = {"gemm_efficiency": 0.9, "gemm_half_size": 300.0, "attention_efficiency": 0.45, "memory_efficiency": 0.9,
         "comm_efficiency": 0.9, "overlap": 0.9, "op_overhead_s": 6e-6, "intra_latency_s": 2e-6,
         "inter_latency_s": 6e-6}
PRIOR_SD = 1.0  # in the transformed coordinate
ROW_SD = 0.02  # log of predicted / published step time
SIGNIFICANT = 3  # digits the constants are written with


def _to_z(name: str, x: float) -> float:
    if TRANSFORMS[name] == "log":
        return math.log(x)
    x = min(max(x, 1e-6), 1 - 1e-6)
    return math.log(x / (1 - x))


def _from_z(name: str, z: float) -> float:
    if TRANSFORMS[name] == "log":
        return math.exp(z)
    return 1.0 / (1.0 + math.exp(-z))


def rounded(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT}g}")


def row_config(row: Published):
    cfg = LazyConfig.load(str(resolve_config_path("gpt2_small")))
    overrides = [
        f"model.vocab_size={row.vocab}", f"model.hidden_size={row.hidden}", f"model.num_attention_heads={row.heads}",
        f"model.num_layers={row.layers}", f"model.max_position_embeddings={row.seq}",
        f"dataloader.train.seq_length={row.seq}", f"train.global_batch_size={row.batch}",
        f"train.train_micro_batch_size={row.micro if row.micro else 'auto'}",
        "train.activation_checkpoint.enabled=True", "train.activation_checkpoint.mode=full",
        f"train.dist.tensor_parallel_size={row.tp}", f"train.dist.pipeline_parallel_size={row.pp}",
        f"train.dist.data_parallel_size={row.dp}",
        f"train.zero_optimization.enabled={bool(row.zero)}",
    ]
    if row.zero:
        overrides.append(f"train.zero_optimization.stage={row.zero}")
    if row.pp > 1 and row.schedule in ("interleaved", "any"):
        overrides.append("train.dist.virtual_pipeline_size=auto")
    if row.stage_ids:
        overrides.append(f"train.dist.custom_pipeline_stage_id={list(row.stage_ids)}")
    return LazyConfig.apply_overrides(cfg, overrides)


@dataclass
class Candidates:
    """What a row's prediction needs: the model, its setup, and the layouts the planner chooses among."""

    row: Published
    info: object
    setup: object
    layouts: list
    fits: bool  # False: no layout fits in dufu's memory model (every valid one is kept)
    work: str = "published"  # "published": as_published; "dufu": the row priced with dufu's own work
    published: dict = dataclasses.field(default_factory=dict)  # id(trace) -> its as_published copy


def candidates(row: Published, work: str = "published") -> Candidates:
    """The layouts of ``row`` the planner may choose (those that fit, with the published schedule). ``work="dufu"``
    prices the row as the earlier check did: dufu's own work, and 1F1B."""
    if work == "dufu":
        row = dataclasses.replace(row, schedule="1f1b")
    cfg = row_config(row)
    hw = DEVICES[row.device]
    plan = search(cfg, row.gpus, hw)
    ok = [e for e in plan if _allowed(row, e.layout)]
    if not ok:
        raise RuntimeError(f"{row.key}: the planner finds no valid layout ({plan.rejected[:1]})")
    fitting = [e for e in ok if e.fits]
    chosen = fitting or ok
    return Candidates(row, model_info(cfg), setup_from_config(cfg, hw), [Layout(**e.layout) for e in chosen],
                      bool(fitting), work)


def _allowed(row: Published, layout: dict) -> bool:
    interleaved = layout["pipeline_schedule"] in MULTI_STAGE_SCHEDULES
    if row.schedule == "interleaved" and row.pp > 2:
        return interleaved
    if row.schedule == "1f1b":
        return not interleaved
    return True


# Bytes per score element of Megatron's attention around its two batched matmuls (bf16 scores, one-byte dropout
# mask): forward, the fused scale-mask-softmax reads and writes them (4) and dropout reads them and writes the
# dropped scores and the mask (5); backward, dropout's backward reads the gradient and the mask and writes (5) and
# the softmax's backward reads the gradient and the probabilities and writes (6).
_SCORE_BYTES = {False: 9.0, True: 11.0}


def as_published(trace, row: Published):
    """``trace`` with the work the published system did where it differs from dufu's and the difference is one of
    bytes or kernels, not of the device: attention computed unfused (:func:`unfused_attention`); tensor
    parallelism as Megatron-LM communicates it (per block forward the two row-parallel outputs, as dufu; backward
    one all-reduce of the input gradient per attention and per MLP, in the compute dtype, where dufu reduces those
    of the q, k and v projections apart, in fp32, the dtype of the LayerNorm output they take under autocast);
    pipeline sends in the compute dtype (dufu's residual stream is fp32), with scatter/gather 1/tp of them per
    rank."""
    if row.attention == "unfused":
        trace = unfused_attention(trace, row.tp)
    low = trace.dtype in ("bf16", "fp16")
    half = 0.5 if low else 1.0
    linears = []
    for lc in trace.linears:
        if lc.style == "col" and not lc.head and not lc.gathers_input:
            continue  # k_proj, v_proj: Megatron's fused QKV projection reduces one input gradient for all three
        if lc.style == "col":
            lc = dataclasses.replace(lc, grad_in_bytes=tuple(half * x for x in lc.grad_in_bytes))
        elif lc.style == "vocab":
            lc = dataclasses.replace(lc, out_bytes=tuple(half * x for x in lc.out_bytes))
        linears.append(lc)
    scale = half / (row.tp if row.p2p == "scatter_gather" else 1)
    boundary = {k: tuple(scale * x for x in v) for k, v in trace.boundary.items()}
    return dataclasses.replace(trace, linears=linears, boundary=boundary)


def unfused_attention(trace, tp: int):
    """``trace`` with every fused attention call replaced by the work of unfused attention: forward the scores
    Q K^T and the output P V over all T x Tk positions (the causal mask is applied to the scores, no block is
    skipped), backward the four matmuls of their gradients, each a batched matmul the planner prices like any
    other; and the score tensors' memory traffic (:data:`_SCORE_BYTES`). Heads split by tensor parallelism are
    divided by ``tp`` here (the trace serves every layout of the row, all with this ``tp``)."""
    ops = {}
    for key, part in trace.ops.items():
        gemms, traffic, fused = list(part.gemms), dict(part.traffic), dict(part.fused)
        for a in part.attention:
            heads = a.heads / tp if a.split else a.heads
            batch = (a.batch[0] * heads, a.batch[1] * heads)
            t, tk, d = (a.t, 0.0), (a.tk, 0.0), (a.d, 0.0)
            shapes = ([(t, tk, d), (t, d, tk), (t, d, tk), (tk, d, t)] if a.backward  # dP, dQ, dK, dV
                      else [(t, tk, d), (t, d, tk)])  # S = Q K^T, O = P V
            gemms += [Gemm(m, n, k, batch, a.dtype, "", key[1]) for m, n, k in shapes]
            extra = [x * a.t * a.tk * _SCORE_BYTES[a.backward] for x in batch]
            for table in (traffic, fused):
                table["rep"] = [table["rep"][0] + extra[0], table["rep"][1] + extra[1]]
        ops[key] = dataclasses.replace(part, gemms=gemms, attention=[], traffic=traffic, fused=fused)
    return dataclasses.replace(trace, ops=ops)


def predict(c: Candidates, constants: dict) -> tuple[float, Layout]:
    """(predicted step time, the layout chosen) of a row with ``constants``."""
    hw = dataclasses.replace(DEVICES[c.row.device], **constants)
    best = None
    for layout in c.layouts:
        trace = get_trace(c.info, c.setup.dtype, layout.activation_checkpoint or None, "cuda",
                          layout.expert_parallel_size, layout.context_parallel_size)
        if c.work == "published":
            if id(trace) not in c.published:
                c.published[id(trace)] = as_published(trace, c.row)
            trace = c.published[id(trace)]
        _, details = estimate_time(c.info, trace, layout, c.setup, hw, c.row.gpus)
        if best is None or details["step_time_s"] < best[0]:
            best = (details["step_time_s"], layout)
    return best


def levenberg_marquardt(fun, z0: np.ndarray, max_iter: int = 100, tol: float = 1e-10, step: float = 1e-4):
    """Minimise ``sum(fun(z)**2)``: Levenberg-Marquardt with a forward-difference Jacobian (used when scipy is not
    installed). Returns (z, Jacobian at z)."""
    def jacobian(z, r):
        return np.column_stack([(fun(z + step * e) - r) / step for e in np.eye(len(z))])

    z = np.array(z0, dtype=float)
    r = fun(z)
    cost, lam = float(r @ r), 1e-3
    for _ in range(max_iter):
        jac = jacobian(z, r)
        g, a = jac.T @ r, jac.T @ jac
        while True:
            dz = -np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), g)
            r_new = fun(z + dz)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                lam = max(lam / 3, 1e-9)
                break
            lam *= 4
            if lam > 1e9:
                return z, jac
        done = cost - c_new < tol * max(cost, 1e-30)
        z, r, cost = z + dz, r_new, c_new
        if done:
            break
    return z, jacobian(z, r)


def fit(cands: list[Candidates], start: Optional[dict] = None, solver: str = "auto") -> dict:
    """The constants minimising the fit rows' squared log errors (plus the priors); ``start``: the first guess
    (default: the priors' centres). Returns {constants, posterior_sd, solver, evaluations, seconds}."""
    names = list(TRANSFORMS)
    z_prior = np.array([_to_z(n, PRIOR[n]) for n in names])
    z0 = np.array([_to_z(n, (start or PRIOR)[n]) for n in names])
    targets = np.array([math.log(c.row.published_step_s()) for c in cands])
    calls = [0]

    def residuals(z):
        calls[0] += 1
        consts = {n: _from_z(n, v) for n, v in zip(names, z)}
        pred = np.array([math.log(predict(c, consts)[0]) for c in cands])
        return np.concatenate([(pred - targets) / ROW_SD, (z - z_prior) / PRIOR_SD])

    t0 = time.perf_counter()
    try:
        from scipy.optimize import least_squares  # optional: not a dufu dependency
    except ImportError:
        if solver == "scipy":
            raise
        least_squares = None
    used = "scipy" if least_squares is not None and solver != "numpy" else "numpy"
    if used == "scipy":
        res = least_squares(residuals, z0, method="lm", diff_step=1e-4, xtol=1e-10, ftol=1e-12)
        z, jac = res.x, res.jac
    else:
        z, jac = levenberg_marquardt(residuals, z0)
    cov = np.linalg.pinv(jac.T @ jac)
    consts = {n: _from_z(n, v) for n, v in zip(names, z)}
    # posterior sd in the transformed coordinate (the prior's is PRIOR_SD): below ~0.3 the rows determine it
    sd = {n: float(math.sqrt(max(cov[i, i], 0.0))) for i, n in enumerate(names)}
    return {"constants": consts, "posterior_sd": sd, "solver": used, "evaluations": calls[0],
            "seconds": time.perf_counter() - t0}


def evaluate_rows(cands: list[Candidates], constants: dict) -> list[dict]:
    out = []
    for c in cands:
        r = c.row
        step, layout = predict(c, constants)
        tflops = r.flops() / (r.gpus * step) / 1e12
        out.append({
            "key": r.key, "fit": r.key in FIT_ROWS, "source": r.source, "certainty": r.certainty, "note": r.note,
            "params_b": r.params_b, "heads": r.heads, "hidden": r.hidden, "layers": r.layers, "tp": r.tp,
            "pp": r.pp, "dp": r.dp, "gpus": r.gpus, "batch": r.batch, "vocab": r.vocab, "device": r.device,
            "published_tflops": r.published_tflops(), "published_step_s": r.published_step_s(),
            "published_quantity": "TFLOP/s per GPU" if r.tflops is not None else "seconds per iteration",
            "predicted_step_s": step, "predicted_tflops": tflops, "ratio": tflops / r.published_tflops(),
            "micro_batch": layout.micro_batch_size, "virtual_pipeline_size": layout.virtual_pipeline_size,
            "schedule": layout.pipeline_schedule if r.pp > 1 else "-", "fits_memory_model": c.fits,
        })
    return out


def summary(rows: list[dict]) -> dict:
    def stats(sel):
        errs = [abs(x["ratio"] - 1) for x in sel]
        if not errs:
            return {}
        return {"rows": len(sel), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs),
                "min_ratio": min(x["ratio"] for x in sel), "max_ratio": max(x["ratio"] for x in sel)}

    held = [x for x in rows if not x["fit"]]
    out = {"fit": stats([x for x in rows if x["fit"]]), "held_out": stats(held),
           "held_out_high_certainty": stats([x for x in held if x["certainty"] == "high"])}
    for group, prefix in GROUPS.items():
        out["held_out " + group] = stats([x for x in held if x["key"].startswith(prefix)])
    return out


def markdown(data: dict) -> str:
    from harness.results import table

    s = data["summary"]
    lines = [f"# Fitting the GPU time model of `dufu plan` ({data['date']})", ""]
    if data.get("note"):
        lines += [data["note"], ""]
    if data.get("fit"):
        f = data["fit"]
        lines += [f"`python benchmarks/plan_fit.py{' ' + data['args'] if data['args'] else ''}`: the constants of "
                  f"`dufu/plan/hardware.py::GPU_CONSTANTS` fitted by least squares ({f['solver']}, "
                  f"{f['evaluations']} evaluations, {f['seconds']:.0f} s) to the fit rows below only: "
                  f"{', '.join(FIT_ROWS)}. Every other row is held out.", ""]
        lines += table(["constant", "fitted", "prior centre", "posterior sd / prior sd"],
                       [[n, f"{v:.3g}", f"{PRIOR[n]:.3g}", f"{f['posterior_sd'][n] / PRIOR_SD:.2f}"]
                        for n, v in f["constants"].items()])
        lines += ["", "A posterior sd well below the prior's means the fit rows determine the constant; near 1, "
                      "they do not, and it stays near its earlier value.", ""]
    else:
        lines += [f"`python benchmarks/plan_fit.py {data['args']}`: no fit; the constants of "
                  "`dufu/plan/hardware.py::GPU_CONSTANTS` as they are"
                  + ("; every row priced with dufu's own work and 1F1B, as the earlier check did."
                     if data.get("work") == "dufu" else "."), ""]
        lines += table(["constant", "value"], [[n, f"{v:.3g}"] for n, v in data["constants"].items()]) + [""]
    for title, sel in (("Fit rows", True), ("Held-out rows (not used by the fit)", False)):
        rows = [x for x in data["rows"] if x["fit"] == sel]
        lines += [f"## {title}", ""]
        lines += table(
            ["row", "GPUs", "tp x pp x dp", "batch", "published TFLOP/s", "predicted TFLOP/s", "ratio",
             "micro-batch, schedule", "certainty"],
            [[x["key"], f"{x['gpus']:,}", f"{x['tp']} x {x['pp']} x {x['dp']}", f"{x['batch']:,}",
              f"{x['published_tflops']:.1f}" + (" (from s/iter)" if x["published_quantity"].startswith("sec") else ""),
              f"{x['predicted_tflops']:.1f}", f"{x['ratio']:.3f}",
              f"{x['micro_batch']}, {x['schedule']}" + (f" v{x['virtual_pipeline_size']}"
                                                       if x["virtual_pipeline_size"] > 1 else "")
              + ("" if x["fits_memory_model"] else " (over memory)"), x["certainty"]] for x in rows])
        lines.append("")
    lines += ["## Accuracy", ""]
    for name, label in (("fit", "fit rows (in-sample)"), ("held_out", "held-out rows"),
                        ("held_out_high_certainty", "held-out rows of high certainty"),
                        *((f"held_out {g}", f"held out, {g}") for g in GROUPS)):
        st = s.get(name)
        if st:
            lines.append(f"* {label}: {st['rows']} rows, mean |predicted / published - 1| {st['mean_abs_error']:.1%}, "
                         f"max {st['max_abs_error']:.1%}, ratios {st['min_ratio']:.3f} to {st['max_ratio']:.3f}")
    lines += ["", "Ratio = predicted / published throughput (above 1: the planner is optimistic). Sources and what "
                  "each row infers:", ""]
    lines += [f"* {src}" for src in dict.fromkeys(x["source"] for x in data["rows"])]
    lines += [""] + [f"* {x['key']}: {x['note']}" for x in data["rows"] if x["note"]]
    lines += ["", "Left out:", ""] + [f"* {k}: {v}" for k, v in LEFT_OUT.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-fit", action="store_true", help="evaluate with the constants dufu/plan/hardware.py holds")
    p.add_argument("--solver", choices=("auto", "scipy", "numpy"), default="auto")
    p.add_argument("--dufu-work", action="store_true",
                   help="price every row with dufu's own work and 1F1B, as the earlier check did (no fit)")
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--results-dir", default=None)
    p.add_argument("--date", default=None, help="date in the results file name (default today)")
    p.add_argument("--note", default="", help="a sentence for the results (e.g. which code they were made with)")
    args = p.parse_args(argv)
    from harness import machine, results as results_files

    t0 = time.perf_counter()
    if args.dufu_work:
        args.no_fit = True
    cands = [candidates(r, "dufu" if args.dufu_work else "published") for r in PUBLISHED]
    print(f"candidate layouts of {len(cands)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    fitted = None
    if args.no_fit:
        constants = dict(GPU_CONSTANTS)
    else:
        fitted = fit([c for c in cands if c.row.key in FIT_ROWS], solver=args.solver)
        constants = {n: rounded(v) for n, v in fitted["constants"].items()}
        print("fitted constants (GPU_CONSTANTS):")
        for n, v in constants.items():
            print(f"    {n!r}: {v!r},  # posterior sd {fitted['posterior_sd'][n]:.2f} (prior {PRIOR_SD})")
    rows = evaluate_rows(cands, constants)
    for sel, title in ((True, "fit rows"), (False, "held-out rows")):
        print(f"{title}: published, predicted TFLOP/s per GPU, ratio")
        for x in rows:
            if x["fit"] == sel:
                print(f"    {x['key']:<28} {x['published_tflops']:7.1f} {x['predicted_tflops']:7.1f} "
                      f"{x['ratio']:6.3f}  mb {x['micro_batch']} v{x['virtual_pipeline_size']} {x['certainty']}")
    argv = list(argv if argv is not None else sys.argv[1:])
    shown = [a for i, a in enumerate(argv) if a not in ("--results-dir", "--note")
             and (i == 0 or argv[i - 1] not in ("--results-dir", "--note"))]
    data = {"date": args.date or results_files.today(), "args": " ".join(shown),
            "fit_rows": list(FIT_ROWS), "constants": constants, "rows": rows, "summary": summary(rows),
            "left_out": LEFT_OUT, "row_sd": ROW_SD, "prior": PRIOR, "prior_sd": PRIOR_SD,
            "work": "dufu" if args.dufu_work else "published", "note": args.note}
    if fitted:
        data["fit"] = {**fitted, "constants": constants, "unrounded": fitted["constants"]}
    for k, st in data["summary"].items():
        if st:
            print(f"{k}: mean abs error {st['mean_abs_error']:.1%}, max {st['max_abs_error']:.1%}")
    folder = results_files.results_dir(args.results_dir)
    stem = results_files.stem(folder, "plan_fit", data["date"], args.tag)
    results_files.write(stem, data, markdown(data), machine=machine.describe(peaks=False))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
