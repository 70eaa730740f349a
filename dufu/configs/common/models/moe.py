# Mixture-of-experts decoder (the LLaMA decoder with MoE feed-forwards: Mixtral, Qwen2-MoE). Sizes here are
# Mixtral 8x7B; recipes edit them. Qwen2-MoE sets qkv_bias=True, a gated shared expert, norm_topk_prob=False.
from dufu.config import LazyCall as L
from dufu.models.moe import MoEModel

model = L(MoEModel)(
    vocab_size=32000,
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=None,  # hidden_size / num_attention_heads
    ffn_hidden_size=14336,  # the dense blocks' SwiGLU (Mixtral has none)
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    rope_scaling=None,
    qkv_bias=False,
    out_bias=False,
    mlp_bias=False,  # dense blocks only: experts have no biases
    qk_norm=False,  # an RMSNorm of head_dim on each query and key head before the rotation (Qwen3)
    embedding_dropout=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    fused_loss=False,  # see common/models/llama.py
    # The experts (dufu.layers.MoE): each MoE block routes every token to top_k of num_experts SwiGLU experts.
    num_experts=8,
    top_k=2,
    moe_ffn_hidden_size=14336,  # each expert's hidden size (None: ffn_hidden_size)
    norm_topk_prob=True,  # renormalise the top-k router weights to sum to 1 (Mixtral)
    capacity_factor=None,  # None: dropless; e.g. 1.25 caps each expert at 1.25 x its even share of assignments
    # Load-balancing loss (Switch Transformer) and router z-loss (ST-MoE) weights. They reach the gradients
    # through each MoE block's output; the logged loss is the language-model loss alone.
    aux_loss_coeff=0.01,
    z_loss_coeff=0.0,
    shared_ffn_hidden_size=None,  # a shared expert every token goes through (Qwen2-MoE, DeepSeek-MoE)
    shared_expert_gate=False,  # scale the shared expert by a learned sigmoid gate (Qwen2-MoE)
    # Block i is a MoE block when (i + 1) % moe_layer_freq == 0 and i not in mlp_only_layers (Qwen2-MoE's
    # decoder_sparse_step and mlp_only_layers); the others keep a dense SwiGLU of ffn_hidden_size.
    moe_layer_freq=1,
    mlp_only_layers=[],
    # DeepSeekMoE routing (dufu.layers.MoE): "sigmoid" scores, group-limited routing (n_group groups, topk_group
    # kept per token), the routed scaling factor; auxiliary-loss-free balancing (score_bias, moved by
    # bias_update_rate x sign of the load error after each step) and the sequence-wise balance loss.
    score_func="softmax",
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    score_bias=False,
    bias_update_rate=0.0,
    seq_aux_loss_coeff=0.0,
    # A Hugging Face Mixtral/Qwen2-MoE directory or a dufu run/checkpoint to start from (sizes must match it).
    pretrained=None,
)
