# BERT-base (110M parameters: 12 layers, hidden 768, 12 heads, 512 positions) masked-LM pretraining with an
# 8191-token BPE + the mask token. On the built-in corpus it runs BERT's first phase (sequences of 128 tokens,
# Devlin et al. 2019, appendix A.2); for real pretraining point dataloader.train.data_path at a large corpus and
# raise seq_length to 512 for the last steps. Meant for GPUs or long CPU runs.
from .common.data.mlm import dataloader, tokenization
from .common.models.bert import model
from .common.optim import optim
from .common.train import train

model.update(vocab_size=8192, pad_token_id=None)
tokenization.tokenizer.vocab_size = 8191  # the built-in corpus is too small for BERT's 30k WordPiece
dataloader.train.update(seq_length=128, valid_fraction=0.1)

optim.update(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
train.update(
    output_dir="output/bert_base",
    train_iter=10000,
    train_micro_batch_size=8,
    global_batch_size=64,
    log_period=10,
)
train.scheduler.warmup_iter = 1000
train.evaluation.update(eval_period=1000, eval_iter=1)
train.checkpointer.period = 1000
