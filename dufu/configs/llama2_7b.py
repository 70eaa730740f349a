# Llama 2 7B (6,738,415,616 parameters: 32 layers, hidden 4096, 32 heads without grouping, SwiGLU 11008,
# vocabulary 32,000, untied head, 4096 positions). Meant for GPUs; start from Meta's weights with
# model.pretrained=DIR (a Hugging Face Llama-2-7b directory) and a pretrained tokenizer from DIR.
from .llama3_8b import dataloader, model, optim, tokenization, train

model.update(
    vocab_size=32000,
    num_key_value_heads=32,
    ffn_hidden_size=11008,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
)
train.output_dir = "output/llama2_7b"
