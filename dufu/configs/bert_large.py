# BERT-large (340M parameters: 24 layers, hidden 1024, 16 heads): bert_base made large.
from .bert_base import dataloader, model, optim, tokenization, train

model.update(hidden_size=1024, num_layers=24, num_attention_heads=16)
train.output_dir = "output/bert_large"
