# LLaMA-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention). Sizes here are Llama 3 8B;
# recipes edit them. Qwen2 sets qkv_bias=True.
from dufu.config import LazyCall as L
from dufu.models.llama import LlamaModel

model = L(LlamaModel)(
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=None,  # hidden_size / num_attention_heads
    ffn_hidden_size=14336,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=None,  # e.g. dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    #                      original_max_position_embeddings=8192) for Llama 3.1's long context
    qkv_bias=False,
    out_bias=False,
    mlp_bias=False,
    qk_norm=False,  # an RMSNorm of head_dim on each query and key head before the rotation (Qwen3)
    embedding_dropout=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    # True: with labels, output projection + cross entropy chunk by chunk, never the whole (B, T, V) fp32 logits
    # (dufu.layers.loss.fused_linear_cross_entropy; the output's logits are then None). Less memory (GPT-2 small,
    # 4 x 256 tokens: peak 297 vs 589 MiB in fp32), but not faster on 2 CPU threads at the default recipe's shape
    # (benchmarks/results/fused_loss-*.md), so off by default; turn it on for large vocabularies.
    fused_loss=False,
    # A Hugging Face Llama/Qwen2 directory or a dufu run/checkpoint to start from (sizes above must match it).
    pretrained=None,
)
