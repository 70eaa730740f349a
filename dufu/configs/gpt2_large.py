# GPT-2 large (774M parameters: 36 layers, hidden 1280, 20 heads, 1024 positions) on the built-in corpus, with the
# vocabulary padded from GPT-2's 50,257 to 50,304 (a multiple of 128): 774,090,240 parameters with the head tied
# (774,030,080 with vocab_size=50257, the published count). Meant for GPUs; start from OpenAI's weights with
# model.pretrained=DIR (a Hugging Face gpt2-large directory) and model.vocab_size=50257.
from .gpt2_small import dataloader, model, optim, tokenization, train

model.update(hidden_size=1280, num_layers=36, num_attention_heads=20)
optim.lr = 2.5e-4
train.output_dir = "output/gpt2_large"
