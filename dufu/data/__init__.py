"""The data pipeline: text -> tokenizer -> memory-mapped token file -> fixed-length samples -> batches.

::

    tokenizer = build_tokenizer("byte")                                   # or "bpe" / "pretrained"
    train_ds, valid_ds = build_lm_datasets("builtin", tokenizer, seq_length=256)  # or [0.7, "web", 0.3, "code"]
    sampler = ResumableBatchSampler(len(train_ds), global_batch_size=32, micro_batch_size=4,
                                    data_parallel_rank=rank, data_parallel_size=dp)
    for micro_batch in sampler.next_step():
        batch = collate(train_ds, micro_batch)                            # (B, seq_length + 1) int64

Modules: :mod:`~dufu.data.corpus` (text inputs and the built-in corpus),
:mod:`~dufu.data.hf_datasets` (``datasets`` files: .parquet, .arrow, save_to_disk),
:mod:`~dufu.data.tokenizer`, :mod:`~dufu.data.indexed_dataset` (the ``.bin`` /
``.idx`` format), :mod:`~dufu.data.preprocess` (``dufu preprocess``),
:mod:`~dufu.data.dataset` (samples and the train/validation split),
:mod:`~dufu.data.blend` (weighted blends of datasets) and
:mod:`~dufu.data.sampler`. Caches live under ``$DUFU_CACHE_DIR`` (default
``~/.cache/dufu``), see :mod:`~dufu.cache`.
"""

from .blend import BlendedDataset, ValidationSets
from .corpus import BUILTIN, builtin_documents, read_documents
from .dataset import TokenDataset, build_lm_datasets
from .indexed_dataset import IndexedDataset, IndexedDatasetWriter
from .preprocess import preprocess
from .sampler import ResumableBatchSampler, Sample, collate
from .tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "BUILTIN",
    "BlendedDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "ResumableBatchSampler",
    "Sample",
    "TokenDataset",
    "Tokenizer",
    "ValidationSets",
    "build_lm_datasets",
    "build_tokenizer",
    "builtin_documents",
    "collate",
    "preprocess",
    "read_documents",
]
