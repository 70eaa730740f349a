# Supervised fine-tuning (SFT) of a pretrained LLaMA on prompt/response pairs, the loss on the response only
# (common/data/sft.py: the built-in pydoc explanations, or your .jsonl with dataloader.train.data_path=FILE).
# model.pretrained names where the weights come from — a dufu run (default: the output of
# `dufu train llama_debug`) or a Hugging Face Llama/Qwen2 directory, whose sizes model.* must match (for an HF
# directory also set the tokenizer: tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR,
# and a longer dataloader.train.seq_length). Lower learning rate, short warmup, no decay to zero.
from .common.data.sft import dataloader
from .common.finetune import finetune_run
from .llama_debug import model, optim, tokenization, train

model.pretrained = "output/llama_debug"
dataloader.train.seq_length = 32  # llama_debug's max_position_embeddings

finetune_run(train, optim, "output/llama_sft")
