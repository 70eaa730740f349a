# Masked-LM data: fixed-length token samples of a corpus, 15% of the tokens chosen as targets
# (80% [MASK], 10% random, 10% kept), the same masks in every layout (dufu.data.mlm).
from dufu.config import LazyCall as L
from dufu.data import build_tokenizer
from dufu.data.mlm import build_mlm_datasets

tokenization = dict(
    # A byte-level BPE has no mask token: the mask id is the first id past the tokenizer (2047 here), so
    # model.vocab_size must be larger than the tokenizer's vocabulary.
    tokenizer=L(build_tokenizer)(kind="bpe", vocab_size=2047, corpus="builtin", path=None),
)

dataloader = dict(
    # tokenizer is filled in by the trainer from `tokenization.tokenizer`
    train=L(build_mlm_datasets)(data_path="builtin", seq_length=128, valid_fraction=0.05, mask_prob=0.15, seed=1234),
)
