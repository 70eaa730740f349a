# Supervised fine-tuning (SFT) of a pretrained GPT on prompt/response pairs, the loss on the response only
# (common/data/sft.py), as llama_sft does for LLaMA. model.pretrained: a dufu run (default: the output of
# `dufu train gpt_debug`) or a transformers GPT-2 directory whose sizes model.* match (then also the tokenizer:
# tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR).
from .common.data.sft import dataloader
from .gpt_debug import model, optim, tokenization, train

model.pretrained = "output/gpt_debug"
dataloader.train.seq_length = 32  # gpt_debug's max_position_embeddings

optim.lr = 2e-4
optim.weight_decay = 0.0
train.update(
    output_dir="output/gpt_sft",
    train_iter=20,
)
train.scheduler.update(warmup_iter=2, min_lr_ratio=1.0)
