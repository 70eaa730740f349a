# Long-context pretraining: llama_small's decoder (4 layers, hidden 256, 4 query / 2 key-value heads) on
# sequences of 8,192 tokens, every sample split over 4 ranks by context parallelism, blocks checkpointed in full.
#
#     dufu train llama_long --nproc 4                          # cp 4: each rank holds 2,048 tokens of a sample
#     dufu train llama_long --nproc 8 train.dist.data_parallel_size=2          # dp 2 x cp 4
#     dufu train llama_long --nproc 2 train.dist.context_parallel_size=2      # cp 2, on fewer devices
#     dufu train llama_long --nproc 4 dataloader.train.seq_length=16384 model.max_position_embeddings=16384
#
# The world is dp x cp x tp x pp; seq_length must be divisible by 2 x cp (each rank holds chunks r and 2cp-1-r
# of the 2cp chunks: dufu/parallel/context_parallel.py). The built-in corpus (~465 KB) gives only a few dozen
# samples this long; point dataloader.train.data_path at a real corpus for a real run.
#
# Memory, measured on the CPU (benchmarks/results/context-parallel-*.md): context parallelism splits every
# activation that is per token (per-rank activations 0.57x at cp 2 and 0.32x at cp 4 at 16K tokens), but each rank
# still holds the whole sequence's keys and values per layer; checkpointing whole blocks ("full") keeps only each
# block's input, so the gathered keys and values exist for one block at a time, in its recompute.
from .llama_small import dataloader, model, optim, tokenization, train

SEQ_LENGTH = 8192

model.update(
    max_position_embeddings=SEQ_LENGTH,
    # A larger RoPE base rotates the low-frequency dimensions more slowly, so far-apart tokens keep telling
    # their distance apart instead of wrapping around: Llama 3 trains its 8K context at 500,000 (10,000 was
    # Llama 2's at 4K); Code Llama raised it to 1,000,000 for 16K (Roziere et al. 2023, section 2.4).
    rope_theta=500000.0,
)
dataloader.train.seq_length = SEQ_LENGTH
# the last 15% of the built-in corpus's documents: 3 validation samples of 8,192 tokens, one global batch at
# least (5% holds less than one sample)
dataloader.train.valid_fraction = 0.15

optim.lr = 1e-3
train.update(
    output_dir="output/llama_long",
    train_iter=200,
    # one sample of 8,192 tokens per micro-batch and data-parallel rank, two micro-batches per step
    train_micro_batch_size=1,
    global_batch_size=2,
    log_period=1,
)
train.dist.context_parallel_size = 4
train.activation_checkpoint.update(enabled=True, mode="full")
train.scheduler.warmup_iter = 10
train.evaluation.update(eval_period=100, eval_iter=1)
train.checkpointer.period = 100
train.generation.update(enabled=True, prompts=["The "], max_new_tokens=32)
