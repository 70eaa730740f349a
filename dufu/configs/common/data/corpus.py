# Language-model data: a tokenizer and fixed-length token samples from a corpus.
# data_path is "builtin" (CPython's pydoc topics, ~465 KB of English), a .txt/.jsonl/.parquet/.arrow file or
# directory (or a `datasets` save_to_disk directory), the prefix of a .bin/.idx pair (Megatron's or dufu's), or a
# weighted blend of them: [0.7, "web", 0.3, "code"], {"web": 0.7, "code": 0.3} or "0.7 web 0.3 code" (docs/data.md).
from dufu.config import LazyCall as L
from dufu.data import build_lm_datasets, build_tokenizer

tokenization = dict(
    # path: a tokenizer.json file or a directory holding one, for kind="pretrained".
    tokenizer=L(build_tokenizer)(kind="bpe", vocab_size=2048, corpus="builtin", path=None),
)

dataloader = dict(
    # tokenizer is filled in by the trainer from `tokenization.tokenizer`
    # document_mask: no token attends across a document boundary inside a sample (Llama 3's long-context recipe)
    train=L(build_lm_datasets)(data_path="builtin", seq_length=128, valid_fraction=0.05, document_mask=False),
)
