"""The ``hf`` side of ``benchmarks/finetune.py``: its worker process, which fine-tunes the same MiniLM with
transformers' ``AutoModelForSequenceClassification`` and ``Trainer`` on the samples, order and hyper-parameters the
parent took from dufu's resolved config (the spec file), timing its steps, evaluations and checkpoint saves with a
``TrainerCallback`` (transformers' declared extension point: nothing of its Trainer is replaced).

Clocks: each callback point marks the time; a step runs from the previous mark (the end of the previous step's
logging, evaluation and saving: transformers fetches a step's batches before ``on_step_begin``, so the step's
time includes its data, as dufu's does) to ``on_step_end``; an evaluation from the previous mark (the step's end
or its training log; the evaluation's own log comes before ``on_evaluate``) to ``on_evaluate``; a save from the
previous mark to ``on_save``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# The first profiled step (1-based), as the parent says (FINETUNE_PROFILE_AT).
PROFILE_AT = int(os.environ.get("FINETUNE_PROFILE_AT", "6"))


def hf_worker(spec_path: str, out_path: str) -> int:
    t_start = time.time()
    import numpy as np
    import torch
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainerCallback,
                              TrainingArguments)

    rec = {"worker_start": t_start, "imports_done": time.time(), "train_step_s": [], "evaluate_s": [],
           "save_s": [], "torch_threads": torch.get_num_threads()}
    spec = json.loads(Path(spec_path).read_text())
    h = spec["hparams"]
    profile_steps = int(os.environ.get("FINETUNE_PROFILE_STEPS", "0"))
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile, record_function

        from harness.profile import STEP_REGION, step_breakdown

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])

    class Samples(torch.utils.data.Dataset):
        def __init__(self, texts, labels):
            enc = tok(texts, max_length=h["seq_length"], padding="max_length", truncation=True, return_tensors="pt")
            self.cols = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            self.cols["labels"] = torch.tensor(labels, dtype=torch.long)

        def __len__(self):
            return len(self.cols["labels"])

        def __getitem__(self, i):
            return {k: v[i] for k, v in self.cols.items()}

    train_ds = Samples(spec["train_texts"], spec["train_labels"])  # in dufu's sampler order, step by step
    eval_ds = Samples(spec["eval_texts"], spec["eval_labels"])
    model = AutoModelForSequenceClassification.from_pretrained(
        spec["model_dir"], num_labels=h["num_labels"], hidden_dropout_prob=h["hidden_dropout"],
        attention_probs_dropout_prob=h["attention_dropout"], attn_implementation="sdpa")
    head = torch.load(spec["head_path"])
    with torch.no_grad():
        model.classifier.weight.copy_(head["weight"])
        model.classifier.bias.copy_(head["bias"])

    evaluate = not profile_steps
    args = TrainingArguments(
        output_dir=spec["output_dir"], max_steps=h["steps"], per_device_train_batch_size=h["micro_batch"],
        gradient_accumulation_steps=h["accumulation"], per_device_eval_batch_size=h["micro_batch"],
        learning_rate=h["lr"], weight_decay=h["weight_decay"], adam_beta1=h["betas"][0], adam_beta2=h["betas"][1],
        adam_epsilon=h["eps"], optim="adamw_torch_fused" if h["fused"] else "adamw_torch",
        max_grad_norm=h["clip"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": h["min_lr_ratio"]}, warmup_steps=h["warmup"],
        eval_strategy="steps" if evaluate else "no", eval_steps=h["eval_period"], eval_on_start=evaluate,
        save_strategy="steps" if evaluate else "no", save_steps=h["steps"], save_total_limit=1,
        logging_steps=h["log_period"], report_to="none", seed=h["seed"], bf16=spec["precision"] == "bf16",
        dataloader_pin_memory=False, use_cpu=not torch.cuda.is_available(),
        train_sampling_strategy="sequential",  # the samples are already in dufu's order
    )
    clock = {"mark": None, "calls": 0, "prof": None, "region": None}

    def since_mark() -> float:
        now = time.perf_counter()
        seconds, clock["mark"] = now - clock["mark"], now
        return seconds

    class Clocks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["mark"] = time.perf_counter()

        def on_epoch_begin(self, args, state, control, **kw):
            clock["mark"] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not any(k.startswith("eval_") for k in logs or {}):  # an evaluation logs before on_evaluate
                clock["mark"] = time.perf_counter()

        def on_evaluate(self, args, state, control, **kw):
            rec["evaluate_s"].append(since_mark())

        def on_save(self, args, state, control, **kw):
            rec["save_s"].append(since_mark())

        def on_step_begin(self, args, state, control, **kw):
            clock["calls"] += 1
            if profile_steps and clock["calls"] == PROFILE_AT:
                clock["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
                clock["prof"].__enter__()
            if clock["prof"] is not None:
                clock["region"] = record_function(STEP_REGION)
                clock["region"].__enter__()

        def on_step_end(self, args, state, control, **kw):
            rec["train_step_s"].append(since_mark())
            if clock["region"] is not None:
                clock["region"].__exit__(None, None, None)
                clock["region"] = None
                if clock["calls"] == PROFILE_AT + profile_steps - 1:
                    prof, clock["prof"] = clock["prof"], None
                    prof.__exit__(None, None, None)
                    rec["profile"] = step_breakdown(prof.events(), profile_steps)

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      compute_metrics=accuracy, callbacks=[Clocks()])
    rec["train_start"] = time.time()
    t0 = time.perf_counter()
    trainer.train()
    rec["train_s"] = time.perf_counter() - t0
    rec["train_end"] = time.time()
    rec["evals"] = [{"step": e["step"], "eval_loss": e["eval_loss"], "eval_accuracy": e["eval_accuracy"]}
                    for e in trainer.state.log_history if "eval_accuracy" in e]
    rec["losses"] = [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history if "loss" in e]
    rec["precision"] = spec["precision"]
    rec["worker_end"] = time.time()
    Path(out_path).write_text(json.dumps(rec))
    return 0
