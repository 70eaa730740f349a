# T5-base (Raffel et al. 2020: 12 + 12 layers, d_model 768, 12 heads of 64, d_ff 3072, ReLU, tied head;
# 222,903,552 parameters with the published 32,128-token vocabulary), span-corruption pretraining with T5's
# lengths (568 raw tokens -> 512 inputs, 114 targets). Meant for GPUs and a real corpus
# (dataloader.train.data_path=...): the built-in corpus gives only 130 training samples of this length with an
# 8,192-token BPE (and 53 validation samples, hence the small global batch).
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
dataloader.train.update(inputs_length=512, valid_fraction=0.2)

optim.lr = 3e-4
train.update(
    output_dir="output/t5_base",
    train_iter=5000,
    train_micro_batch_size=8,
    global_batch_size=32,
    log_period=10,
)
train.scheduler.warmup_iter = 500
train.evaluation.update(eval_period=500, eval_iter=1)
train.checkpointer.period = 1000
