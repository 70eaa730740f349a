# BERT-base (110M parameters: 12 layers, hidden 768, 12 heads, 512 positions) masked-LM pretraining on the
# built-in corpus with an 8191-token BPE + the mask token. Meant for GPUs or long CPU runs.
from .common.data.mlm import dataloader, tokenization
from .common.models.bert import model
from .common.optim import optim
from .common.train import train

model.update(vocab_size=8192, pad_token_id=None)
tokenization.tokenizer.vocab_size = 8191  # the built-in corpus is too small for BERT's 30k WordPiece
dataloader.train.seq_length = 512

optim.update(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
train.update(
    output_dir="output/bert_base",
    train_iter=10000,
    train_micro_batch_size=8,
    global_batch_size=256,
    log_period=10,
)
train.scheduler.warmup_iter = 1000
train.amp.enabled = True
train.evaluation.update(eval_period=1000, eval_iter=20)
train.checkpointer.period = 1000
