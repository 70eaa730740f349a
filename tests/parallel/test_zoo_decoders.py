"""The model zoo's decoders train to the same numbers in parallel layouts as on one process.

llama_debug in fp32 with a fixed global batch of 8 for 5 steps (as tests/parallel/test_loss_parity.py does
for gpt_debug) under tensor, pipeline and 3-D parallelism; qwen3_debug (per-head query/key norms, whose weight
is replicated over tensor ranks while each rank holds half the heads) and qwen3_moe_debug (the same attention
with experts) under data, tensor + sequence and pipeline parallelism, the MoE one also under ZeRO-3 and expert
parallelism; and GPT-2 weights imported from a transformers directory through ``model.pretrained`` under tp2
and dp2 x tp2 ZeRO-3, where every rank reads its own block of each tensor: the first loss must be the
transformers model's loss on the first batch.
"""

from __future__ import annotations

import pytest
import torch

from dufu_testing import train
import launch
from parity import PARITY_ARGS, Spec, assert_matches_reference, collect, losses

pytestmark = pytest.mark.multiprocess

DP2, TP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"

# id: (processes, overrides)
LLAMA_LAYOUTS = {
    "tp2": (2, [TP2]),
    "pp2": (2, [PP2]),
    "dp2xtp2xpp2-sp": (8, [DP2, TP2, PP2, "train.dist.sequence_parallel=True"]),
}


# recipe: {layout: (processes, overrides)}; every run of 2 processes, in the job of llama's
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
QWEN3_LAYOUTS = {
    "qwen3_debug": {
        "dp2": (2, [DP2]),
        "tp2": (2, [TP2]),  # the per-head norms' gradients summed over the heads' ranks without SP too
        "tp2-sp": (2, [TP2, "train.dist.sequence_parallel=True"]),
        "pp2": (2, [PP2]),
    },
    "qwen3_moe_debug": {
        "dp2-zero3": (2, [DP2, *ZERO3]),
        "tp2-sp": (2, [TP2, "train.dist.sequence_parallel=True"]),
        "pp2": (2, [PP2]),
        "dp2-ep2": (2, [DP2, "train.dist.expert_parallel_size=2"]),
    },
}
QWEN3_CASES = [(recipe, layout) for recipe, layouts in QWEN3_LAYOUTS.items() for layout in layouts]


def assert_same_run(got, ref_out, what: str) -> None:
    assert_matches_reference(got, collect(ref_out), what)


@pytest.fixture(scope="module")
def llama_reference(reference_run):
    return reference_run("llama_debug").output_dir  # one process, in this one


@pytest.fixture(scope="module")
def layout_runs(shared_runs, request):
    """The layouts' runs of this module, launched together by world size (tests/parity.py's SharedRuns): llama's
    as "llama-<layout>", and (when transformers is installed) GPT-2's from transformers weights as "gpt2-<layout>"."""
    specs = {f"llama-{layout}": Spec(nproc, tuple(overrides), config="llama_debug")
             for layout, (nproc, overrides) in LLAMA_LAYOUTS.items()}
    specs.update({f"{recipe}-{layout}": Spec(nproc, tuple(overrides), config=recipe)
                  for recipe, layouts in QWEN3_LAYOUTS.items() for layout, (nproc, overrides) in layouts.items()})
    gpt2 = "test_gpt2_weights_from_transformers_train_in_parallel_layouts"
    try:
        if any(getattr(item, "originalname", "") == gpt2 and item.module is request.module
               for item in request.session.items):
            path, _ = request.getfixturevalue("gpt2_hf_dir")
            specs.update({f"gpt2-{layout}": Spec(nproc, (f"model.pretrained={path}", *overrides), config="gpt_debug")
                          for layout, (nproc, overrides) in PRETRAINED_LAYOUTS.items()})
    except pytest.skip.Exception:  # the GPT-2 tests skip themselves
        pass
    return shared_runs(specs, uses={
        "test_llama_layout_matches_single_process": lambda p: f"llama-{p['layout']}",
        "test_qwen3_layout_matches_single_process": lambda p: f"{p['recipe']}-{p['layout']}",
        gpt2: lambda p: f"gpt2-{p['layout']}",
        "test_each_rank_reads_only_the_pretrained_tensors_it_holds": ()})


@pytest.mark.parametrize("layout", list(LLAMA_LAYOUTS))
def test_llama_layout_matches_single_process(layout, llama_reference, layout_runs):
    got = layout_runs.result(f"llama-{layout}")
    assert_same_run(got, llama_reference, f"llama_debug {layout}")


@pytest.mark.parametrize("recipe,layout", QWEN3_CASES)
def test_qwen3_layout_matches_single_process(recipe, layout, reference_run, layout_runs):
    got = layout_runs.result(f"{recipe}-{layout}")
    assert_same_run(got, reference_run(recipe).output_dir, f"{recipe} {layout}")


@pytest.fixture(scope="module")
def gpt2_hf_dir(tmp_path_factory):
    """A random transformers GPT-2 with gpt_debug's sizes."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2_hf")
    model.save_pretrained(path)
    return path, model


def first_batch_loss(hf_model) -> float:
    """The transformers model's mean next-token loss on the first global batch of a PARITY_ARGS gpt_debug run."""
    import torch.nn.functional as F

    from dufu.data import ResumableBatchSampler, build_lm_datasets, build_tokenizer, collate
    from dufu_testing import load_config

    cfg = load_config("gpt_debug")
    train_ds, _ = build_lm_datasets("builtin", build_tokenizer("byte"), seq_length=32,
                                    valid_fraction=cfg.dataloader.train.valid_fraction)
    sampler = ResumableBatchSampler(len(train_ds), global_batch_size=8, micro_batch_size=2, seed=cfg.train.seed)
    batch = collate(train_ds, sampler.global_batch(0))  # (8, 33)
    with torch.no_grad():
        logits = hf_model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def gpt2_hf_reference(gpt2_hf_dir, tmp_path_factory):
    """One process trained from the transformers weights; its first loss is transformers' own."""
    path, hf_model = gpt2_hf_dir
    ref = tmp_path_factory.mktemp("gpt2_hf_reference") / "single"
    train(ref, (*PARITY_ARGS, f"model.pretrained={path}"), recipe="gpt_debug")
    assert losses(ref)[0] == pytest.approx(first_batch_loss(hf_model), rel=1e-5)  # the imported weights, not an init
    return ref


# Each rank reads its block of every stored tensor: TP's Shard, and FSDP over TP (_StridedShard).
PRETRAINED_LAYOUTS = {
    "tp2": (2, [TP2]),
    "dp2xtp2-zero3": (4, [DP2, TP2, "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"]),
}


@pytest.mark.parametrize("layout", list(PRETRAINED_LAYOUTS))
def test_gpt2_weights_from_transformers_train_in_parallel_layouts(layout, gpt2_hf_dir, gpt2_hf_reference, layout_runs):
    got = layout_runs.result(f"gpt2-{layout}")
    assert_same_run(got, gpt2_hf_reference, f"GPT-2 from transformers, {layout}")


def test_each_rank_reads_only_the_pretrained_tensors_it_holds(gpt2_hf_dir, tmp_path):
    """pp2 x tp2 from transformers weights: a stage reads no tensor of the other stage's blocks, a sharded
    tensor stored as-is is read as the rank's block only, and the run still starts from those weights (the
    first loss is the transformers model's)."""
    from pathlib import Path

    path, hf_model = gpt2_hf_dir
    reads = tmp_path / "reads"
    reads.mkdir()
    out = tmp_path / "pp2xtp2"
    worker = Path(__file__).with_name("record_reads.py")
    cmd = launch.torchrun_command(worker, 4, "train", "gpt_debug", f"train.output_dir={out}", *PARITY_ARGS,
                                  f"model.pretrained={path}", PP2, TP2)
    launch.assert_ok(launch.run(cmd, output_dir=out, scratch=[reads], env={"DUFU_TEST_READS": str(reads)}))
    assert losses(out)[0] == pytest.approx(first_batch_loss(hf_model), rel=1e-5)
    layers = hf_model.config.n_layer
    first_half = tuple(f"transformer.h.{i}." for i in range(layers // 2))
    second_half = tuple(f"transformer.h.{i}." for i in range(layers // 2, layers))
    per_rank = {int(f.stem[4:]): f.read_text().split() for f in reads.glob("rank*.txt")}
    assert sorted(per_rank) == [0, 1, 2, 3]
    for rank, keys in per_rank.items():
        stage = rank // 2  # mesh (pipeline, data, tensor): ranks 0-1 are stage 0
        assert keys, f"rank {rank} read nothing"
        other = second_half if stage == 0 else first_half
        assert not [k for k in keys if k.startswith(other)], f"rank {rank} (stage {stage}) read another stage's blocks"
        assert any(k.startswith(second_half if stage == 1 else first_half) for k in keys)
        # The vocabulary-parallel embedding (stage 0) and the tied head's copy (stage 1) are read as this
        # tensor-parallel rank's half of the rows only.
        half = hf_model.config.vocab_size // 2
        tp = rank % 2
        wte = [k for k in keys if k.startswith("transformer.wte.weight")]
        assert wte == [f"transformer.wte.weight[{tp * half}:{(tp + 1) * half},0:{hf_model.config.n_embd}]"], wte
