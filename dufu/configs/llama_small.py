# Pretraining a small LLaMA on the built-in corpus (the LLaMA counterpart of the default recipe): 4 layers,
# hidden 256, 4 query / 2 key-value heads, 2048-token BPE, sequence 128, the fast dtype (train.amp.enabled="auto"), generated samples at the end.
from .common.data.corpus import dataloader, tokenization
from .common.models.llama import model
from .common.optim import optim
from .common.train import train

model.update(
    vocab_size=2048,
    hidden_size=256,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=688,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
tokenization.tokenizer.vocab_size = 2048
dataloader.train.seq_length = 128

optim.lr = 2e-3
train.update(
    output_dir="output/llama_small",
    train_iter=600,
    train_micro_batch_size=16,
    log_period=10,
)
train.scheduler.warmup_iter = 30
train.evaluation.update(eval_period=200, eval_iter=8)
train.checkpointer.period = 200
train.generation.update(enabled=True, prompts=["The ", "A class ", "Python "], max_new_tokens=48)
