# The default recipe (`dufu train` with no config): a small GPT on the built-in corpus,
# one to two and a half minutes on two CPU cores (the fast dtype of the CPU: benchmarks/default_run.py), ending
# with a few generated samples. 400 steps (8 passes over
# the 800 training samples of 128 tokens) end near the best held-out perplexity (~105); at 600 steps the model
# overfits (validation perplexity back up to ~140).
from .common.data.corpus import dataloader, tokenization
from .common.models.gpt import model
from .common.optim import optim
from .common.train import train

model.update(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_attention_heads=4,
    max_position_embeddings=128,
    embedding_dropout=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
tokenization.tokenizer.vocab_size = 2048
dataloader.train.seq_length = 128
dataloader.train.valid_fraction = 0.15  # enough held-out text for a few global batches

optim.lr = 2e-3
train.update(
    output_dir="output/default",
    train_iter=400,
    train_micro_batch_size=16,
    log_period=10,
)
train.scheduler.warmup_iter = 30
train.evaluation.eval_period = 100
train.evaluation.eval_iter = 8
train.checkpointer.period = 200
train.generation.update(enabled=True, prompts=["The ", "A class ", "Python "], max_new_tokens=48)
