# The tiny DeepSeek-V3: 3 layers, hidden 64, multi-head latent attention with 4 heads (query rank 32, key/value rank
# 32, per head 16 + 8 rotary query/key and 16 value features, interleaved rotary pairs); block 0 dense (SwiGLU 128),
# blocks 1-2 DeepSeekMoE: 8 routed experts of 32, top 2 by sigmoid score within the best of 2 groups, renormalised
# and x 2.5, one shared expert, a choice bias moved by 0.001 per step and a sequence-wise balance loss of 1e-4; one
# multi-token-prediction depth (loss weight 0.3); byte-level vocabulary (257 tokens, padded to 384: a vocabulary of
# 256 cannot hold them), sequence 32, no dropout, fp32. Trains in seconds on one CPU process.
from .common.data.corpus import dataloader, tokenization
from .deepseek_v3_671b import model
from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model.update(
    vocab_size=384,
    hidden_size=64,
    num_layers=3,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    ffn_hidden_size=128,
    first_k_dense=1,
    num_experts=8,
    top_k=2,
    moe_ffn_hidden_size=32,
    num_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=32,
    rope_scaling=None,
    initializer_range=0.02,
    mtp_depth=1,
    mtp_loss_weight=0.3,
)
tokenization.tokenizer.update(kind="byte", vocab_size=None)
dataloader.train.seq_length = 32

debug_run(train, optim, "output/deepseek_v3_debug")
