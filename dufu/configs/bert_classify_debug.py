# The tiny sentence classifier the multi-process checks use: bert_classify's task (pydoc topic groups, 4 classes)
# on a 2-layer BERT trained from scratch, hidden 64, 4 heads, the byte-level vocabulary (padded to 384), no
# dropout, fp32. Sentences are padded to 32 bytes, so every batch carries an `attention_mask` besides the
# `input_ids` and `labels`: the check that masks reach every pipeline stage.
from dufu.config import LazyCall as L
from dufu.data import build_tokenizer
from dufu.data.classification import build_topic_classification_datasets
from dufu.models.bert import BertForSequenceClassification

from .common.optim import optim
from .common.train import train
from .common.debug import debug_run

model = L(BertForSequenceClassification)(
    vocab_size=384,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
    type_vocab_size=2,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    pad_token_id=None,  # the byte tokenizer pads with its end-of-document id: a real token elsewhere
    num_labels=4,
)

tokenization = dict(tokenizer=L(build_tokenizer)(kind="byte"))

dataloader = dict(
    # tokenizer is filled in by the trainer; samples are sentence + end-of-document id, padded to 32 bytes
    train=L(build_topic_classification_datasets)(seq_length=32, valid_fraction=0.2, seed=0),
)

debug_run(train, optim, "output/bert_classify_debug")
