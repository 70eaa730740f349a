# GPT-2 medium (350M parameters: 24 layers, hidden 1024, 16 heads, 1024 positions) on the built-in corpus, with the
# vocabulary padded from GPT-2's 50,257 to 50,304 (a multiple of 128): 354,871,296 parameters with the head tied
# (354,823,168 with vocab_size=50257, the published count). Meant for GPUs; start from OpenAI's weights with
# model.pretrained=DIR (a Hugging Face gpt2-medium directory) and model.vocab_size=50257.
from .gpt2_small import dataloader, model, optim, tokenization, train

model.update(hidden_size=1024, num_layers=24, num_attention_heads=16)
optim.lr = 3e-4
train.output_dir = "output/gpt2_medium"
