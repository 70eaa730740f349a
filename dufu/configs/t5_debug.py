# The tiny T5 the tests and multi-process checks use: t5_pretrain shrunk to 2 + 2 layers, d_model 64,
# 4 heads of 16, the byte-level vocabulary (257 tokens + 100 sentinels, padded to 384 so it splits over
# 2, 4 or 8 tensor-parallel ranks), inputs of 32 tokens, targets of 8, fp32.
from .t5_pretrain import dataloader, model, optim, tokenization, train

model.update(
    vocab_size=384,
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    dropout_rate=0.0,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.inputs_length = 32

optim.lr = 1e-3
train.update(
    output_dir="output/t5_debug",
    train_iter=20,
    train_micro_batch_size=4,
    log_period=1,
)
train.amp.enabled = False
train.scheduler.warmup_iter = 2
train.evaluation.update(eval_period=10, eval_iter=4)
train.checkpointer.period = 10
train.tensorboard = False
