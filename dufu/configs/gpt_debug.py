# The tiny GPT every test and multi-process check uses: 2 layers, hidden 64, 4 heads,
# byte-level vocabulary (257 tokens, padded to 384 so it splits over 2, 4 or 8 tensor-parallel ranks),
# sequence 32, no dropout, fp32.
from .common.data.corpus import dataloader, tokenization
from .common.models.gpt import model
from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model.update(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    embedding_dropout=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/gpt_debug")
