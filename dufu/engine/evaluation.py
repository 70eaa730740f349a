"""Evaluation on the validation set: the mean loss, perplexity and, for classification, accuracy.

The validation samples are split over ranks exactly like training batches and each batch's loss is the mean
over its targets, as in training, so the numbers are the same in every layout.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from dufu.engine.batch import local_scalar


@torch.no_grad()
def evaluate(trainer) -> dict:
    """Mean validation loss and perplexity over the first ``train.evaluation.eval_iter`` global batches of the
    validation set (and accuracy when every sample has one class label), with ``trainer``'s model parts."""
    G = trainer.global_batch_size
    n_batches = min(trainer.cfg.train.evaluation.get("eval_iter", 20), len(trainer.valid_ds) // G)
    for part in trainer.model_parts:
        part.eval()
    per_rank = G // trainer.dims.data_parallel_size
    total = torch.zeros((), device=trainer.device)
    correct = torch.zeros((), device=trainer.device)  # classification: one label per sample
    classification = False
    for b in range(n_batches):
        start = b * G + trainer.dp_rank * per_rank
        inputs = trainer.batch(trainer.valid_ds, list(range(start, start + per_rank)))
        trainer.count_global_targets([inputs])  # each batch's loss: the mean over its targets, as in training
        labels = inputs.get("labels")
        # one class label per sample: accuracy too (decided from the batch, so alike on every rank)
        classification = labels is not None and labels.dim() == 1 and not labels.is_floating_point()
        with trainer.autocast():
            if trainer.schedule is not None:
                losses = []
                args, kwargs, target = trainer.pipeline_io(inputs)
                logits = trainer.schedule.eval(*args, target=target, losses=losses, **kwargs)
                if trainer.parts.last:
                    total += trainer.unscaled_mean(losses)
                    if classification:
                        correct += num_correct(logits, target) / G
            else:
                for k in range(0, per_rank, trainer.micro_batch_size):
                    mb = {key: v[k:k + trainer.micro_batch_size] for key, v in inputs.items()}
                    out = trainer.model(**mb)
                    total += local_scalar(out.loss) * trainer.target_weight(mb)
                    if classification:
                        correct += num_correct(out.logits, mb["labels"]) / G
    for part in trainer.model_parts:
        part.train()
    mean = trainer.reduce_loss(total) / n_batches
    result = {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_samples": n_batches * G}
    if classification:
        result["eval_accuracy"] = trainer.reduce_loss(correct * trainer.dims.data_parallel_size) / n_batches
    return result


def num_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many samples' arg-max class is their label."""
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return (logits.argmax(-1) == labels).sum().float()

