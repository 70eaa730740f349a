# Mixtral 8x7B (46,702,792,704 parameters, about 12.9B used per token: 32 layers, hidden 4096, 32 query / 8
# key-value heads, 8 SwiGLU experts of 14336 with top-2 routing in every block, vocabulary 32,000, untied head,
# RoPE theta 1,000,000, 32k positions). Meant for GPUs. Train on the built-in corpus with a small BPE (the
# model keeps Mixtral's vocabulary size), or start from Mistral AI's weights: model.pretrained=DIR (a Hugging
# Face Mixtral-8x7B-v0.1 directory) with tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR.
from .llama3_8b import dataloader, optim, tokenization, train
from .common.models.moe import model

model.update(
    vocab_size=32000,
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    ffn_hidden_size=14336,
    moe_ffn_hidden_size=14336,
    num_experts=8,
    top_k=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
)
train.output_dir = "output/mixtral_8x7b"
