# Qwen2 0.5B (494,032,768 parameters: 24 layers, hidden 896, 14 query / 2 key-value heads, SwiGLU 4864,
# Q/K/V biases, vocabulary 151,936 with the head tied to the embedding, RoPE theta 1,000,000).
# Start from Alibaba's weights with model.pretrained=DIR (a Hugging Face Qwen2-0.5B directory) and a
# pretrained tokenizer from DIR. Tensor parallelism must divide the 2 key-value heads (tp 2).
from .llama3_8b import dataloader, optim, tokenization, train
from .common.models.llama import model

model.update(
    vocab_size=151936,
    hidden_size=896,
    num_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    ffn_hidden_size=4864,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    qkv_bias=True,
    tie_word_embeddings=True,
)
optim.lr = 1e-4
train.output_dir = "output/qwen2_0_5b"
