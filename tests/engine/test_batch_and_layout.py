"""Batch-size arithmetic (global = micro x dp x accumulation) and ParallelDims validation."""

from __future__ import annotations

import pytest

from dufu.parallel.parallel_dims import ParallelDims
from dufu.engine.validate import resolve_batch_sizes
from dufu.errors import ConfigError, DufuError, LayoutError


@pytest.mark.parametrize(
    "micro, global_, accum, dp, expected",
    [
        (4, None, None, 1, (4, 4, 1)),  # only micro: no accumulation
        (4, None, None, 2, (4, 8, 1)),
        (4, 16, None, 1, (4, 16, 4)),  # accumulation derived
        (2, 16, None, 2, (2, 16, 4)),
        (4, None, 3, 1, (4, 12, 3)),  # global derived
        (4, None, 3, 2, (4, 24, 3)),
        (4, 16, 2, 2, (4, 16, 2)),  # all three, consistent
        (1, 1, 1, 1, (1, 1, 1)),
    ],
)
def test_resolve_batch_sizes(micro, global_, accum, dp, expected):
    result = resolve_batch_sizes(micro, global_, accum, dp)
    assert result == expected
    m, g, a = result
    assert g == m * dp * a


def test_global_not_divisible_shows_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(4, 10, None, 1)
    msg = str(info.value)
    assert "global_batch_size 10" in msg
    assert "train_micro_batch_size 4 x data_parallel_size 1 = 4" in msg
    assert "multiple of 4" in msg and "(e.g. 8)" in msg


def test_global_not_divisible_with_data_parallel():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(3, 16, None, 2)
    assert "train_micro_batch_size 3 x data_parallel_size 2 = 6" in str(info.value)


def test_inconsistent_triple_shows_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(4, 16, 3, 1)
    msg = str(info.value)
    assert "train_micro_batch_size 4 x data_parallel_size 1 x num_accumulation_steps 3 = 12" in msg
    assert "global_batch_size is 16" in msg
    with pytest.raises(ConfigError, match="= 16, but global_batch_size is 8"):
        resolve_batch_sizes(2, 8, 4, 2)


def test_config_errors_are_user_errors():
    assert issubclass(ConfigError, DufuError) and issubclass(LayoutError, DufuError)


# ------------------------------------------------------------------ ParallelDims


def test_parallel_dims_valid_layouts():
    d = ParallelDims(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, world_size=8)
    assert (d.data_parallel_size, d.tensor_parallel_size, d.pipeline_parallel_size) == (2, 2, 2)
    assert d.dp_enabled and d.tp_enabled and d.pp_enabled
    single = ParallelDims()
    assert single.world_size == 1 and not (single.dp_enabled or single.tp_enabled or single.pp_enabled)
    assert "dp 1 x tp 1 x pp 1 = 1" in single.describe()


def test_parallel_dims_product_must_equal_world_size():
    with pytest.raises(LayoutError) as info:
        ParallelDims(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, world_size=4)
    msg = str(info.value)
    assert "dp 2 x tp 2 x pp 2 = 8, but WORLD_SIZE is 4" in msg
    with pytest.raises(LayoutError, match="dp 1 x tp 2 x pp 1 = 2, but WORLD_SIZE is 1"):
        ParallelDims(tensor_parallel_size=2, world_size=1)


@pytest.mark.parametrize(
    "sizes, world, expected",
    [
        (dict(data_parallel_size=-1), 4, (4, 1, 1)),
        (dict(data_parallel_size=-1, tensor_parallel_size=2), 8, (4, 2, 1)),
        (dict(tensor_parallel_size=-1, data_parallel_size=2), 8, (2, 4, 1)),
        (dict(pipeline_parallel_size=-1, tensor_parallel_size=2, data_parallel_size=1), 4, (1, 2, 2)),
    ],
)
def test_parallel_dims_infers_minus_one(sizes, world, expected):
    d = ParallelDims(world_size=world, **sizes)
    assert (d.data_parallel_size, d.tensor_parallel_size, d.pipeline_parallel_size) == expected


def test_parallel_dims_inference_errors():
    with pytest.raises(LayoutError) as info:
        ParallelDims(data_parallel_size=-1, tensor_parallel_size=3, world_size=4)
    msg = str(info.value)
    assert "world size 4" in msg and "tp 3" in msg and "= 3" in msg
    with pytest.raises(LayoutError, match="only one size may be -1"):
        ParallelDims(data_parallel_size=-1, tensor_parallel_size=-1, world_size=4)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_parallel_dims_rejects_invalid_sizes(bad):
    with pytest.raises(LayoutError, match="train.dist.tensor_parallel_size"):
        ParallelDims(tensor_parallel_size=bad, world_size=1)


def test_parallel_dims_from_config():
    d = ParallelDims.from_config({"data_parallel_size": -1, "tensor_parallel_size": 2}, world_size=4)
    assert (d.data_parallel_size, d.tensor_parallel_size, d.pipeline_parallel_size) == (2, 2, 1)
