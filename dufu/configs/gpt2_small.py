# GPT-2 small (124M parameters: 12 layers, hidden 768, 12 heads, 1024 positions) on the built-in corpus
# with a 50,304-token BPE (GPT-2's 50,257 padded to a multiple of 128). Meant for GPUs or long CPU runs.
from .common.data.corpus import dataloader, tokenization
from .common.models.gpt import model
from .common.optim import optim
from .common.train import train

model.update(vocab_size=50304, max_position_embeddings=1024)
tokenization.tokenizer.vocab_size = 8192  # the built-in corpus is too small for a 50k BPE
dataloader.train.seq_length = 1024

optim.lr = 6e-4
train.update(
    output_dir="output/gpt2_small",
    train_iter=5000,
    train_micro_batch_size=8,
    global_batch_size=64,
    log_period=10,
)
train.scheduler.warmup_iter = 200
train.evaluation.update(eval_period=500, eval_iter=20)
train.checkpointer.period = 1000
train.generation.update(enabled=True, prompts=["The "], max_new_tokens=64)
