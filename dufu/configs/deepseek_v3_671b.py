# DeepSeek-V3 (DeepSeek-AI 2024; published as 671B total / 37B active parameters, plus a 14B multi-token-prediction
# module: 685B in the released checkpoint). 61 layers, hidden 7168; multi-head latent attention with 128 heads,
# query rank 1536, key/value rank 512, per head 128 + 64 (rotary) query/key and 128 value features, YaRN rotary
# scaling to 163,840 positions; the first 3 blocks dense (SwiGLU 18432), the other 58 DeepSeekMoE: 256 routed
# experts of 2048, top 8 by sigmoid score within the 4 best of 8 groups, weights renormalised and x 2.5, one
# shared expert, balanced by a choice bias (gamma 0.001) and a sequence-wise loss (1e-4); vocabulary 129,280,
# untied head; one MTP depth, loss weight 0.3. Parameter count (tests/models/test_deepseek.py, built on the meta
# device): 671,026,404,352 without the MTP module ("671B"); per token 37,552,282,624, or 36,625,603,584 without the
# input embedding (a lookup), as DeepSeek counts activated parameters ("37B"; the same count gives DeepSeek-V2-
# Lite's published 2.4B). The MTP module has 11,610,067,968 of its own (its embedding and head are the main
# model's); with the copies of the embedding and the head that the released checkpoint stores for it
# (2 x 129,280 x 7168) that is 13,463,426,048 (the published "14B"), and the checkpoint 684,489,830,400 ("685B").
# Meant for GPU clusters (expert, pipeline and tensor parallelism). Start from DeepSeek's weights with
# model.pretrained=DIR (a Hugging Face DeepSeek-V3 directory, model_type deepseek_v3, in bf16: its MTP layer
# model.layers.61 is read into the MTP depth).
from .llama3_8b import dataloader, optim, tokenization, train
from dufu.config import LazyCall as L
from dufu.models.deepseek import DeepseekV3Model

model = L(DeepseekV3Model)(
    vocab_size=129280,
    hidden_size=7168,
    num_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,  # None: one plain query projection (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    ffn_hidden_size=18432,  # the dense blocks' SwiGLU
    first_k_dense=3,
    num_experts=256,
    top_k=8,
    moe_ffn_hidden_size=2048,
    num_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    score_func="sigmoid",
    score_bias=True,  # auxiliary-loss-free balancing: the per-expert choice bias
    bias_update_rate=0.001,  # its gamma (DeepSeek-V3: 0.001 for the first 14.3T tokens, then 0)
    seq_aux_loss_coeff=0.0001,
    aux_loss_coeff=0.0,
    capacity_factor=None,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    rope_interleave=True,
    attention_bias=False,
    attention_dropout=0.0,
    embedding_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.006,
    mtp_depth=1,
    mtp_loss_weight=0.3,  # 0.1 for the last 4.8T tokens
    fused_loss=False,
    pretrained=None,
)
dataloader.train.seq_length = 4096
optim.lr = 2.2e-4
train.output_dir = "output/deepseek_v3_671b"
