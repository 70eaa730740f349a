# The tiny Qwen3-MoE: 2 layers, hidden 64, 4 query / 2 key-value heads of 32 with an RMSNorm on every query and
# key head, 8 SwiGLU experts of 32 with top-2 softmax routing renormalised to sum to one and no shared expert in
# every block, load-balancing loss 0.01, byte-level vocabulary (257 tokens, padded to 384), sequence 32, no
# dropout, fp32.
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
    head_dim=32,
    ffn_hidden_size=64,  # no dense blocks
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_experts=8,
    top_k=2,
    norm_topk_prob=True,
    moe_ffn_hidden_size=32,
    qk_norm=True,
    aux_loss_coeff=0.01,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/qwen3_moe_debug")
