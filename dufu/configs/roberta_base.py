# RoBERTa-base (Liu et al. 2019): BERT-base's network with RoBERTa's positions (counted from pad_token_id + 1,
# hence 514 = 512 + 2 positions), no token types, LayerNorm eps 1e-5 and Adam's beta2 = 0.98, on bert_base's data.
# RoBERTa's positions need a small padding id; the BPE's end-of-document token (id 0) serves: the separators between
# documents then take the padding position, and every other token counts on from pad_token_id + 1.
from dufu.models.bert import RobertaForMaskedLM

from .bert_base import dataloader, model, optim, tokenization, train

model._target_ = RobertaForMaskedLM
model.update(max_position_embeddings=514, type_vocab_size=1, pad_token_id=0, layernorm_epsilon=1e-5)
optim.update(betas=(0.9, 0.98))
train.update(output_dir="output/roberta_base", global_batch_size=64)
