# Masked-LM pretraining of a small BERT on the built-in corpus (600 steps, a CPU-sized run):
# 4 layers, hidden 256, a 2047-token BPE plus the mask token, sequences of 128 tokens.
from .common.data.mlm import dataloader, tokenization
from .common.models.bert import model
from .common.optim import optim
from .common.train import train

model.update(
    vocab_size=2048,  # the BPE's 2047 tokens + the mask token (id 2047)
    hidden_size=256,
    num_layers=4,
    num_attention_heads=4,
    max_position_embeddings=128,
    type_vocab_size=2,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    pad_token_id=None,  # fixed-length samples: no padding
)
dataloader.train.update(seq_length=128, valid_fraction=0.1)  # 8 of the 79 documents: 77 validation samples

optim.update(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999))
train.update(
    output_dir="output/bert_pretrain",
    train_iter=600,
    train_micro_batch_size=16,
    log_period=10,
)
train.scheduler.warmup_iter = 60
train.evaluation.update(eval_period=200, eval_iter=4)
train.checkpointer.period = 200
