# GPT-2 XL (1.56B parameters: 48 layers, hidden 1600, 25 heads, 1024 positions) on the built-in corpus, with the
# vocabulary padded from GPT-2's 50,257 to 50,304 (a multiple of 128): 1,557,686,400 parameters with the head tied
# (1,557,611,200 with vocab_size=50257, the published count). Meant for GPUs; start from OpenAI's weights with
# model.pretrained=DIR (a Hugging Face gpt2-xl directory) and model.vocab_size=50257.
from .gpt2_small import dataloader, model, optim, tokenization, train

model.update(hidden_size=1600, num_layers=48, num_attention_heads=25)
optim.lr = 2e-4
train.output_dir = "output/gpt2_xl"
