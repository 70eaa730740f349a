"""Meta-device build, then materialisation (dufu.parallel.materialize): the values are the same whatever part
of the model a rank holds (one definition, tile by tile: dufu.layers.init; a rank draws only its share), tied
copies take their twin's value, buffers are computed, and pretrained weights fill a part from only the tensors
it holds."""

from __future__ import annotations

import math

import pytest
import torch

from dufu.models.bert import BertForMaskedLM
from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel
from dufu.models.moe import MoEModel
from dufu.models.swin import SwinForImageClassification
from dufu.models.t5 import T5ForConditionalGeneration
from dufu.models.vit import ViTForImageClassification
from dufu.parallel.materialize import materialize_, module_seed, supports_meta_init
from dufu.parallel.pipeline import build_stage_module

SIZES = dict(vocab_size=96, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=32)


def meta(cls, **kw):
    with torch.device("meta"):
        return cls(**{**SIZES, **kw})


def materialized(model, seed=0, **kw):
    return materialize_(model, model, torch.device("cpu"), seed=seed, **kw)


def test_every_family_initialises_per_module():
    from dufu.models.hf_auto import HFAutoModel

    for cls in (GPTModel, LlamaModel, BertForMaskedLM, T5ForConditionalGeneration, ViTForImageClassification,
                SwinForImageClassification):
        assert supports_meta_init(cls.__new__(cls)), cls.__name__
    assert not supports_meta_init(HFAutoModel.__new__(HFAutoModel))  # built in full, as transformers builds it


def test_values_depend_on_seed_and_name_only():
    a = materialized(meta(GPTModel), seed=3)
    b = materialized(meta(GPTModel), seed=3)
    c = materialized(meta(GPTModel), seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if p.std() > 0:
            assert not torch.equal(p, r), name
    assert module_seed(0, "blocks.0.attn.q_proj") != module_seed(0, "blocks.1.attn.q_proj")
    # the rules themselves: GPT-2's scaled residual projections, unit norms, zero biases, a tied head
    std = a.blocks["0"].attn.out_proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * SIZES["num_layers"]) ** 0.5, rel=0.15)
    assert torch.equal(a.ln_f.weight, torch.ones(32)) and torch.equal(a.blocks["1"].mlp.fc1.bias, torch.zeros(128))
    assert a.lm_head.weight is a.wte.weight


@pytest.mark.parametrize("cls,tied", [(GPTModel, True), (LlamaModel, False), (LlamaModel, True)])
def test_a_pipeline_stage_gets_the_full_models_values(cls, tied):
    full = materialized(meta(cls, tie_word_embeddings=tied), seed=7)
    reference = meta(cls, tie_word_embeddings=tied)
    for stage in range(2):
        part = build_stage_module(reference, stage, 2, [0, 0, 1, 1])
        materialize_(part, reference, torch.device("cpu"), seed=7)
        expected = dict(full.named_parameters(remove_duplicate=False))
        names = [n for n, _ in part.named_parameters()]
        assert names and all(n.startswith(("blocks.2", "blocks.3", "norm", "ln_f", "lm_head")) == (stage == 1)
                             for n in names)
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)
    if not tied:
        return
    # the last stage's copy of the tied head holds the embedding's values
    last = build_stage_module(reference, 1, 2, [0, 0, 1, 1])
    materialize_(last, reference, torch.device("cpu"), seed=7)
    assert torch.equal(last.lm_head.weight, full.wte.weight)


def test_buffers_are_computed():
    model = materialized(meta(LlamaModel))
    built = LlamaModel(**SIZES)
    for (name, b), ref in zip(model.named_buffers(), built.buffers()):
        torch.testing.assert_close(b, ref, msg=name)


def test_pretrained_source_fills_only_what_the_part_holds(tmp_path, monkeypatch):
    from dufu.engine.weights.pretrained import pretrained_source
    from dufu.models import hub

    src = GPTModel(**SIZES)
    hub.save_pretrained(src, tmp_path / "hf")
    read = []
    original = hub.HFWeights.__getitem__
    monkeypatch.setattr(hub.HFWeights, "__getitem__", lambda self, k: read.append(k) or original(self, k))
    reference = meta(GPTModel)
    part = build_stage_module(reference, 1, 2, [0, 0, 1, 1])
    materialize_(part, reference, torch.device("cpu"), seed=0,
                 pretrained=lambda p: pretrained_source(p, tmp_path / "hf"))
    expected = dict(src.named_parameters(remove_duplicate=False))
    for name, p in part.named_parameters():
        torch.testing.assert_close(p, expected[name], msg=name)
    assert read and not any(k.startswith(("transformer.h.0.", "transformer.h.1.", "transformer.wpe")) for k in read)


def test_meta_init_off_gives_the_same_run(tmp_path):
    """train.meta_init=False (the full model on every rank first) starts from the same weights."""
    from dufu_testing import train
    from parity import losses

    args = ("train.train_iter=3", "train.evaluation.enabled=False", "train.tensorboard=False")
    meta = train(tmp_path / "meta", args, recipe="gpt_debug")
    full = train(tmp_path / "full", (*args, "train.meta_init=False"), recipe="gpt_debug")
    assert losses(tmp_path / "meta") == losses(tmp_path / "full")
    # the start-up summary says where the weights come from and how they were built
    described = "\n".join(meta.log + full.log)
    assert "weights      random init (seed 1234); built on the meta device, rank 0 holds" in described
    assert "built in full on every rank" in described


def test_the_block_a_rank_reads_is_its_shard():
    """For every rank of a 2 x 2 (data, tensor) mesh and the placements TP, FSDP and FSDP over TP give
    (uneven sizes included), the block read from storage equals what distribute_tensor keeps on that rank.
    One process, with torch's fake process group standing in for each rank in turn."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dufu.parallel.materialize import _local_block

    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    cases = [[_StridedShard(0, split_factor=2), Shard(0)], [_StridedShard(1, split_factor=2), Shard(1)],
             [Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Shard(0), Replicate()]]
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
            for placements in cases:
                shard = distribute_tensor(full, mesh, placements, src_data_rank=None)
                block = _local_block(shard)
                assert block is not None
                torch.testing.assert_close(full[block], shard.to_local(), rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {placements}: {m}")
        finally:
            dist.destroy_process_group()
    assert _local_block(full) is None  # a plain tensor is read whole


def test_a_shard_is_filled_from_its_block_alone(monkeypatch):
    """assign_full_ gives each rank what distribute_tensor would keep (in the parameter's dtype), and only the
    rank's block of the full tensor is converted and copied (never the whole tensor)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dufu.parallel.materialize import assign_full_

    full = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    copied = []  # the number of elements of every tensor copied into another or converted (.to)
    real_copy, real_to = torch.Tensor.copy_, torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "copy_",
                        lambda self, src, *a: copied.append(src.numel()) or real_copy(self, src, *a))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copied.append(self.numel()) or real_to(self, *a, **k))
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
            for placements in ([_StridedShard(0, split_factor=2), Shard(0)], [Shard(0), Shard(1)]):
                target = distribute_tensor(torch.zeros(10, 6, dtype=torch.bfloat16), mesh, placements,
                                           src_data_rank=None)
                copied.clear()
                assign_full_(target, full)
                moved = list(copied)
                expected = distribute_tensor(full.to(torch.bfloat16), mesh, placements, src_data_rank=None)
                assert torch.equal(target.to_local(), expected.to_local()), (rank, placements)
                assert moved == [expected.to_local().numel()], (rank, placements, moved)
        finally:
            dist.destroy_process_group()


def on_every_rank(shape, check):
    """check(rank, mesh) for every rank of a fake (data, tensor) mesh of ``shape``, in one process: torch's fake
    process group stands in for each rank in turn."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(shape)
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            check(rank, init_device_mesh("cpu", shape, mesh_dim_names=("data", "tensor")))
        finally:
            dist.destroy_process_group()


def counting_draws(monkeypatch) -> list:
    """The number of random values drawn by every tile draw from now on (dufu.layers.init._draw_tile)."""
    from dufu.layers import init

    drawn, draw = [], init._draw_tile

    def counted(rule, shape, *args):
        drawn.append(math.prod(shape))
        return draw(rule, shape, *args)

    monkeypatch.setattr(init, "_draw_tile", counted)
    return drawn


@pytest.mark.parametrize("rule,args", [("normal_", (0.0, 0.02)), ("trunc_normal_", (0.0, 0.02, -0.04, 0.04)),
                                       ("uniform_", (-0.1, 0.1))])
def test_a_block_computed_alone_is_the_block_of_the_whole_tensor(rule, args, monkeypatch):
    """dufu.layers.init: a block of a matrix, a vector and a 3-D tensor (rows, columns, uneven, empty) computed
    alone equals the same block of the whole tensor bit for bit, and draws only the tiles it overlaps."""
    from torch import nn

    from dufu.layers import init

    monkeypatch.setattr(init, "TILE", 8)
    monkeypatch.setattr(init, "TILE_1D", 16)
    drawn = counting_draws(monkeypatch)

    def module(device):
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(37, 20, device=device))  # 5 x 3 tiles, the last ones cut
        m.bias = nn.Parameter(torch.empty(45, device=device))
        m.experts = nn.Parameter(torch.empty(4, 10, 12, device=device))
        return m

    whole = module("cpu")
    with init.init_scope(11, whole):
        for leaf in ("weight", "bias", "experts"):
            getattr(init, rule)(getattr(whole, leaf), *args)
    assert whole.weight.std() > 0 and not torch.equal(whole.experts[0], whole.experts[1])
    blocks = {"weight": [(slice(0, 19), slice(0, 20)), (slice(19, 37), slice(0, 20)),  # rows, uneven halves
                         (slice(0, 37), slice(0, 10)), (slice(0, 37), slice(10, 20)),  # columns
                         (slice(5, 23), slice(3, 17)), (slice(8, 8), slice(0, 20))],  # off the grid; empty
              "bias": [(slice(0, 23),), (slice(23, 45),), (slice(16, 32),)],
              "experts": [(slice(1, 3), slice(0, 10), slice(0, 12)), (slice(0, 4), slice(5, 10), slice(6, 12))]}
    meta = module("meta")
    for leaf, cases in blocks.items():
        for block in cases:
            local = torch.full([s.stop - s.start for s in block], float("nan"))
            drawn.clear()
            with init.init_scope(11, meta, {leaf: [(local, block)]}) as scope:
                getattr(init, rule)(getattr(meta, leaf), *args)
            assert scope.done == {leaf} and not scope.unknown
            torch.testing.assert_close(local, getattr(whole, leaf).detach()[block], rtol=0, atol=0,
                                       msg=lambda m: f"{leaf} {block}: {m}")
            assert sum(drawn) == init.drawn_elements(getattr(meta, leaf).shape, block), (leaf, block)
    # what the tiles cost: a half split on the tile grid draws half the numbers, off the grid one tile row more
    assert init.drawn_elements((37, 20), (slice(0, 16), slice(0, 20))) == 16 * 20
    assert init.drawn_elements((37, 20), (slice(0, 19), slice(0, 20))) == 24 * 20
    assert init.drawn_elements((37, 20), (slice(0, 37), slice(0, 10))) == 37 * 16
    assert init.drawn_elements((37, 20), (slice(8, 8), slice(0, 20))) == 0


def test_a_rank_draws_only_its_share(monkeypatch):
    """The point of the tiles: materialising a rank's shard of a 1024 x 512 embedding on a fake 2 x 2 mesh draws
    exactly 1/shards of its numbers (rows split, columns split, both), an uneven FSDP-over-TP split at most the
    tile rows its block overlaps; and every rank's block equals the same block of the whole value, bit for bit."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from dufu.parallel import materialize

    cases = [(1024, [Replicate(), Shard(0)], 2), (1024, [Replicate(), Shard(1)], 2), (1024, [Shard(0), Shard(1)], 4),
             (2000, [_StridedShard(0, split_factor=2), Shard(0)], 4)]
    drawn = counting_draws(monkeypatch)
    for vocab, placements, shards in cases:
        model = meta(GPTModel, vocab_size=vocab, hidden_size=512)
        init = materialize.ModuleInitializer(model, seed=3)
        whole = init.values("wte")["weight"].detach().clone()
        counts = []

        def check(rank, mesh):
            target = distribute_tensor(torch.full(whole.shape, float("nan")), mesh, placements, src_data_rank=None)
            drawn.clear()
            init.assign("wte", {"weight": [target]})
            counts.append(sum(drawn))
            expected = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
            torch.testing.assert_close(target.to_local(), expected, rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank} {placements}: {m}")
            if vocab % 256 == 0:
                assert counts[-1] == whole.numel() // shards, (rank, placements, counts)
            else:  # a block off the tile grid: at most a part of a tile row more at each edge
                rows = target.to_local().shape[0]
                assert counts[-1] <= min((rows + 2 * 255) * 512, whole.numel() // 2), (rank, placements, counts)

        on_every_rank((2, 2), check)
        assert init.by_block == ["wte"] * 4, init.by_block


FAMILIES = {
    "gpt": lambda: GPTModel(**SIZES),
    "llama": lambda: LlamaModel(**SIZES, ffn_hidden_size=88),  # (the default 11008 is 1.4M tiles of 8 x 8)
    "bert": lambda: BertForMaskedLM(
        vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64,
        max_position_embeddings=32),
    "t5": lambda: T5ForConditionalGeneration(
        vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4),
    "vit": lambda: ViTForImageClassification(
        image_size=16, patch_size=4, num_channels=3, num_labels=7, hidden_size=32, num_layers=2,
        num_attention_heads=4, ffn_hidden_size=64),
    "swin": lambda: SwinForImageClassification(
        image_size=16, patch_size=2, num_channels=3, num_labels=5, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, drop_path_rate=0.0),
    "moe": lambda: MoEModel(
        vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_experts=4, top_k=2, ffn_hidden_size=48),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_path_gives_the_same_values(family, monkeypatch):
    """One definition of the initial values (tiles of 8 x 8, many per tensor even in a tiny model): a model built
    on the CPU and initialised in place (init_weights(seed)), the same model built on the meta device and
    materialised, and each module filled block by block all hold the same values, bit for bit; every module with
    parameters of its own (grouped experts, convolutions and BERT's zero padding row included) is filled block by
    block, not computed whole."""
    from dufu.layers import init

    monkeypatch.setattr(init, "TILE", 8)
    monkeypatch.setattr(init, "TILE_1D", 16)
    build = FAMILIES[family]
    direct = build()
    direct.init_weights(seed=5)
    reference = meta_build(build)
    materialized_model = materialized(meta_build(build), seed=5)
    expected = dict(direct.named_parameters(remove_duplicate=False))
    for name, p in materialized_model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)
    assert any(p.std() > 0 for p in direct.parameters() if p.numel() > 1)

    from dufu.parallel import materialize

    blockwise = materialize.ModuleInitializer(reference, seed=5)
    with_params = []
    for name, module in reference.named_modules():
        own = {n: t for n, t in module._parameters.items()
               if t is not None and not reference.is_tied_alias(f"{name}.{n}" if name else n)}
        if not own:
            continue
        with_params.append(name)
        got = {n: [torch.full(t.shape, float("nan"), dtype=t.dtype)] for n, t in own.items()}
        blockwise.assign(name, got)
        for n in own:
            torch.testing.assert_close(got[n][0], expected[f"{name}.{n}" if name else n], rtol=0, atol=0,
                                       msg=f"{name}.{n}")
    assert with_params and blockwise.by_block == with_params, sorted(set(with_params) - set(blockwise.by_block))


def meta_build(build):
    with torch.device("meta"):
        return build()
