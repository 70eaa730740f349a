# The tiny mixture-of-experts decoder: 2 layers, hidden 64, 4 query / 2 key-value heads, 8 SwiGLU experts of
# 64 with top-2 routing in every block, load-balancing loss 0.01, byte-level vocabulary (257 tokens, padded to
# 384), sequence 32, no dropout, fp32. Trains in seconds on one CPU process.
from .common.data.corpus import dataloader, tokenization
from .common.models.moe import model
from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model.update(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=64,  # no dense blocks; equal to the experts' as Mixtral's one intermediate_size says
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_experts=8,
    top_k=2,
    moe_ffn_hidden_size=64,
    aux_loss_coeff=0.01,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/moe_debug")
