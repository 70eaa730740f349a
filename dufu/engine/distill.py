"""Knowledge distillation (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"): a trained teacher
teaches the model being trained (the student) through its softened output distribution.

A config adds ``distill = L(Distillation)(teacher=PATH, temperature=2.0, kd_weight=0.5)``; the loss of every
micro-batch becomes

    (1 - kd_weight) * CE(student, labels) + kd_weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))

both averaged over the same targets (labels other than -100), so the trainer's weighting of micro-batches and
data-parallel ranks (:meth:`dufu.engine.global_loss.GlobalBatchLoss.weight`) holds for it unchanged. ``T^2`` keeps the
soft term's gradients at the hard term's scale as T changes (Hinton et al., section 2). ``kd_weight=0`` is plain
training; evaluation reports the student's own cross entropy, as a run without a teacher does.

The teacher (a dufu run / checkpoint or a Hugging Face directory, ``L(pretrained_model)(path=...)``'s sources) is
built on the meta device and split like the student: the same tensor (and sequence) parallel plan on the same
mesh, and under ZeRO its parameters sharded over the data-parallel ranks and gathered for its forward only
(stage 3: it has no gradients to keep them for); without ZeRO every data-parallel rank holds it whole. It runs
in eval mode under ``torch.no_grad`` in the student's precision, and is never saved: checkpoints hold the student.
Teacher and student must share the vocabulary (the same tokenizer).

Under pipeline parallelism the teacher is cut into as many stages as the student has pipeline ranks (one per
rank, its own layers split evenly) and runs its own forward-only schedule over the step's micro-batches first; its
last stage's logits travel to the student's last stage (the same rank) inside the target the schedule splits into
micro-batches, so each micro-batch's loss gets the teacher's logits of exactly its samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dufu.errors import ConfigError
from dufu.engine.weights.checkpoint import Checkpointer
from dufu.engine.weights.pretrained import pretrained_model, pretrained_weights
from dufu.layers.loss import cross_entropy_loss
from dufu.parallel.build import build_model_parts
from dufu.parallel.pipeline import layer_stage_ids
from dufu.models.base import contract_of


@dataclass
class Distillation:
    """What a ``distill`` config section holds (see the module docstring)."""

    teacher: str
    temperature: float = 2.0
    kd_weight: float = 0.5

    def __post_init__(self):
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature = {self.temperature}: use a positive temperature (1 leaves the "
                              "teacher's distribution as it is; 2-4 are usual).")
        if not 0 <= self.kd_weight <= 1:
            raise ConfigError(f"distill.kd_weight = {self.kd_weight}: use a weight in [0, 1] (the soft term's share "
                              "of the loss; the labels' cross entropy gets the rest).")
        if not Path(str(self.teacher)).exists():
            raise ConfigError(f"distill.teacher = {self.teacher!r} does not exist: give a trained dufu run (its "
                              "output_dir or a checkpoint) or a Hugging Face directory.")


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _targets(inputs: dict) -> tuple[dict, torch.Tensor]:
    """(the model inputs without labels, the targets aligned with the logits): dufu's token batches carry
    already-shifted ``shift_labels``; masked-LM and classification batches carry ``labels`` that align as they are."""
    target = inputs.get("shift_labels", inputs.get("labels"))
    if target is None:
        raise ConfigError("distillation needs labels in the batch (shift_labels or labels); this data has none.")
    return {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}, target


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(teacher || student) of the temperature-softened distributions, averaged over the positions whose
    target is not -100. Vocabulary-sharded logits (DTensors under tensor parallelism) are gathered first: every
    tensor-parallel rank then computes the same loss, and the gather's backward hands each rank its slice of the
    logits' gradient. (Summing the KL over the shards as a partial DTensor gave the right loss but gradients that
    left one-process parity after a step, so the full (..., V) logits are paid for here, unlike the cross entropy
    of ``loss_parallel``.)"""
    if isinstance(student, DTensor):
        student = student.full_tensor()
    if isinstance(teacher, DTensor):
        teacher = teacher.full_tensor()
    log_s = F.log_softmax(student.float() / temperature, dim=-1)  # (..., V)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # (...): per position
    mask = (target != -100).to(kl.dtype)
    return (kl * mask).sum() / mask.sum().clamp(min=1.0) * temperature**2


def check_teacher(spec: Distillation, student) -> None:
    """The start-up check (:func:`dufu.engine.preflight.plan_run`, before any process group or worker): the
    teacher's vocabulary is the student's (``student``: the meta model)."""
    with torch.device("meta"):
        teacher = pretrained_model(spec.teacher)
    theirs, ours = contract_of(teacher).vocab_size, contract_of(student).vocab_size
    if theirs != ours:
        raise ConfigError(f"the teacher {spec.teacher} has a vocabulary of {theirs} tokens, the student {ours}: "
                          "distillation compares their distributions token by token, so both need the same "
                          "tokenizer and model.vocab_size.")


class Teacher:
    """The teacher's model, split like the student's, and the distillation loss of a micro-batch (its vocabulary
    was checked at start-up: :func:`check_teacher`)."""

    def __init__(self, spec: Distillation, runtime):

        self.spec = spec
        t, zero = runtime.cfg.train, runtime.cfg.train.zero_optimization
        with torch.device("meta"):
            model = pretrained_model(spec.teacher)
        model.requires_grad_(False)
        weights = pretrained_weights(model, None)
        stage_ids = None
        if runtime.schedule is not None:  # one teacher stage per pipeline rank, run by a forward-only schedule
            stage_ids = layer_stage_ids(model.num_layers, runtime.dims.pipeline_parallel_size)
        parts = build_model_parts(
            model, runtime.mesh, runtime.device, stage_ids=stage_ids, meta_init=True, seed=t.seed,
            pipeline_schedule="1f1b", num_microbatches=runtime.num_accumulation_steps,
            pretrained=weights.source, init_parameters=False,
            tensor_parallel=runtime.dims.tp_enabled, sequence_parallel=bool(t.dist.sequence_parallel),
            data_parallel=bool(zero.enabled) and runtime.dims.dp_enabled,
            zero_stage=3 if zero.enabled else None, activation_checkpoint=None, compile=False)
        if weights.checkpoint is not None:
            Checkpointer(weights.checkpoint.parent, rank=runtime.rank).load_model(weights.checkpoint, parts.modules)
        for part in parts.modules:
            part.eval()
        self.model, self.schedule, self.last = parts.modules[0], parts.schedule, parts.last
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.name = type(model).__name__

    def loss(self, student, inputs: dict) -> torch.Tensor:
        """The micro-batch's loss (module docstring), under the trainer's autocast and loss_parallel contexts."""
        inputs, target = _targets(inputs)
        with torch.no_grad():
            teacher = _logits(self.model(**inputs))
        return self._combine(_logits(student(**inputs)), teacher, target)

    def _combine(self, logits: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        w = self.spec.kd_weight
        hard = cross_entropy_loss(logits, target)  # the models' own loss
        if isinstance(hard, DTensor):  # the vocabulary-parallel loss: a replicated scalar
            hard = hard.full_tensor()
        if w == 0:
            return hard
        return (1 - w) * hard + w * kd_loss(logits, teacher, target, self.spec.temperature)

    @torch.no_grad()
    def run_pipeline(self, args: tuple, kwargs: dict, target: torch.Tensor) -> torch.Tensor:
        """Under pipelining, before the student's schedule: the teacher's schedule over the step's micro-batches.
        On the last stage the returned target carries the teacher's logits beside the labels, (B, T, V + 1) (labels
        as floats: exact below 2^24), so torch's schedule hands every micro-batch's loss its own slice of both (also
        in the loss it runs once on the first micro-batch to infer shapes); other stages keep the target."""
        logits = self.schedule.eval(*args, **kwargs)
        if not self.last:
            return target
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        return torch.cat([logits.float(), target.unsqueeze(-1).float()], dim=-1)  # (B, T, V + 1)

    def stage_loss(self, output, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the student's last-stage loss of a micro-batch, its labels) from a target made by :meth:`run_pipeline`."""
        teacher, labels = target[..., :-1], target[..., -1].long()  # (B, T, V), (B, T)
        return self._combine(_logits(output), teacher, labels), labels

    def describe(self) -> str:
        s = self.spec
        return (f"distillation from {s.teacher} ({self.name}, {self.num_parameters:,} parameters): "
                f"temperature {s.temperature}, kd_weight {s.kd_weight}")
