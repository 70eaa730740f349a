import numpy as np
import pytest
import torch

from dufu.data import ResumableBatchSampler, collate
from dufu.errors import ConfigError

N, G = 103, 16


def reference_order(num_samples, seed, epochs, shuffle=True):
    perms = [
        np.random.default_rng([seed, e]).permutation(num_samples) if shuffle else np.arange(num_samples)
        for e in range(epochs)
    ]
    return np.concatenate(perms).tolist()


@pytest.mark.parametrize("shuffle", [True, False])
def test_global_batches_invariant_to_layout(shuffle):
    steps = 20  # 320 samples: more than three epochs of 103, batches straddle epoch ends
    order = reference_order(N, seed=7, epochs=4, shuffle=shuffle)
    for dp in (1, 2, 4):
        for mbs in (1, 2, 4):
            ranks = [
                ResumableBatchSampler(N, G, mbs, data_parallel_rank=r, data_parallel_size=dp, seed=7, shuffle=shuffle)
                for r in range(dp)
            ]
            for k in range(steps):
                per_rank = [s.next_step() for s in ranks]
                for micro_batches in per_rank:
                    assert len(micro_batches) == G // (mbs * dp)
                    assert all(len(mb) == mbs for mb in micro_batches)
                # rank order, then micro-batch order, gives back the global batch exactly
                union = [i for micro_batches in per_rank for mb in micro_batches for i in mb]
                assert union == order[k * G : (k + 1) * G], (dp, mbs, k)
            assert all(s.consumed_samples == steps * G for s in ranks)


def test_epochs_covered_without_drops_or_duplicates():
    s = ResumableBatchSampler(N, G, 4, seed=3)
    seen = [i for _ in range(N * 3 // G + 1) for mb in s.next_step() for i in mb]
    for e in range(3):
        assert sorted(seen[e * N : (e + 1) * N]) == list(range(N))
    # epochs are different permutations, and the sampler's epoch counter follows consumed_samples
    assert seen[:N] != seen[N : 2 * N]
    assert s.epoch == s.consumed_samples // N


def test_resume_continues_identically():
    full = ResumableBatchSampler(N, G, 2, data_parallel_rank=1, data_parallel_size=2, seed=11)
    expected = [full.next_step() for _ in range(15)]

    first = ResumableBatchSampler(N, G, 2, data_parallel_rank=1, data_parallel_size=2, seed=11)
    for _ in range(8):
        first.next_step()
    state = first.state_dict()
    assert state == {"consumed_samples": 8 * G, "seed": 11, "num_samples": N, "global_batch_size": G, "shuffle": True}

    resumed = ResumableBatchSampler(N, G, 2, data_parallel_rank=1, data_parallel_size=2, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_step() for _ in range(7)] == expected[8:]


def test_resume_in_a_different_layout():
    one = ResumableBatchSampler(N, G, 4, seed=5)
    expected = [one.next_step() for _ in range(10)]
    state = ResumableBatchSampler(N, G, 4, seed=5)
    for _ in range(4):
        state.next_step()
    ranks = [ResumableBatchSampler(N, G, 1, data_parallel_rank=r, data_parallel_size=4, seed=5) for r in range(4)]
    for s in ranks:
        s.load_state_dict(state.state_dict())
    for k in range(4, 10):
        union = [i for s in ranks for mb in s.next_step() for i in mb]
        assert union == [i for mb in expected[k] for i in mb]


def test_resume_validates_order_parameters():
    s = ResumableBatchSampler(N, G, 4, seed=1)
    with pytest.raises(ConfigError, match="seed=2.*seed=1"):
        s.load_state_dict({**s.state_dict(), "seed": 2})
    with pytest.raises(ConfigError, match="num_samples=50"):
        s.load_state_dict({**s.state_dict(), "num_samples": 50})


def test_divisibility_error_shows_arithmetic():
    with pytest.raises(ConfigError, match=r"global_batch_size 12 .* 4 x 2 = 8"):
        ResumableBatchSampler(N, 12, micro_batch_size=4, data_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_rank 2"):
        ResumableBatchSampler(N, 8, 1, data_parallel_rank=2, data_parallel_size=2)


def test_global_batch_larger_than_dataset():
    s = ResumableBatchSampler(5, 12, 3, seed=0)
    order = reference_order(5, 0, 6)
    assert [i for mb in s.next_step() for i in mb] == order[:12]
    assert [i for mb in s.next_step() for i in mb] == order[12:24]


def test_long_runs_do_not_keep_old_epochs():
    s = ResumableBatchSampler(N, G, 16, seed=0)
    s.load_state_dict({"consumed_samples": 10**9, "seed": 0, "num_samples": N})
    for _ in range(20):
        s.next_step()
    assert len(s._perms) <= 2


def test_collate_shape_and_dtype():
    data = [np.arange(i, i + 9) for i in range(10)]
    batch = collate(data, [3, 0, 7])
    assert batch.dtype == torch.int64 and batch.shape == (3, 9)
    assert batch[0].tolist() == list(range(3, 12)) and batch[2, 0] == 7
