# Supervised fine-tuning (SFT) of a pretrained GPT on prompt/response pairs, the loss on the response only
# (common/data/sft.py), as llama_sft does for LLaMA. model.pretrained: a dufu run (default: the output of
# `dufu train gpt_debug`) or a transformers GPT-2 directory whose sizes model.* match (then also the tokenizer:
# tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR).
from .common.data.sft import dataloader
from .common.finetune import finetune_run
from .gpt_debug import model, optim, tokenization, train

model.pretrained = "output/gpt_debug"
dataloader.train.seq_length = 32  # gpt_debug's max_position_embeddings

finetune_run(train, optim, "output/gpt_sft")
