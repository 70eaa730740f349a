"""LiBai's global view on DTensor: the SBP names, placements, to_global/to_local, and the teaching example.

In-process tests use one process (a 1 x 1 x 1 mesh on a private group); the example (4 processes,
dp 2 x tp 2) and the pipeline placement (2 processes, pp 2) run under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dufu.compat import libai as dist
from dufu.compat.libai import layer_pipeline_rank
from dufu.errors import DufuError, LayoutError

import launch
from launch import REPO


@pytest.fixture(scope="module")
def launches():
    """Both multi-process runs start together (they mostly wait on imports and rendezvous), each test
    collects its own: ``launches("example")`` -> stdout."""
    started = {
        "example": launch.start(launch.torchrun_command(REPO / "examples" / "global_view.py", 4), cwd=REPO,
                                timeout=240),
        "pipeline": launch.start(launch.torchrun_command(REPO / "tests" / "compat" / "global_view_worker.py", 2),
                                 cwd=REPO, timeout=240),
    }

    def result(name: str) -> str:
        proc = started[name].result()
        assert proc.returncode == 0, f"{name}:\n{proc.describe()}"
        return proc.stdout

    yield result
    for s in started.values():  # nothing outlives the module, even when a test failed before waiting
        s.result()


def load_example():
    spec = importlib.util.spec_from_file_location("global_view_example", REPO / "examples" / "global_view.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def ctx():
    """A single-process context, closed (and its private process group destroyed) afterwards."""
    assert not torch_dist.is_initialized()
    context = dist.setup()
    yield context
    context.close()
    assert not torch_dist.is_initialized()


# ----------------------------------------------------------------- SBP names


def test_sbp_names_are_dtensor_placements():
    assert dist.split(0) == Shard(0) and dist.split(-1) == Shard(-1)
    assert dist.broadcast == Replicate()
    assert dist.partial_sum == Partial("sum")
    with pytest.raises(TypeError):
        dist.split("0")


def test_get_nd_sbp(ctx):
    assert dist.get_nd_sbp([dist.split(0), dist.broadcast]) == (Shard(0), Replicate())
    assert ctx.get_nd_sbp((dist.broadcast, dist.partial_sum)) == (Replicate(), Partial())
    with pytest.raises(LayoutError, match=r"got 1 SBP\(s\) but a layer's placement has 2 axes \(data, tensor\)"):
        dist.get_nd_sbp([dist.split(0)])
    with pytest.raises(LayoutError, match="one SBP per mesh axis"):
        dist.get_nd_sbp(dist.split(0))
    with pytest.raises(LayoutError, match="is not an SBP"):
        dist.get_nd_sbp(["split", dist.broadcast])


# ----------------------------------------------------------------- one process


def test_setup_single_process(ctx):
    assert (ctx.rank, ctx.world_size, ctx.device.type) == (0, 1, "cpu")
    assert ctx.mesh.mesh_dim_names == ("pipeline", "data", "tensor")
    assert ctx.mesh.mesh.tolist() == [[[0]]]
    assert ctx.dims.describe() == "dp 1 x tp 1 x pp 1 = 1 process"
    placement = dist.get_layer_placement(0)
    assert placement.mesh_dim_names == ("data", "tensor") and placement.mesh.tolist() == [[0]]
    # The stage mesh is the slice of the 3-D mesh, the one parallelize() shards parameters on.
    assert placement == ctx.mesh["data", "tensor"] == ctx.get_layer_placement(-1) == ctx.stage_mesh


def test_setup_infers_minus_one_and_reads_configs():
    with dist.setup(data_parallel_size=-1) as c:
        assert c.dims.data_parallel_size == 1
    with dist.setup({"data_parallel_size": 1, "tensor_parallel_size": -1, "pipeline_parallel_size": 1}) as c:
        assert c.dims.tensor_parallel_size == 1
    from dufu_testing import load_config

    with dist.setup(load_config("gpt_debug")) as c:  # a full config: train.dist, layers from model.num_layers
        assert c.pipeline_num_layers == 2
        assert c.get_layer_placement(-1) == c.get_layer_placement(1)
        with pytest.raises(LayoutError, match="layer_idx 2 is out of range for pipeline_num_layers 2"):
            c.get_layer_placement(2)
    assert not torch_dist.is_initialized()


def test_setup_rejects_a_bad_layout_before_starting_anything():
    with pytest.raises(LayoutError, match=r"dp 2 x tp 2 x pp 1 = 4, but WORLD_SIZE is 1"):
        dist.setup(data_parallel_size=2, tensor_parallel_size=2)
    assert not torch_dist.is_initialized()
    with pytest.raises(DufuError, match="both a config and tensor_parallel_size"):
        dist.setup({"data_parallel_size": 1}, tensor_parallel_size=2)


def test_module_functions_need_setup():
    with pytest.raises(DufuError, match=r"call dufu.compat.libai.setup\(...\) first"):
        dist.get_layer_placement(0)
    with pytest.raises(DufuError, match="no distributed context"):
        dist.to_global(torch.ones(2), sbp=dist.broadcast)
    c = dist.setup()
    c.close()
    with pytest.raises(DufuError, match="closed"):
        c.get_layer_placement(0)
    with pytest.raises(DufuError, match="no distributed context"):
        dist.get_nd_sbp([dist.broadcast, dist.broadcast])


def test_to_global_and_to_local(ctx):
    local = torch.arange(12.0).reshape(3, 4)
    sbp = dist.get_nd_sbp([dist.split(0), dist.split(1)])
    x = dist.to_global(local, dist.get_layer_placement(0), sbp)
    assert isinstance(x, DTensor) and x.placements == (Shard(0), Shard(1))
    assert x.shape == (3, 4)  # one rank: the local component is the whole tensor
    assert torch.equal(dist.to_local(x), local)
    # A DTensor is redistributed; the values do not change.
    y = dist.to_global(x, sbp=dist.get_nd_sbp([dist.broadcast, dist.broadcast]))
    assert y.placements == (Replicate(), Replicate()) and torch.equal(y.full_tensor(), local)
    assert dist.to_global(x) is x  # nothing to change
    # A single broadcast / partial_sum stands for that SBP on every axis; placement defaults to the stage mesh.
    p = dist.to_global(torch.ones(2), sbp=dist.partial_sum)
    assert p.placements == (Partial(), Partial()) and p.device_mesh == ctx.stage_mesh
    # A plain tensor passes through to_local; the 3-D mesh works as a placement too.
    assert dist.to_local(local) is local
    z = ctx.to_global(local, ctx.mesh, (dist.broadcast, dist.split(0), dist.broadcast))
    assert z.device_mesh.ndim == 3 and torch.equal(z.full_tensor(), local)


def test_to_global_errors(ctx):
    with pytest.raises(LayoutError, match="needs sbp="):
        dist.to_global(torch.ones(2))
    with pytest.raises(LayoutError, match="ambiguous"):
        dist.to_global(torch.ones(2), sbp=dist.split(0))
    with pytest.raises(LayoutError, match=r"split\(2\) is out of range for a tensor with 2 dim"):
        dist.to_global(torch.ones(2, 2), sbp=(dist.split(2), dist.broadcast))
    with pytest.raises(TypeError):
        dist.to_global([1.0, 2.0], sbp=dist.broadcast)


def test_global_tensor_in_a_module(ctx):
    """A parameter may be a DTensor; single-device module code then computes with global tensors."""
    sbp = dist.get_nd_sbp([dist.split(0), dist.broadcast])
    w = torch.nn.Parameter(dist.to_global(torch.ones(4, 2), sbp=sbp))
    x = dist.to_global(torch.full((4, 2), 2.0), sbp=sbp)
    y = x * w
    y.sum().full_tensor().backward()
    assert isinstance(w.grad, DTensor) and torch.equal(w.grad.full_tensor(), torch.full((4, 2), 2.0))


# ----------------------------------------------------------------- stage mapping (pure)


@pytest.mark.parametrize(
    "layer, layers, pp, v, custom, expected",
    [
        (0, 4, 2, 1, None, 0),
        (1, 4, 2, 1, None, 0),
        (2, 4, 2, 1, None, 1),
        (-1, 4, 2, 1, None, 1),
        (4, 5, 2, 1, None, 1),  # 5 layers on 2 stages: 3 + 2
        (2, 5, 2, 1, None, 0),
        (2, 4, 2, 1, [0, 0, 0, 1], 0),  # LiBai's custom_pipeline_stage_id
        (3, 4, 2, 1, [0, 0, 0, 1], 1),
        (1, 4, 2, 2, None, 1),  # interleaved: 4 stages, stage s on pipeline rank s % 2
        (2, 4, 2, 2, None, 0),
        (-1, 8, 4, 1, None, 3),
    ],
)
def test_layer_pipeline_rank(layer, layers, pp, v, custom, expected):
    assert layer_pipeline_rank(layer, layers, pp, v, custom) == expected


def test_layer_pipeline_rank_errors():
    with pytest.raises(LayoutError, match="out of range"):
        layer_pipeline_rank(-5, 4, 2)
    with pytest.raises(LayoutError, match="3 pipeline stages cannot share 2 layers"):
        layer_pipeline_rank(0, 2, 3)
    with pytest.raises(LayoutError, match="custom_pipeline_stage_id has 3 entries but the model has 4 layers"):
        layer_pipeline_rank(0, 4, 2, custom_pipeline_stage_id=[0, 0, 1])


# ----------------------------------------------------------------- multi-process


@pytest.mark.multiprocess
def test_layer_placement_under_pipeline_parallelism(launches):
    """2 processes, pp 2: layer 0 lives on the stage-0 mesh [[0]], the last layer on the stage-1 mesh [[1]]."""
    line = next(line for line in launches("pipeline").splitlines() if line.startswith("RESULT "))
    seen = json.loads(line[len("RESULT "):])
    assert [s["rank"] for s in seen] == [0, 1]
    for s in seen:
        assert s["layer0"] == [[0]] and s["layer1"] == [[1]] and s["layer_last"] == [[1]]
        assert s["axes"] == ["data", "tensor"]
        assert s["pipeline_rank"] == s["rank"]
        assert s["own_is_slice"] and s["own_contains_rank"]
        assert s["mine_local"] == [[float(s["rank"])] * 3] * 2
        assert s["other_local_numel"] == 0  # a rank outside a placement holds nothing of that tensor
        assert "redistributed within its own mesh only" in s["cross_stage_error"]
        assert s["custom"] == [[[0]], [[0]], [[0]], [[1]]]
        assert "pipeline_num_layers is not set" in s["no_layers_error"]


@pytest.mark.multiprocess
def test_teaching_example_four_processes(launches):
    """examples/global_view.py: a (16, 8) tensor, SBP (split(0), split(1)) on the 2 x 2 mesh [[0, 1], [2, 3]]."""
    out = launches("example")
    assert "placement: mesh [[0, 1], [2, 3]] with axes ('data', 'tensor'), sbp (Shard(dim=0), Shard(dim=1))" in out
    rows = re.findall(
        r"rank (\d): mesh coordinate \((\d), (\d)\), global shape \(16, 8\), local shape \((\d+), (\d+)\), "
        r"placements \(Shard\(dim=0\), Shard\(dim=1\)\), local sum (-?[\d.]+)",
        out,
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out  # printed in rank order
    # The same computation on one process: x + noise, where rank r drew the noise block at its mesh coordinate.
    example = load_example()
    ROWS, COLS, noise_block = example.ROWS, example.COLS, example.noise_block

    full_x = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    noise = torch.zeros(ROWS, COLS)
    for rank, (_, di, ti, h, w, local_sum) in enumerate(rows):
        di, ti, h, w = int(di), int(ti), int(h), int(w)
        assert (di, ti) == divmod(rank, 2)  # LiBai's rank order: tensor is the inner axis
        assert (h, w) == (8, 4)
        noise[di * h:(di + 1) * h, ti * w:(ti + 1) * w] = noise_block(rank, (h, w))
    expected = full_x + noise
    for rank, row in enumerate(rows):
        di, ti = divmod(rank, 2)
        block = expected[di * 8:(di + 1) * 8, ti * 4:(ti + 1) * 4]
        assert float(row[5]) == pytest.approx(block.sum().item(), abs=1e-3)
    whole = re.search(r"after to_global\(broadcast, broadcast\): local shape \(16, 8\), sum (-?[\d.]+)", out)
    assert whole is not None, out
    assert float(whole.group(1)) == pytest.approx(expected.sum().item(), abs=1e-3)
