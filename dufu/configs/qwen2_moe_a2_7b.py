# Qwen1.5-MoE-A2.7B (14,315,784,192 parameters, about 2.7B used per token: 24 layers, hidden 2048, 16 heads,
# Q/K/V biases; in every block 60 SwiGLU experts of 1408 with top-4 routing, not renormalised, beside a shared
# SwiGLU expert of 5632 scaled by a sigmoid gate; vocabulary 151,936, untied head, 8192 positions). Meant for
# GPUs. Start from Alibaba's weights with model.pretrained=DIR (a Hugging Face Qwen1.5-MoE-A2.7B directory,
# model_type qwen2_moe) and a pretrained tokenizer from DIR.
from .llama3_8b import dataloader, optim, tokenization, train
from .common.models.moe import model

model.update(
    vocab_size=151936,
    hidden_size=2048,
    num_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    ffn_hidden_size=5632,  # Qwen2-MoE's intermediate_size: the dense blocks' (this model has none)
    moe_ffn_hidden_size=1408,
    num_experts=60,
    top_k=4,
    norm_topk_prob=False,
    shared_ffn_hidden_size=5632,
    shared_expert_gate=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qkv_bias=True,
    aux_loss_coeff=0.001,
)
optim.lr = 1e-4
train.output_dir = "output/qwen2_moe_a2_7b"
