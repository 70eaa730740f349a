"""The parity check every multi-process test uses: a run equals a reference run (one process, same data).

A run is read from what a user sees: its ``metrics.jsonl`` (training losses and learning rates, evaluation
results) and its last checkpoint (the weights, gathered into this process from any layout).

Tolerances (derived in :func:`assert_weights_match` and at ``PRECISIONS``):

* training and evaluation losses: 1e-5 relative in fp32 (layouts sum in different orders: ~1e-6 seen);
* weights after AdamW steps: an elementwise bound from the size of an AdamW update, not a fixed atol;
* classification accuracy: at most one evaluation sample different (a near-tie of its top two logits).

Where the runs come from: the single-process reference of a config and overrides is trained once per session,
in the test process, by the fixture ``reference_run`` (tests/conftest.py), whichever tests compare with it; a
test module's multi-process runs go through :class:`SharedRuns` (fixture ``shared_runs``), which trains all runs
of one world size in one torchrun job.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import launch

# Every parity run: 5 steps of the same global batch of 8 (so every layout sees the same samples in the same
# order), a checkpoint at the end, and nothing else that costs time.
PARITY_ARGS = (
    "train.train_iter=5",
    "train.global_batch_size=8",
    "train.train_micro_batch_size=2",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=5",
    "train.tensorboard=False",
    "train.generation.enabled=False",
    "train.peak_tflops=1.0",
)

# Evaluation at step 0 (before training) and after the last step, on 2 global batches of the validation set.
EVAL_ARGS = (
    "train.evaluation.enabled=True",
    "train.evaluation.eval_period=5",
    "train.evaluation.eval_iter=2",
)


@dataclass(frozen=True)
class Precision:
    """How far a run may legitimately be from its reference in one arithmetic.

    loss_rel: relative bound on a logged (training or evaluation) loss.
    update_rel: relative error tolerated in each AdamW update (eta in :func:`assert_weights_match`).
    outliers: fraction of a tensor's entries allowed beyond that (still within the hard AdamW bound).
    """

    loss_rel: float
    update_rel: float
    outliers: float


PRECISIONS = {
    # Reduction order alone: fp32 sums agree to ~1e-6 relative (docs/architecture.md); 10x margin for the loss. For the
    # weights see assert_weights_match: eta = 1e-3 covers gradients at roundoff level under Adam's eps.
    "fp32": Precision(loss_rel=1e-5, update_rel=1e-3, outliers=1e-3),
    # bf16 keeps 8 significant bits: unit roundoff u = 2**-8 ~ 4e-3 per rounding. Activations of a 2-layer
    # model pass ~5 rounded matmul outputs, each summed in another order (tensor parallelism rounds partial
    # sums, other batch shapes block matmuls differently), so activations and logits may differ by
    # ~5 u ~ 2e-2 relative. The loss is a mean over 256 tokens of log-softmax, which is
    # 2-Lipschitz in the logits' max-norm: |dL| <= 2 max|dz| ~ 2 * 2e-2 * |z|, with |z| < 1 at these weights,
    # i.e. up to ~1e-2 relative of L ~ 5.6 in the worst case where every token's error has the same sign;
    # independent errors average it down ~16x. The bound below is that worst case, with a 2x margin.
    # Gradients carry the same ~2e-2 relative error, so each Adam update may differ by that much (eta), and
    # entries whose gradient is below the noise (|g| < 2e-2 of the typical) may flip: up to a few percent.
    "bf16": Precision(loss_rel=2e-2, update_rel=5e-2, outliers=5e-2),
    # fp16 keeps 11 significant bits: u = 2**-11 ~ 4.9e-4, 8x smaller than bf16's, and the same derivation
    # gives 8x tighter bounds (loss scaling changes no significant bits: it multiplies by powers of two).
    "fp16": Precision(loss_rel=2.5e-3, update_rel=1e-2, outliers=1e-2),
}


# ------------------------------------------------------------------------------------------ a run's results


@dataclass
class RunResult:
    """What a finished run logged and saved."""

    output_dir: Path
    train: dict = field(default_factory=dict)  # step -> training record (loss, lr, grad_norm, ...)
    evals: dict = field(default_factory=dict)  # step -> evaluation record (eval_loss, eval_ppl, ...)
    state: Optional[dict] = None  # final weights (the last checkpoint's model), or None without a checkpoint
    betas: tuple = (0.9, 0.999)
    weight_decay: float = 0.0

    @property
    def losses(self) -> list[float]:
        return [self.train[s]["loss"] for s in sorted(self.train)]

    @property
    def lrs(self) -> list[float]:
        return [self.train[s]["lr"] for s in sorted(self.train)]


def records(output_dir) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_records(output_dir) -> dict[int, dict]:
    """{step: training record}; a step logged twice (e.g. a resume that did not trim the log) fails."""
    out = {}
    for r in records(output_dir):
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice in {output_dir}/metrics.jsonl"
            out[r["step"]] = r
    return out


def losses(output_dir) -> list[float]:
    """The training losses of a run, in step order."""
    got = train_records(output_dir)
    return [got[s]["loss"] for s in sorted(got)]


def consolidated_state(ckpt) -> dict:
    """A checkpoint's full model state in this process, whatever layout wrote it (dufu's public API)."""
    from dufu.engine.weights.checkpoint import Checkpointer

    ckpt = Path(ckpt)
    return Checkpointer(ckpt.parent).consolidated_model_state(ckpt)


def final_model_state(output_dir) -> dict:
    ckpts = sorted((Path(output_dir) / "checkpoints").glob("step_*"))
    assert ckpts, f"no checkpoint in {output_dir}"
    return consolidated_state(ckpts[-1])


def collect(output_dir, weights: bool = True) -> RunResult:
    import yaml

    output_dir = Path(output_dir)
    result = RunResult(output_dir, train=train_records(output_dir),
                       evals={r["step"]: r for r in records(output_dir) if "eval_loss" in r})
    optim = (yaml.safe_load((output_dir / "config.yaml").read_text()) or {}).get("optim", {})
    result.betas = tuple(optim.get("betas", result.betas))
    result.weight_decay = float(optim.get("weight_decay", 0.0))
    if weights:
        result.state = final_model_state(output_dir)
    return result


def parity_run(output_dir, nproc: int, *overrides: str, config: str = "gpt_debug", weights: bool = True,
               env: Optional[dict] = None, timeout: float = 600) -> RunResult:
    """``dufu train CONFIG`` with PARITY_ARGS and ``overrides`` in ``nproc`` processes -> its results."""
    output_dir = Path(output_dir)
    proc = launch.run(launch.train_command(config, output_dir, nproc, *PARITY_ARGS, *overrides),
                      output_dir=output_dir, env=env, timeout=timeout)
    launch.assert_ok(proc)
    return collect(output_dir, weights=weights)


# ------------------------------------------------------------------------------------------ shared launches

WORKER = Path(__file__).with_name("parity_worker.py")


@dataclass(frozen=True)
class Spec:
    """One run of :class:`SharedRuns`: ``dufu train CONFIG BASE OVERRIDES`` in ``nproc`` processes, with ``env``
    (``((name, value), ...)``, e.g. a ``DUFU_FAULT``) set in its workers while it runs. ``resume_of``: the name
    of an earlier run of the same world size; this run starts from a copy of its output directory, with
    ``--resume``."""

    nproc: int
    overrides: tuple = ()
    config: str = "gpt_debug"
    env: tuple = ()
    base: tuple = PARITY_ARGS
    resume_of: Optional[str] = None


class SharedRuns:
    """Runs that share their processes: the runs of one world size train one after another in the same torchrun
    workers (tests/parity_worker.py), each through ``dufu.cli.main(["train", ...])`` exactly as the workers of
    ``dufu train --nproc N`` run it, into an output directory of its own. A job then pays torchrun's start-up,
    the imports and the first run's warm-up once instead of once per run: on 2 CPU cores those cost ~10 s per
    launch, while a parity run's own work is under a second.

    ``result(name)`` waits for a run's :class:`RunResult` (the first call launches every ``wanted`` run of the
    same world size not run yet). When a run fails its workers stop; its test fails with the job's output and
    the failing rank's traceback, and the runs after it are launched again without it, so each run still
    passes or fails on its own.
    """

    def __init__(self, root, specs: dict, wanted=None, timeout: float = 600):
        self.root, self.specs, self.timeout = Path(root), dict(specs), timeout
        for n, spec in self.specs.items():
            source = spec.resume_of
            assert source is None or (list(self.specs).index(source) < list(self.specs).index(n)
                                      and self.specs[source].nproc == spec.nproc), \
                f"{n} resumes {source}: declare a run of the same world size before the runs resuming it"
        self.wanted = [n for n in self.specs if wanted is None or n in set(wanted)]
        self.outcomes: dict[str, tuple] = {}  # name -> (output_dir, None) or (None, failure text)

    def result(self, name: str, weights: bool = True) -> RunResult:
        if name not in self.outcomes:
            needed = {name, *self.wanted}
            for n in reversed(self.specs):  # and the runs they resume from (declared before them)
                if n in needed and self.specs[n].resume_of:
                    needed.add(self.specs[n].resume_of)
            nproc = self.specs[name].nproc
            self._launch([n for n in self.specs if n in needed and n not in self.outcomes and self.specs[n].nproc == nproc])
        output_dir, failure = self.outcomes[name]
        assert failure is None, failure
        return collect(output_dir, weights=weights)

    def output_dir(self, name: str) -> Path:
        self.result(name, weights=False)
        return self.outcomes[name][0]

    def _launch(self, names: list) -> None:
        nproc = self.specs[names[0]].nproc

        def command(job: Path, names: list) -> list:
            plan = [{"name": n, "output_dir": str(job / n), "config": str(self.specs[n].config),
                     "args": [*self.specs[n].base, *self.specs[n].overrides], "env": dict(self.specs[n].env),
                     "resume_of": self._source_dir(n, job)} for n in names]
            plan_file = job.with_name(f"{job.name}.json")
            plan_file.write_text(json.dumps(plan, indent=1))
            # train.output_dir=JOB on the workers' command line lets launch.py find and end them.
            args = (plan_file, f"train.output_dir={job}")
            return launch.torchrun_command(WORKER, nproc, *args) if nproc > 1 else [sys.executable, WORKER, *args]

        self.root.mkdir(parents=True, exist_ok=True)
        outcomes = launch.run_in_turn(names, command, self.root, timeout=self.timeout,
                                      needs={n: self.specs[n].resume_of for n in names if self.specs[n].resume_of})
        for n, (job, failure) in outcomes.items():
            self.outcomes[n] = (job / n if job is not None else None, failure)

    def _source_dir(self, name: str, job: Path) -> Optional[str]:
        """The output directory of the run ``name`` resumes: from an earlier job, or run before it in ``job``."""
        source = self.specs[name].resume_of
        if source is None:
            return None
        earlier = [d for d in sorted(self.root.glob("job*")) if (d / ".done" / source).exists()]
        return str((earlier[0] if earlier else job) / source)


# ------------------------------------------------------------------------------------------ comparisons


def assert_losses_match(output_dir, reference: dict[int, float], steps, rel: float = 1e-5) -> None:
    """Training losses of ``output_dir`` at ``steps`` equal ``reference`` ({step: loss}) within ``rel``."""
    got = train_records(output_dir)
    for s in steps:
        assert s in got, f"step {s} missing from {output_dir}/metrics.jsonl (has {sorted(got)})"
        a, b = got[s]["loss"], reference[s]
        assert math.isfinite(a) and abs(a - b) <= rel * abs(b), f"step {s}: loss {a} != reference {b} (rel {rel})"


def _same(a: float, b: float, rel: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)  # a step both runs skipped on purpose (injected NaN)
    return abs(a - b) <= rel * abs(b)


def assert_matches_reference(got: "RunResult | Path", reference: RunResult, what: str, steps: int = 5,
                             precision: str = "fp32") -> None:
    """The promise: a run logs the reference's losses (and evaluation results, when the reference has them)
    and ends with its weights, within the tolerances of ``precision`` (see PRECISIONS)."""
    if not isinstance(got, RunResult):
        got = collect(got, weights=reference.state is not None)
    tol = PRECISIONS[precision]
    assert sorted(got.train) == sorted(reference.train) == list(range(1, steps + 1)), \
        f"{what}: logged steps {sorted(got.train)}, reference {sorted(reference.train)}"
    for s, ref in reference.train.items():
        a, b = got.train[s]["loss"], ref["loss"]
        assert _same(a, b, tol.loss_rel), f"{what}: step {s} loss {a} != single-process {b} (rel {tol.loss_rel})"
        assert got.train[s]["lr"] == ref["lr"], f"{what}: step {s} lr {got.train[s]['lr']} != {ref['lr']}"
    assert_evaluations_match(got, reference, what, tol.loss_rel)
    if reference.state is not None:
        assert_weights_match(got.state, reference.state, what, reference.lrs, reference.betas, reference.weight_decay,
                             precision)


def assert_evaluations_match(got: RunResult, reference: RunResult, what: str, rel: float = 1e-5) -> None:
    """eval_loss and eval_ppl within ``rel`` (perplexity: exp of the loss, so rel x loss for it); accuracy
    within one sample: a sample whose top two logits are within reduction-order distance may flip."""
    assert sorted(got.evals) == sorted(reference.evals), \
        f"{what}: evaluations at steps {sorted(got.evals)}, reference at {sorted(reference.evals)}"
    for s, ref in reference.evals.items():
        r = got.evals[s]
        assert r["eval_samples"] == ref["eval_samples"], f"{what}: step {s} evaluated {r['eval_samples']} samples"
        assert _same(r["eval_loss"], ref["eval_loss"], rel), \
            f"{what}: step {s} eval_loss {r['eval_loss']} != single-process {ref['eval_loss']} (rel {rel})"
        ppl_rel = math.expm1(rel * abs(ref["eval_loss"])) * 1.01
        assert _same(r["eval_ppl"], ref["eval_ppl"], ppl_rel), \
            f"{what}: step {s} eval_ppl {r['eval_ppl']} != single-process {ref['eval_ppl']} (rel {ppl_rel:.2e})"
        assert ("eval_accuracy" in r) == ("eval_accuracy" in ref), f"{what}: step {s}: accuracy logged in one run only"
        if "eval_accuracy" in ref:
            one = 1.0 / ref["eval_samples"]
            assert abs(r["eval_accuracy"] - ref["eval_accuracy"]) <= one + 1e-12, \
                f"{what}: step {s} eval_accuracy {r['eval_accuracy']} != single-process {ref['eval_accuracy']}"


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can reach at step t, over every gradient sequence.

    m_t = (1-b1) sum_k b1^k g_(t-k) and v_t = (1-b2) sum_k b2^k g_(t-k)^2 (k < t). Cauchy-Schwarz on
    sum_k (b1/sqrt(b2))^k * b2^(k/2) g gives |m_t| <= (1-b1) sqrt(sum_k (b1^2/b2)^k) sqrt(v_t / (1-b2)); with
    the bias corrections m_hat = m/(1-b1^t), v_hat = v/(1-b2^t). eps only makes the ratio smaller. (t=1: 1.)"""
    r = beta1 ** 2 / beta2
    s = sum(r ** k for k in range(t))
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(s) * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)


# Parameters that get no gradient in exact arithmetic: a key projection's bias adds q . b_k to every score of a
# query's row, which softmax over the keys ignores. Their gradients are pure roundoff, which Adam normalizes
# into steps of up to lr: only rule 1 of assert_weights_match can hold for them.
ROUNDOFF_ONLY = ("k_proj.bias",)


def assert_checkpoint_matches(state: dict, reference_dir, step: int, what: str) -> None:
    """``state`` (weights after ``step`` steps) equals the step-``step`` checkpoint of the fp32 run in
    ``reference_dir``, within assert_weights_match's bound for that run's learning rates."""
    ref = collect(reference_dir, weights=False)
    ref_state = consolidated_state(Path(reference_dir) / "checkpoints" / f"step_{step:07d}")
    lrs = [ref.train[s]["lr"] for s in range(1, step + 1)]
    assert_weights_match(state, ref_state, what, lrs, ref.betas, ref.weight_decay)


def assert_weights_match(state: dict, ref_state: dict, what: str, lrs, betas=(0.9, 0.999), weight_decay: float = 0.0,
                         precision: str = "fp32") -> None:
    """Final weights equal the reference's within what AdamW lets reduction order change.

    Derivation. AdamW moves a weight at step t by lr_t * m_hat/(sqrt(v_hat)+eps) (+ lr_t*wd*w, the same in both
    runs up to second order). Two cases for a weight's gradient g:

    * |g| >> eps: Adam normalizes the gradient away, so a relative gradient error d (reduction order: ~1e-6 in
      fp32) changes the update by about lr_t * d. Every such weight agrees to rtol 1e-4 plus a little of lr.
    * |g| <~ eps (a weight the batch hardly touches, e.g. a bias still near its zero init): the update is about
      lr_t * g/eps, so the gradient's *absolute* roundoff dg is amplified by lr_t/eps (1e5 at eps 1e-8). The
      failure this rule replaces was one such bias entry: |ref| 1.7e-7, difference 1.5e-6 after 5 steps.
      Measured (gpt_debug, fp32, dp2 vs one process, sum of rates 2.6e-3): every tensor within 3e-6 x sum lr
      but the key biases (ROUNDOFF_ONLY), within 1.6e-4 x sum lr.

    Rule, for every tensor with n entries, lrs the logged rates and rho_t = adam_ratio_bound(t):
    1. every entry: |w - w_ref| <= 2 * sum_t lr_t * (rho_t + wd * max|w_ref|). No two AdamW runs from the same
       initial weights can be further apart, whatever their gradients (each update reversed).
    2. all but outliers * n entries (at least 1): |w - w_ref| <= 1e-4 |w_ref| + eta * sum_t lr_t, i.e. each update
       agrees to within a fraction eta (``Precision.update_rel``) of a full Adam step; in fp32, eta = 1e-3
       covers gradients at roundoff level (dg <= eta * eps = 1e-11 per step) under eps. The few left are the
       weights whose gradient roundoff exceeds that: rare in fp32 (their gradient must cancel to ~1e-9 while a
       typical one is ~1e-3), which is what lets rule 2 catch a wrong shard, row or step. Rule 2 does not
       apply to ROUNDOFF_ONLY parameters.
    """
    tol = PRECISIONS[precision]
    lrs = list(lrs)
    b1, b2 = betas
    total_lr = sum(lrs)
    reach = sum(lr * adam_ratio_bound(t, b1, b2) for t, lr in enumerate(lrs, start=1))
    assert set(state) == set(ref_state), f"{what}: parameters differ: {sorted(set(state) ^ set(ref_state))[:10]}"
    for name, ref in ref_state.items():
        got = state[name]
        assert got.shape == ref.shape, f"{what}: {name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        got, ref = got.double(), ref.double()
        diff = (got - ref).abs()
        hard = 2 * (reach + total_lr * weight_decay * (ref.abs().max().item() if ref.numel() else 0.0))
        worst = diff.max().item() if diff.numel() else 0.0
        assert worst <= hard, (
            f"{what}: {name}: greatest difference {worst:.3g} at {_where(diff)} exceeds {hard:.3g}, the most two "
            f"AdamW runs can differ after {len(lrs)} steps of rates {lrs} (got {got.flatten()[diff.argmax()].item():.6g}, "
            f"single-process {ref.flatten()[diff.argmax()].item():.6g})")
        if name.endswith(ROUNDOFF_ONLY):
            continue
        tight = 1e-4 * ref.abs() + tol.update_rel * total_lr
        beyond = int((diff > tight).sum())
        allowed = max(1, int(tol.outliers * diff.numel()))
        assert beyond <= allowed, (
            f"{what}: {name}: {beyond} of {diff.numel()} entries differ by more than 1e-4 |w| + "
            f"{tol.update_rel:g} x {total_lr:.3g} (the sum of the rates), {allowed} allowed; greatest "
            f"{worst:.3g} at {_where(diff)} (got {got.flatten()[diff.argmax()].item():.6g}, single-process "
            f"{ref.flatten()[diff.argmax()].item():.6g})")


def _where(diff: torch.Tensor) -> tuple:
    if not diff.numel():
        return ()
    return tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
