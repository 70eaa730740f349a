# The tiny Qwen3: llama_debug with an RMSNorm on every query and key head and an explicit head size (4 query /
# 2 key-value heads of 32, wider than hidden 64 / 4 as in Qwen3-30B-A3B): 2 layers, hidden 64, SwiGLU 176,
# byte-level vocabulary (257 tokens, padded to 384), sequence 32, no dropout, fp32.
from .common.data.corpus import dataloader, tokenization
from .common.models.llama import model
from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model.update(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    ffn_hidden_size=176,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    qk_norm=True,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/qwen3_debug")
