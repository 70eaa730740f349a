# Qwen3-8B (8,190,735,360 parameters, 6,946,075,648 without the embedding and head - the model card's 8.2B and
# 6.95B: 36 layers, hidden 4096, 32 query / 8 key-value heads of 128, an RMSNorm on every query and key head,
# no biases, SwiGLU 12288, vocabulary 151,936, untied head, RoPE theta 1,000,000, 40,960 positions). Meant for
# GPUs. Start from Alibaba's weights with model.pretrained=DIR (a Hugging Face Qwen3-8B directory, model_type
# qwen3) and tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR. Tensor parallelism must
# divide the 8 key-value heads.
from .llama3_8b import dataloader, optim, tokenization, train
from .common.models.llama import model

model.update(
    vocab_size=151936,
    hidden_size=4096,
    num_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    ffn_hidden_size=12288,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling=None,
    qk_norm=True,
    tie_word_embeddings=False,
)
optim.lr = 1e-4
train.output_dir = "output/qwen3_8b"
