# The tiny BERT every masked-LM test and multi-process check uses: bert_pretrain shrunk to 2 layers,
# hidden 64, 4 heads, the byte-level vocabulary (257 tokens + the mask token 257, padded to 384 so it splits
# over 2, 4 or 8 tensor-parallel ranks), sequence 32, no dropout, fp32.
from .bert_pretrain import dataloader, model, optim, tokenization, train
from .common.debug import debug_run

model.update(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/bert_debug")
