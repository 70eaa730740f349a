# Llama 3.1 8B (8,030,261,248 parameters: 32 layers, hidden 4096, 32 query / 8 key-value heads, SwiGLU 14336,
# vocabulary 128,256, untied head, RoPE theta 500,000 with Llama 3.1's frequency scaling to 128k positions).
# Meant for GPUs. Train on the built-in corpus with a small BPE (the model keeps Llama 3's vocabulary size),
# or start from Meta's weights: model.pretrained=DIR (a Hugging Face Llama-3.1-8B directory) with
# tokenization.tokenizer.kind=pretrained tokenization.tokenizer.path=DIR.
from .common.data.corpus import dataloader, tokenization
from .common.models.llama import model
from .common.optim import optim
from .common.train import train

model.update(
    max_position_embeddings=131072,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)
tokenization.tokenizer.vocab_size = 8192  # the built-in corpus is too small for a 128k BPE
dataloader.train.seq_length = 2048

optim.lr = 3e-4
train.update(
    output_dir="output/llama3_8b",
    train_iter=5000,
    train_micro_batch_size=1,
    global_batch_size=64,
    log_period=10,
)
train.scheduler.warmup_iter = 200
train.activation_checkpoint.enabled = True
train.evaluation.update(eval_period=500, eval_iter=20)
train.checkpointer.period = 1000
train.generation.update(enabled=True, prompts=["The "], max_new_tokens=64)
