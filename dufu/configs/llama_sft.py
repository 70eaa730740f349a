# Fine-tuning (SFT) a pretrained LLaMA: model.pretrained names where the weights come from — a dufu run
# (default: the output of `dufu train llama_debug`) or a Hugging Face Llama/Qwen2 directory, whose sizes
# model.* must match (for an HF directory also set the tokenizer: tokenization.tokenizer.kind=pretrained
# tokenization.tokenizer.path=DIR). Lower learning rate, short warmup, no decay to zero. Point
# dataloader.train.data_path at your own text (.txt/.jsonl); the loss covers every token.
from .llama_debug import dataloader, model, optim, tokenization, train

model.pretrained = "output/llama_debug"

optim.lr = 2e-4
optim.weight_decay = 0.0
train.update(
    output_dir="output/llama_sft",
    train_iter=20,
)
train.scheduler.update(warmup_iter=2, min_lr_ratio=1.0)
