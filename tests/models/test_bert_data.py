"""Masked-LM and classification data: BERT's 80/10/10 masking, masks fixed by (seed, index), dict batches,
the pydoc topic-group task, and the bert_debug recipe training in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dufu.data import Sample, build_tokenizer, collate
from dufu.data.classification import LABELS, ClassificationDataset, build_topic_classification_datasets
from dufu.data.mlm import IGNORE_INDEX, MaskedLMDataset, build_mlm_datasets, mask_token_id


class Tokens:
    """A stand-in token dataset: sample i is (i + arange(T + 1)) % 200 + 10."""

    def __init__(self, n=400, T=64):
        self.n, self.T = n, T

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (i + np.arange(self.T + 1)) % 200 + 10


def test_masking_follows_bert_80_10_10():
    ds = MaskedLMDataset(Tokens(), mask_token_id=999, random_vocab_size=300, mask_prob=0.15, seed=3,
                         special_ids=(10,))
    chosen = masked = random = kept = total = 0
    for i in range(len(ds)):
        s = ds[i]
        tokens = Tokens()[i][:64]
        assert s["input_ids"].shape == s["labels"].shape == (64,) and s.shape == (65,)
        target = s["labels"] != IGNORE_INDEX
        assert target.any()
        assert (s["labels"][target] == tokens[target]).all()
        assert (s["input_ids"][~target] == tokens[~target]).all()  # only targets are changed
        assert not target[tokens == 10].any()  # special ids are never targets
        total += (tokens != 10).sum()
        chosen += target.sum()
        masked += (s["input_ids"][target] == 999).sum()
        kept += (s["input_ids"][target] == tokens[target]).sum()
        random += ((s["input_ids"][target] != 999) & (s["input_ids"][target] != tokens[target])).sum()
    assert chosen / total == pytest.approx(0.15, abs=0.01)
    assert masked / chosen == pytest.approx(0.8, abs=0.02)
    assert random / chosen == pytest.approx(0.1, abs=0.015)  # a random draw may hit the original: counted as kept
    assert kept / chosen == pytest.approx(0.1, abs=0.015)


def test_masks_depend_only_on_seed_and_index():
    a = MaskedLMDataset(Tokens(), 999, 300, seed=1)
    b = MaskedLMDataset(Tokens(), 999, 300, seed=1)
    c = MaskedLMDataset(Tokens(), 999, 300, seed=2)
    for i in (7, 3, 7, 0):  # any order, any repetition: the same sample
        np.testing.assert_array_equal(a[i]["input_ids"], b[i]["input_ids"])
        np.testing.assert_array_equal(a[i]["labels"], b[i]["labels"])
    assert any((a[i]["labels"] != c[i]["labels"]).any() for i in range(5))


def test_collate_stacks_dict_samples_and_keeps_token_samples():
    ds = MaskedLMDataset(Tokens(), 999, 300)
    batch = collate(ds, [4, 1])
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (2, 64) and batch["input_ids"].dtype == torch.int64
    torch.testing.assert_close(batch["labels"][1], torch.from_numpy(ds[1]["labels"]))
    plain = collate(Tokens(), [0, 1])
    assert isinstance(plain, torch.Tensor) and plain.shape == (2, 65) and plain.dtype == torch.int64
    floats = collate([Sample(input_ids=np.arange(3), labels=np.float32(0.5))], [0])
    assert floats["labels"].dtype == torch.float32 and floats["labels"].shape == (1,)


def test_mlm_datasets_from_the_builtin_corpus():
    tok = build_tokenizer("byte")
    train, valid = build_mlm_datasets(tok, seq_length=32)
    assert mask_token_id(tok) == 257 == train.mask_token_id  # the byte tokenizer has no mask token
    assert train[0]["input_ids"].shape == (32,) and train[0].shape[0] - 1 == 32
    assert (train[0]["input_ids"] == 257).any() or (train[0]["labels"] != IGNORE_INDEX).any()
    assert not (valid[0]["labels"] == tok.eod_id).any()
    assert train.seed != valid.seed


def test_topic_classification_task_is_balanced_and_split():
    tok = build_tokenizer("byte")
    train, valid = build_topic_classification_datasets(tok, seq_length=40, valid_fraction=0.2)
    labels = np.concatenate([train.labels, valid.labels])
    counts = np.bincount(labels, minlength=len(LABELS))
    assert len(LABELS) == 4 and (counts == counts[0]).all() and counts[0] > 200
    assert len(valid) == round(len(labels) * 0.2)
    assert not set(train.texts) & set(valid.texts)
    s = train[0]
    assert s["input_ids"].shape == s["attention_mask"].shape == (40,) and s["labels"].shape == ()
    n = int(s["attention_mask"].sum())
    assert s["input_ids"][n - 1] == tok.eod_id  # the byte tokenizer has no [SEP]: the separator closes it
    assert (s["attention_mask"][:n] == 1).all() and (s["attention_mask"][n:] == 0).all()


def test_classification_samples_use_the_tokenizers_cls_and_sep(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "hello": 4, "world": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("pretrained", path=tmp_path)
    ds = ClassificationDataset(["hello world", "world " * 10], [1, 0], tok, seq_length=6)
    assert ds[0]["input_ids"].tolist() == [2, 4, 5, 3, 0, 0]
    assert ds[0]["attention_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert ds[1]["input_ids"].tolist() == [2, 5, 5, 5, 5, 3]  # cut to fit, [SEP] kept


def test_bert_debug_trains_in_one_process(tmp_path):
    from dufu_testing import train

    run = train(tmp_path / "run", ["train.train_iter=12", "train.evaluation.enabled=True",
                                   "train.evaluation.eval_period=12", "train.evaluation.eval_iter=2"],
                recipe="bert_debug")
    losses = run.losses
    assert len(losses) == 12 and all(np.isfinite(list(losses.values())))
    assert losses[12] < losses[1] - 0.3  # from log(384) ~ 5.95 toward the byte unigram entropy
    evals = [r for r in run.records if "eval_loss" in r]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert run.trainer.runtime.model_name == "BertForMaskedLM"
    # The trained checkpoint exports to transformers (what `dufu convert --to-hf` would do for this family).
    import dufu
    from dufu.config import LazyConfig, instantiate
    from dufu.engine.weights.checkpoint import Checkpointer

    transformers = pytest.importorskip("transformers")
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints").latest()
    with torch.device("meta"):
        shapes = instantiate(LazyConfig.load(str(ckpt / "config.yaml")).model)
    state = Checkpointer(ckpt.parent).consolidated_model_state(ckpt)
    dufu.save_pretrained(shapes, tmp_path / "hf", state_dict=state)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 257, (2, 32))
    trained = run.trainer.model.eval()
    with torch.no_grad():
        assert (hf(input_ids=x).logits - trained(input_ids=x).logits).abs().max().item() < 1e-4
