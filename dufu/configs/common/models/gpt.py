# GPT-2 architecture. Sizes here are GPT-2 small (124M); recipes edit them.
from dufu.config import LazyCall as L
from dufu.models.gpt import GPTModel

model = L(GPTModel)(
    vocab_size=50304,
    hidden_size=768,
    num_layers=12,
    num_attention_heads=12,
    head_dim=None,  # hidden_size // num_attention_heads; a pruned model keeps its heads' size with fewer heads
    ffn_hidden_size=None,  # 4 x hidden_size
    max_position_embeddings=1024,
    embedding_dropout=0.1,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    layernorm_epsilon=1e-5,
    activation="gelu_tanh",
    bias=True,
    tie_word_embeddings=True,
    initializer_range=0.02,
    # True: with labels, output projection + cross entropy chunk by chunk, never the whole (B, T, V) fp32 logits
    # (dufu.layers.loss.fused_linear_cross_entropy; the output's logits are then None). Less memory (GPT-2 small,
    # 4 x 256 tokens: peak 297 vs 589 MiB in fp32), but not faster on 2 CPU threads at the default recipe's shape
    # (benchmarks/results/fused_loss-*.md), so off by default; turn it on for large vocabularies.
    fused_loss=False,
    # A Hugging Face GPT-2 directory or a dufu run/checkpoint to start from (sizes above must match it).
    pretrained=None,
)
