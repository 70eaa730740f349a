# The tiny T5 the tests and multi-process checks use: t5_pretrain shrunk to 2 + 2 layers, d_model 64,
# 4 heads of 16, the byte-level vocabulary (257 tokens + 100 sentinels, padded to 384 so it splits over
# 2, 4 or 8 tensor-parallel ranks), inputs of 32 tokens, targets of 8, fp32.
from .t5_pretrain import dataloader, model, optim, tokenization, train
from .common.debug import debug_run

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

debug_run(train, optim, "output/t5_debug")
