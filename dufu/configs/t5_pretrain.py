# Span-corruption pretraining of a small T5 on the built-in corpus (about two minutes of CPU time):
# 4 + 4 layers, d_model 256, 8 heads of 32, a 2048-token BPE + 100 sentinels (vocabulary padded to 2176),
# inputs of 64 tokens (from 70 raw tokens) and targets of 14. Dropout off in pretraining, as T5 v1.1.
# The last 10% of the documents are validation (143 samples: evaluation needs whole global batches).
from .common.data.span_corruption import dataloader, tokenization
from .common.models.t5 import model
from .common.optim import optim
from .common.train import train

model.update(
    vocab_size=2176,  # >= 2048 + 100 sentinels, a multiple of 128
    d_model=256,
    d_kv=32,
    d_ff=1024,
    num_layers=4,
    num_heads=8,
    dropout_rate=0.0,
)
dataloader.train.update(inputs_length=64, valid_fraction=0.1)

optim.update(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
train.update(
    output_dir="output/t5_pretrain",
    train_iter=400,  # about 4 epochs of the built-in corpus; longer runs overfit it
    train_micro_batch_size=16,
    log_period=10,
)
train.scheduler.warmup_iter = 40
train.evaluation.update(eval_period=200, eval_iter=4)
train.checkpointer.period = 200
