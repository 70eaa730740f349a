"""Evaluation on the validation set: the mean loss, perplexity and, for classification, accuracy.

The validation samples are split over ranks exactly like training batches and each batch's loss is the mean
over its targets, as in training, so the numbers are the same in every layout.

A blend of datasets (:class:`~dufu.data.blend.ValidationSets`) is evaluated dataset by dataset, the first
``eval_iter`` global batches of each: ``eval_loss/<name>`` and ``eval_ppl/<name>`` for each, and ``eval_loss``
the mean over all the targets evaluated, as for one dataset. A dataset whose validation split is smaller than
one global batch is evaluated on one global batch that goes round its samples again (every sample counted at
least once), so that every rank and layout still runs whole batches.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from dufu.engine.batch import local_scalar


@torch.no_grad()
def evaluate(runtime, dataset=None) -> dict:
    """Mean validation loss and perplexity over the first ``train.evaluation.eval_iter`` global batches of the
    validation set (and accuracy when every sample has one class label), with ``runtime``'s model parts; for a
    blend, also per dataset (module docstring). ``dataset``: another set to evaluate than the run's own."""
    G = runtime.global_batch_size
    eval_iter = runtime.cfg.train.evaluation.eval_iter
    dataset = runtime.valid_ds if dataset is None else dataset
    parts = getattr(dataset, "parts", None)
    for part in runtime.model_parts:
        part.eval()
    try:
        if parts is None:
            n_batches = min(eval_iter, len(dataset) // G)
            total, correct, classification = _loss_sums(runtime, dataset, n_batches)
            mean = float(runtime.loss.reduce(total)) / n_batches  # an evaluation ends in a host read
            result = {"eval_loss": mean, "eval_ppl": _ppl(mean), "eval_samples": n_batches * G}
            if classification:
                result["eval_accuracy"] = float(runtime.loss.reduce(correct * runtime.dims.data_parallel_size)) / n_batches
            return result
        per_dataset, loss_sum, batches = {}, 0.0, 0
        for name, dataset in parts:
            n_batches = max(1, min(eval_iter, len(dataset) // G))
            total, _, _ = _loss_sums(runtime, dataset, n_batches)
            summed = float(runtime.loss.reduce(total))  # every rank reduces every dataset, in the same order
            per_dataset[f"eval_loss/{name}"] = summed / n_batches
            per_dataset[f"eval_ppl/{name}"] = _ppl(summed / n_batches)
            loss_sum, batches = loss_sum + summed, batches + n_batches
        mean = loss_sum / batches  # LM batches hold G x seq_length targets each: the mean over all targets
        return {"eval_loss": mean, "eval_ppl": _ppl(mean), "eval_samples": batches * G, **per_dataset}
    finally:
        for part in runtime.model_parts:
            part.train()


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def _loss_sums(runtime, dataset, n_batches: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """This rank's sum over ``n_batches`` global batches of ``dataset`` of its share of each batch's mean loss
    (and of correct classifications / G), as :meth:`GlobalBatchLoss.reduce` takes them. Sample indices go round the
    dataset when it is shorter than the batches asked for."""
    G = runtime.global_batch_size
    per_rank = G // runtime.dims.data_parallel_size
    total = torch.zeros((), device=runtime.device)
    correct = torch.zeros((), device=runtime.device)  # classification: one label per sample
    classification = False
    size = len(dataset)
    for b in range(n_batches):
        start = b * G + runtime.dp_rank * per_rank
        inputs = runtime.batch(dataset, [i % size for i in range(start, start + per_rank)])
        runtime.loss.begin([inputs])  # each batch's loss: the mean over its targets, as in training
        labels = inputs.get("labels")
        # one class label per sample: accuracy too (decided from the batch, so alike on every rank)
        classification = labels is not None and labels.dim() == 1 and not labels.is_floating_point()
        with runtime.autocast():
            if runtime.schedule is not None:
                losses = []
                args, kwargs, target = runtime.pipeline_io(inputs)
                logits = runtime.schedule.eval(*args, target=target, losses=losses, **kwargs)
                if runtime.parts.last:
                    total += runtime.loss.unscaled_mean(losses)
                    if classification:
                        correct += num_correct(logits, target) / G
            else:
                for k in range(0, per_rank, runtime.micro_batch_size):
                    mb = {key: v[k:k + runtime.micro_batch_size] for key, v in inputs.items()}
                    out = runtime.model(**mb)
                    total += local_scalar(runtime.loss.weighted(out.loss, mb))
                    if classification:
                        correct += num_correct(out.logits, mb["labels"]) / G
    return total, correct, classification


def num_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many samples' arg-max class is their label."""
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return (logits.argmax(-1) == labels).sum().float()
