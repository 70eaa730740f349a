"""Weighted blends: Megatron's rule (checked against a literal loop and megatron-core's own builder), the mix of
every prefix, cyclic draws, per-dataset splits, the three ways to write a blend, and bad input."""

import json
import random
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from dufu.data import BlendedDataset, ValidationSets, build_lm_datasets, builtin_documents
from dufu.data.blend import MAX_PERIOD, dataset_names, integer_weights, parse_blend
from dufu.engine.reporting.report import data_lines
from dufu.errors import DataError


def megatron_rule(a: list[int], n: int) -> tuple[list[int], list[int]]:
    """Megatron's rule as its loop states it, in exact integers: step i takes the dataset with the largest
    a_d * max(i, 1) - A * drawn_d (ties to the lowest index); also each draw's index in its dataset."""
    A, drawn, picks, index = sum(a), [0] * len(a), [], []
    for i in range(n):
        errors = [a[d] * max(i, 1) - A * drawn[d] if a[d] else None for d in range(len(a))]
        best = max((e, -d) for d, e in enumerate(errors) if e is not None)[1] * -1
        picks.append(best)
        index.append(drawn[best])
        drawn[best] += 1
    return picks, index


class Counting:
    """A dataset whose sample j is (tag, j)."""

    def __init__(self, n: int, tag: str = ""):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        assert 0 <= j < self.n
        return (self.tag, j)


@pytest.fixture
def second_corpus(tmp_path):
    """A second text input: 30 built-in documents written backwards, as .jsonl."""
    path = tmp_path / "reversed.jsonl"
    path.write_text("".join(json.dumps({"text": d[::-1]}) + "\n" for d in builtin_documents()[:30]), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4], [0.05, 0.95],
                                     [0.2, 0.45, 0.35]])
def test_first_1000_samples_follow_the_weights(weights):
    blend = BlendedDataset([Counting(10**6) for _ in weights], weights)
    datasets, _ = blend.index_map(0, 1000)
    mix = np.bincount(datasets, minlength=len(weights)) / 1000
    assert np.all(np.abs(mix - np.asarray(weights)) <= 0.01), mix
    assert np.allclose(mix, weights, rtol=0, atol=1e-12), mix  # in fact exact: 1,000 samples are whole periods


def test_order_is_megatrons_rule_and_every_prefix_keeps_to_it():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randint(0, 12) for _ in range(rng.randint(1, 6))]
        if not any(a):
            continue
        g = int(np.gcd.reduce(a))
        sizes = [rng.randint(1, 40) for _ in a]
        blend = BlendedDataset([Counting(n) for n in sizes], a)
        n = 3 * sum(a) // g + 17
        picks, index = megatron_rule([x // g for x in a], n)
        got_d, got_j = blend.index_map(0, n)
        assert got_d.tolist() == picks, a
        assert got_j.tolist() == [j % sizes[d] for d, j in zip(picks, index)], a  # each dataset cyclically
        # every prefix: no dataset a whole sample ahead of its share, none drawn with weight 0
        w = np.asarray(a, float) / sum(a)
        counts = np.cumsum(np.eye(len(a), dtype=int)[got_d], axis=0)  # (n, K): draws in the first i + 1
        assert np.all(counts - w[None, :] * np.arange(1, n + 1)[:, None] < 1), a
        assert not np.any(counts[:, w == 0])
        for i in rng.sample(range(min(n, len(blend))), min(5, n, len(blend))):  # one at a time: the same
            assert blend.locate(i) == (picks[i], index[i] % sizes[picks[i]])


def test_two_datasets_stay_within_one_sample_of_their_share():
    for a0, a1 in ((7, 3), (3, 7), (1, 1), (1, 9), (13, 29), (999, 1)):
        blend = BlendedDataset([Counting(5), Counting(5)], [a0, a1])
        d, _ = blend.index_map(0, 5000)
        ahead = np.cumsum(d == 0) - a0 / (a0 + a1) * np.arange(1, 5001)  # of dataset 0; dataset 1 is -ahead
        assert np.all(np.abs(ahead) < 1), (a0, a1)


def test_same_order_as_megatron_core():
    """megatron-core's C++ builder, fed the same weights: identical for weights exact in binary floating point,
    and for decimal weights no dataset's count in any prefix differs by more than one (Megatron's doubles break
    exact ties by rounding, dufu by the lowest index)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    cases = [[0.5, 0.25, 0.25], [0.25, 0.75], [0.375, 0.125, 0.5], [0.125, 0.0625, 0.3125, 0.25, 0.25],
             [0.7, 0.3], [0.5, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4], [0.3, 0.7]]
    for weights in cases:
        w = np.asarray(weights) / np.sum(weights)
        n = 5000
        mega_d, mega_j = np.zeros(n, np.int16), np.zeros(n, np.int64)
        helpers.build_blending_indices(mega_d, mega_j, w, len(w), n, False)
        d, j = BlendedDataset([Counting(10**9) for _ in w], w, num_samples=n).index_map()
        if all(float(x * 1024).is_integer() for x in weights):
            assert np.array_equal(d, mega_d) and np.array_equal(j, mega_j), weights
        else:
            ours = np.cumsum(np.eye(len(w), dtype=int)[d], axis=0)
            theirs = np.cumsum(np.eye(len(w), dtype=int)[mega_d], axis=0)
            assert np.abs(ours - theirs).max() <= 1, weights


def test_deterministic_and_cyclic():
    small, large = Counting(3, "small"), Counting(100, "large")
    a = BlendedDataset([small, large], [0.5, 0.5])
    b = BlendedDataset([small, large], [0.5, 0.5])
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    drawn_small = [j for tag, j in (a[i] for i in range(40)) if tag == "small"]
    assert drawn_small == [k % 3 for k in range(20)]  # more than one epoch of it: round again, in order
    # one pass holds every sample of every dataset at least once: max(n_d / w_d)
    assert len(a) == 200
    seen = {a[i] for i in range(len(a))}
    assert seen == {("small", j) for j in range(3)} | {("large", j) for j in range(100)}
    assert a.draws().tolist() == [100, 100]
    assert a.draws(7).tolist() == np.bincount(a.index_map(0, 7)[0], minlength=2).tolist()


def test_zero_weight_is_never_drawn():
    blend = BlendedDataset([Counting(5, "a"), Counting(5, "b"), Counting(5, "c")], [0.5, 0, 0.5])
    assert {blend[i][0] for i in range(len(blend))} == {"a", "c"}
    assert blend.draws().tolist() == [5, 0, 5]


def test_integer_weights():
    assert integer_weights([0.7, 0.3]).tolist() == [7, 3]
    assert integer_weights([1 / 3, 1 / 3, 1 / 3]).tolist() == [1, 1, 1]
    assert integer_weights([5, 3, 2]).tolist() == [5, 3, 2]
    assert integer_weights([40, 0, 60]).tolist() == [2, 0, 3]
    # no fraction with a denominator <= 2**20 within 1e-9: rounded, every positive weight kept
    a = integer_weights([1e-9, 0.3, 0.7 - 1e-9])
    assert a.sum() <= MAX_PERIOD and a[0] >= 1 and abs(a[1] / a.sum() - 0.3) < 1e-6


def test_index_map_of_ten_million_samples_is_fast():
    blend = BlendedDataset([Counting(10**6), Counting(3 * 10**5), Counting(10**5)], [0.5, 0.3, 0.2],
                           num_samples=10**7)
    start = time.perf_counter()
    d, j = blend.index_map()
    seconds = time.perf_counter() - start
    assert np.bincount(d).tolist() == [5 * 10**6, 3 * 10**6, 2 * 10**6]
    assert j[-1] == blend.locate(10**7 - 1)[1]
    assert seconds < 10, f"index map of 10**7 samples took {seconds:.1f} s"  # ~0.2 s; generous for loaded CI


# ------------------------------------------------------------------------------------------------ data_path
def test_list_dict_and_string_forms_are_one_blend(byte_tok, second_corpus, monkeypatch):
    monkeypatch.chdir(second_corpus.parent)
    forms = ([0.7, "builtin", 0.3, second_corpus.name], {"builtin": 0.7, second_corpus.name: 0.3},
             f"0.7 builtin 0.3 {second_corpus.name}", (7, "builtin", 3, second_corpus.name))
    built = [build_lm_datasets(form, byte_tok, seq_length=64) for form in forms]
    first_train, first_valid = built[0]
    assert isinstance(first_train, BlendedDataset) and isinstance(first_valid, ValidationSets)
    assert first_train.names == first_valid.names == ["builtin", "reversed"]
    for train, valid in built[1:]:
        assert len(train) == len(first_train) and len(valid) == len(first_valid)
        for i in (0, 1, 17, len(train) - 1):
            assert np.array_equal(train[i], first_train[i])
    mix = np.bincount(first_train.index_map(0, 1000)[0]) / 1000
    assert np.allclose(mix, [0.7, 0.3], atol=0.01)


def test_each_dataset_has_its_own_split(byte_tok, second_corpus):
    train, valid = build_lm_datasets([0.5, "builtin", 0.5, second_corpus], byte_tok, seq_length=64,
                                     valid_fraction=0.1)
    alone = [build_lm_datasets(p, byte_tok, seq_length=64, valid_fraction=0.1) for p in ("builtin", second_corpus)]
    for (name, part), blended, (solo_train, solo_valid) in zip(valid.parts, train.datasets, alone):
        # the same samples as the dataset split alone: its last 10% of documents validate
        assert (blended.start_token, blended.end_token) == (solo_train.start_token, solo_train.end_token)
        assert (part.start_token, part.end_token) == (solo_valid.start_token, solo_valid.end_token)
    assert len(valid) == sum(len(p) for _, p in valid.parts)
    assert np.array_equal(valid[len(valid.parts[0][1])], valid.parts[1][1][0])  # concatenated in order
    train0, valid0 = build_lm_datasets([0.5, "builtin", 0.5, second_corpus], byte_tok, seq_length=64,
                                       valid_fraction=0)
    assert valid0 is None and len(train0.datasets) == 2


def test_a_plain_list_is_still_one_input(byte_tok, second_corpus):
    train, valid = build_lm_datasets(["builtin", second_corpus], byte_tok, seq_length=64)
    assert not isinstance(train, BlendedDataset) and not isinstance(valid, ValidationSets)
    assert parse_blend(["a", "b"]) is None and parse_blend("builtin") is None
    one, _ = build_lm_datasets([1.0, "builtin"], byte_tok, seq_length=64)  # a blend of one is that dataset
    assert not isinstance(one, BlendedDataset)


@pytest.mark.parametrize("data_path, message", [
    ([0.7, "builtin", 0.3], r"has 3 elements, so its weights and paths do not pair up.*\[0\.7, \"data/web\""),
    (["builtin", 0.7, "x", 0.3], r"element 0 \('builtin'\) should be a weight"),
    ([0.7, "builtin", 0.3, 0.5], r"element 3 \(0\.5\) should be the path"),
    ([-0.2, "builtin", 1.2, "x"], r"the weight of 'builtin' is -0\.2, which is negative"),
    ([0, "builtin", 0.0, "x"], r"the weights sum to 0"),
    ([float("nan"), "builtin", 1, "x"], r"weight of 'builtin' is nan"),
    ({"builtin": "0.7"}, r"the weight of 'builtin' is '0\.7', not a number"),
    ({"builtin": True}, r"the weight of 'builtin' is True, not a number"),
    ("0.7 builtin 0.3", r"has 3 words, so weights and paths do not pair up"),
    ("0.7 builtin x code", r"word 3 \('x'\) should be the weight of 'code'"),
])
def test_bad_weights_say_what_was_given_and_the_form(byte_tok, data_path, message):
    with pytest.raises(DataError, match=message):
        build_lm_datasets(data_path, byte_tok, seq_length=64)


def test_missing_path_is_named_before_anything_is_tokenized(byte_tok, tmp_path, cache_dir):
    with pytest.raises(DataError, match=r"Blend entry 2 of 2 \('.*nope.jsonl', weight 0.3\).*does not exist"):
        build_lm_datasets([0.7, "builtin", 0.3, str(tmp_path / "nope.jsonl")], byte_tok, seq_length=64)
    assert not (cache_dir / "datasets").exists()


def test_names_are_stems_made_unique():
    assert dataset_names(["data/web.jsonl", "other/web", "builtin", "corpora/code/", "x/web_2.txt",
                          ["a/first.txt", "b.txt"], "p/q.bin"]) == \
        ["web", "web_2", "builtin", "code", "web_2_2", "first", "q"]


# ------------------------------------------------------------------------------------------------ the summary
def test_start_up_summary_lists_tokens_weight_and_epochs(byte_tok, second_corpus):
    train, valid = build_lm_datasets([0.7, "builtin", 0.3, second_corpus], byte_tok, seq_length=64)
    trainer = SimpleNamespace(train_ds=train, tokenizer=byte_tok, global_batch_size=8,
                              cfg=SimpleNamespace(train=SimpleNamespace(train_iter=500)))
    lines = data_lines(trainer, len(valid))
    assert lines[0].startswith(f"  data         blend of 2 datasets, {len(train):,} training samples per pass")
    for line, ds, name, weight in zip(lines[1:], train.datasets, ["builtin", "reversed"], [0.7, 0.3]):
        epochs = 500 * 8 * weight / len(ds)
        assert line.split()[0] == name
        assert f"{ds.num_tokens:,} tokens, {len(ds):,} samples, weight {weight:.3g}: {epochs:.3g} epochs" in line
    plain, _ = build_lm_datasets("builtin", byte_tok, seq_length=64)
    assert len(data_lines(SimpleNamespace(train_ds=plain, tokenizer=byte_tok), 3)) == 1


# ------------------------------------------------------------------------------------------------ evaluation
def test_evaluation_reports_each_dataset_and_the_mean_over_all_targets():
    """dufu.engine.evaluation on a blend's ValidationSets, with a stand-in model whose loss is the mean input id:
    the first eval_iter global batches of each dataset, a split smaller than one batch going round its samples."""
    import contextlib

    import torch

    from dufu.engine.evaluation import evaluate

    class Model:
        def __call__(self, input_ids):
            return SimpleNamespace(loss=input_ids.float().mean())

    valid = ValidationSets([("a", [np.full(3, i) for i in range(10)]),  # 10 samples: 2 batches of 4
                            ("b", [np.full(3, 10 + i) for i in range(3)])])  # 3 samples: one batch 10 11 12 10
    runtime = SimpleNamespace(
        global_batch_size=4, micro_batch_size=2, dp_rank=0, device=torch.device("cpu"), schedule=None,
        model_parts=[], valid_ds=valid, model=Model(), dims=SimpleNamespace(data_parallel_size=1),
        cfg=SimpleNamespace(train=SimpleNamespace(evaluation=SimpleNamespace(eval_iter=2))),
        batch=lambda ds, idx: {"input_ids": torch.as_tensor(np.stack([ds[i] for i in idx]))},
        autocast=contextlib.nullcontext,
        loss=SimpleNamespace(begin=lambda batches: None, weighted=lambda loss, mb: loss * 0.5,
                             reduce=lambda t: float(t)))
    ev = evaluate(runtime)
    assert ev["eval_loss/a"] == pytest.approx((1.5 + 5.5) / 2)
    assert ev["eval_loss/b"] == pytest.approx(10.75)
    assert ev["eval_loss"] == pytest.approx((1.5 + 5.5 + 10.75) / 3)
    assert ev["eval_ppl/b"] == pytest.approx(np.exp(10.75)) and ev["eval_samples"] == 12


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2)])
def test_the_trained_order_is_the_blend_shuffled_within_each_dataset(weights):
    """What trains (the sampler over a blend ordered by the run's seed, as plan_run sets it up) follows the
    weights over the first 1,000 samples, takes each dataset's samples in a permutation per pass, and is the
    same for every data-parallel layout and for the same seed."""
    from dufu.data import ResumableBatchSampler

    sizes = (300, 170, 90)[:len(weights)]
    datasets = [[(d, j) for j in range(n)] for d, n in enumerate(sizes)]

    def trained(seed, dp=1):
        blend = BlendedDataset(datasets, list(weights))
        blend.order_by_seed(seed, num_samples=4000)
        assert blend.orders_samples and len(blend) == 4000
        order = []
        for rank in range(dp):
            sampler = ResumableBatchSampler(len(blend), 8, 2, data_parallel_rank=rank, data_parallel_size=dp,
                                            seed=seed, shuffle=not blend.orders_samples)
            order.append([blend[i] for _ in range(125) for mb in sampler.next_step() for i in mb])
        # global batch k = rank 0's share of it, then rank 1's ...
        per = 8 // dp
        return [s for k in range(125) for r in range(dp) for s in order[r][k * per:(k + 1) * per]]

    first = trained(5)
    mix = np.bincount([d for d, _ in first], minlength=len(weights)) / 1000
    assert np.allclose(mix, weights, atol=0.01), mix
    for d, n in enumerate(sizes):
        drawn = [j for k, j in first if k == d][:n]
        if len(drawn) == n:  # a whole first pass: every sample once, not in file order
            assert sorted(drawn) == list(range(n)) and drawn != list(range(n))
    assert trained(5, dp=2) == first == trained(5)
    assert trained(6) != first
