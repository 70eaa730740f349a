# Moonlight-16B-A3B (Moonshot AI 2025; the DeepSeek-V3 architecture at DeepSeek-V2-Lite's scale): 27 layers, hidden
# 2048, multi-head latent attention with 16 heads, a plain query projection (no query rank), key/value rank 512,
# per head 128 + 64 (rotary) query/key and 128 value features; the first block dense (SwiGLU 11264), the other 26
# DeepSeekMoE: 64 routed experts of 1408, top 6 by sigmoid score (no group limit), renormalised and x 2.446, two
# shared experts; vocabulary 163,840, untied head, rotary theta 50,000, 8192 positions (Moonlight's config.json, as
# Megatron-core's Moonlight config repeats it). Parameter count (tests/models/test_deepseek.py, meta device):
# 15,960,108,544 in all, 15.29B without the embedding and the head (Moonlight's paper: 15.29B); per token
# 2,914,774,528, 2.24B without the embedding and the head (the paper's 2.24B activated; "16B-A3B" rounds the
# counts with them). DeepSeek-V2-Lite differs in its vocabulary (102,400), dense SwiGLU (10944), softmax routing
# and no scaling: 15.7B / 2.4B as DeepSeek counts. No multi-token prediction (Moonlight has none). Meant for GPUs;
# start from Moonshot's weights with model.pretrained=DIR (a Hugging Face Moonlight-16B-A3B directory).
from .deepseek_v3_671b import dataloader, model, optim, tokenization, train

model.update(
    vocab_size=163840,
    hidden_size=2048,
    num_layers=27,
    num_attention_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=11264,
    first_k_dense=1,
    num_experts=64,
    top_k=6,
    moe_ffn_hidden_size=1408,
    num_shared_experts=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.446,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    rope_scaling=None,
    initializer_range=0.02,
    mtp_depth=0,
)
dataloader.train.seq_length = 4096
optim.lr = 4.2e-4
train.output_dir = "output/deepseek_v3_16b"
