# LoRA fine-tuning of Llama 2 7B (llama2_7b's sizes) on prompt/response pairs, the loss on the responses only
# (common/data/sft.py). Rank-16 adapters (alpha 32, so s = 2) beside the attention's four projections: 16.8M of
# 6.76B parameters train (0.25%); only they and their optimizer state are saved in checkpoints, with the
# base's fingerprint. Meant for GPUs; the start-up checks also run on a CPU.
#
#   dufu train llama_lora model.pretrained=DIR tokenization.tokenizer.path=DIR \
#       dataloader.train.data_path=pairs.jsonl train.train_iter=N
#
# DIR: a Hugging Face Llama-2-7b(-hf) directory (config.json, *.safetensors, tokenizer.json). Any Llama or
# Qwen2 directory works with its sizes in model.* (llama3_8b's for Llama 3.1 8B). The frozen base is held in
# fp32 (27 GB for 7B) under bf16 autocast: on GPUs below 40 GB shard it, e.g. --nproc 8
# train.dist.data_parallel_size=8 train.zero_optimization.enabled=True train.zero_optimization.stage=3, or
# train.dist.tensor_parallel_size=2 (the factors are sharded with their layers; docs/delta.md).
# QLoRA-style all-linear adapters (40.0M, 0.59%): delta.targets='["q_proj","k_proj","v_proj","out_proj",
# "gate_proj","up_proj","down_proj"]'.
from dufu.config import LazyCall as L
from dufu.delta import LoRA

from .common.data.sft import dataloader
from .common.finetune import finetune_run
from .llama2_7b import model, optim, tokenization, train

_LLAMA_DIR = "Llama-2-7b-hf"  # as `huggingface-cli download meta-llama/Llama-2-7b-hf --local-dir Llama-2-7b-hf`

model.pretrained = _LLAMA_DIR
tokenization.tokenizer.update(kind="pretrained", path=_LLAMA_DIR, vocab_size=None)

delta = L(LoRA)(targets=["q_proj", "k_proj", "v_proj", "out_proj"], rank=16, alpha=32, dropout=0.05)

dataloader.train.update(
    seq_length=512,
    valid_fraction=0.2,  # the built-in pairs: 16 of 79 for validation, one global batch
    prompt_template="### Question:\n{prompt}\n### Answer:\n",
)

finetune_run(train, optim, "output/llama_lora")
optim.lr = 2e-4  # the usual LoRA rate for 7B models (QLoRA, PEFT's examples), 10x full fine-tuning's
train.update(
    # About 3 epochs of the built-in 63 training pairs; for a data set of S pairs: 3 * S / global_batch_size.
    train_iter=12,
    train_micro_batch_size=2,
    global_batch_size=16,
    log_period=1,
)
train.amp.update(enabled=True, dtype="bf16")
train.scheduler.update(warmup_iter=2, min_lr_ratio=0.1)
train.activation_checkpoint.enabled = True
train.evaluation.update(eval_period=4, eval_iter=1)
train.checkpointer.update(period=100, max_to_keep=2)
train.generation.enabled = False
