# Qwen3-30B-A3B (30,532,122,624 parameters, 29,909,792,768 without the embedding and head - the model card's
# 30.5B and 29.9B; 3,353,032,704 used per token, embedding and head included - the card's 3.3B activated: 48
# layers, hidden 2048, 32 query / 4 key-value heads of 128, an RMSNorm on every query and key head, no biases;
# in every block 128 SwiGLU experts of 768 with top-8 softmax routing, renormalised, no shared expert;
# vocabulary 151,936, untied head, RoPE theta 1,000,000, 40,960 positions). Meant for GPUs. Start from
# Alibaba's weights with model.pretrained=DIR (a Hugging Face Qwen3-30B-A3B directory, model_type qwen3_moe)
# and tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR.
from .llama3_8b import dataloader, optim, tokenization, train
from .common.models.moe import model

model.update(
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    ffn_hidden_size=6144,  # Qwen3-MoE's intermediate_size: the dense blocks' (this model has none)
    moe_ffn_hidden_size=768,
    num_experts=128,
    top_k=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qk_norm=True,
    aux_loss_coeff=0.001,
)
optim.lr = 1e-4
train.output_dir = "output/qwen3_30b_a3b"
