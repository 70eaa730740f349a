"""Meta-device build, then materialisation (dufu.parallel.materialize): the values are the same whatever part
of the model a rank holds, tied copies take their twin's value, buffers are computed, and pretrained weights
fill a part from only the tensors it holds."""

from __future__ import annotations

import pytest
import torch

from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel
from dufu.parallel.materialize import materialize_, module_seed, supports_meta_init
from dufu.parallel.pipeline import build_stage_module

SIZES = dict(vocab_size=96, hidden_size=32, num_layers=4, num_attention_heads=4, max_position_embeddings=32)


def meta(cls, **kw):
    with torch.device("meta"):
        return cls(**{**SIZES, **kw})


def materialized(model, seed=0, **kw):
    return materialize_(model, model, torch.device("cpu"), seed=seed, **kw)


def test_every_family_initialises_per_module():
    from dufu.models.bert import BertForMaskedLM
    from dufu.models.hf_auto import HFAutoModel
    from dufu.models.swin import SwinForImageClassification
    from dufu.models.t5 import T5ForConditionalGeneration
    from dufu.models.vit import ViTForImageClassification

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


def test_chunks_start_on_whole_blocks_of_16_and_draw_as_the_whole_tensor():
    """The cut that lets a module's values be drawn chunk by chunk: every chunk but the last starts on a multiple
    of 16 elements, the last holds at least 16, and on this torch the chunks' numbers are the whole tensor's."""
    import math

    from dufu.parallel.materialize import _chunks_draw_as_whole, _row_chunks

    for shape in [(37, 24), (1000,), (5, 3), (33, 7), (17,), (16, 1), (3,), ()]:
        chunks = _row_chunks(shape, 100)
        row, rows = math.prod(shape[1:]), (shape[0] if shape else 1)
        assert chunks[0][0] == 0 and chunks[-1][1] == rows, (shape, chunks)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), (shape, chunks)
        assert all(r0 * row % 16 == 0 for r0, _ in chunks), (shape, chunks)
        assert len(chunks) == 1 or (chunks[-1][1] - chunks[-1][0]) * row >= 16, (shape, chunks)
    assert len(_row_chunks((1000,), 100)) == 11  # 10 chunks of 96, the last 40 elements
    assert _chunks_draw_as_whole()


@pytest.mark.parametrize("cls,tied", [(GPTModel, True), (LlamaModel, False)])
def test_modules_drawn_chunk_by_chunk_get_the_whole_modules_values(cls, tied, monkeypatch):
    """ModuleInitializer.assign (what materialisation uses) equals the module computed whole, bit for bit, in
    chunks of 48 elements (many per tensor even in a tiny model); the plain rules' modules are drawn, not
    computed whole."""
    from dufu.parallel import materialize

    monkeypatch.setattr(materialize, "CHUNK_ELEMENTS", 48)
    model = meta(cls, tie_word_embeddings=tied)
    init = materialize.ModuleInitializer(model, seed=5)
    compared = 0
    for name, module in model.named_modules():
        own = {n: t for n, t in {**module._parameters, **module._buffers}.items()
               if t is not None and not model.is_tied_alias(f"{name}.{n}")}
        if not own:
            continue
        whole = {n: v.clone() for n, v in init.values(name).items() if n in own}
        got = {n: [torch.full(t.shape, float("nan"), dtype=t.dtype)] for n, t in own.items()}
        init.assign(name, got)
        for n in own:
            torch.testing.assert_close(got[n][0], whole[n], rtol=0, atol=0, msg=f"{name}.{n}")
            compared += 1
    assert compared > 10
    drawn = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    drawn -= {n for n in drawn if model.is_tied_alias(f"{n}.weight")}
    assert drawn <= set(init.streamed), sorted(drawn - set(init.streamed))


def test_a_drawn_shard_is_the_block_of_the_whole_value(monkeypatch):
    """Drawn chunk by chunk into DTensor shards (TP and FSDP placements, uneven), each rank of a 2 x 2 mesh gets
    what distribute_tensor keeps of the whole value. One process, torch's fake process group for each rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dufu.parallel import materialize

    monkeypatch.setattr(materialize, "CHUNK_ELEMENTS", 48)
    model = meta(GPTModel, vocab_size=90)  # 90 rows: uneven shards
    init = materialize.ModuleInitializer(model, seed=3)
    whole = init.values("wte")["weight"].detach().clone()
    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
            for placements in ([_StridedShard(0, split_factor=2), Shard(0)], [Shard(0), Shard(1)]):
                target = distribute_tensor(torch.full(whole.shape, float("nan")), mesh, placements,
                                           src_data_rank=None)
                init.assign("wte", {"weight": [target]})
                expected = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
                torch.testing.assert_close(target.to_local(), expected, rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {placements}: {m}")
        finally:
            dist.destroy_process_group()
    assert "wte" in init.streamed
