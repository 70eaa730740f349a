# T5-base (Raffel et al. 2020: 12 + 12 layers, d_model 768, 12 heads of 64, d_ff 3072, ReLU, tied head;
# 222,903,552 parameters with the published 32,128-token vocabulary), span-corruption pretraining on the
# built-in corpus with an 8,192-token BPE (the corpus is too small for more). Meant for GPUs.
from .t5_pretrain import dataloader, model, optim, tokenization, train

model.update(
    vocab_size=32128,
    d_model=768,
    d_kv=64,
    d_ff=3072,
    num_layers=12,
    num_heads=12,
    dropout_rate=0.0,
)
tokenization.tokenizer.vocab_size = 8192
dataloader.train.inputs_length = 512  # 568 raw tokens -> 512 inputs, 114 targets (T5's pretraining lengths)

optim.lr = 3e-4
train.update(
    output_dir="output/t5_base",
    train_iter=5000,
    train_micro_batch_size=8,
    global_batch_size=128,
    log_period=10,
)
train.scheduler.warmup_iter = 500
train.evaluation.update(eval_period=500, eval_iter=10)
train.checkpointer.period = 1000
