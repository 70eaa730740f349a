"""A layout that cannot work fails at start-up, before any work, with the arithmetic and a fix.

Almost every case calls the launcher's own preflight (``dufu.engine.preflight.preflight``) in-process for a
given world size: the same checks ``dufu train --nproc N`` runs in the parent before it starts workers.
One test runs the real command line.
"""

from __future__ import annotations

import pytest
from torch import nn

from dufu.config.schema import schema_node
from dufu.parallel.parallel_dims import ParallelDims
from dufu.engine.preflight import preflight
from dufu.engine.schema import Dist, ZeroOptimization
from dufu.errors import LayoutError
from dufu.parallel.checks import validate_layout
from dufu_testing import load_config

DP, TP, PP = "train.dist.data_parallel_size", "train.dist.tensor_parallel_size", "train.dist.pipeline_parallel_size"
CP, REPLICATE = "train.dist.context_parallel_size", "train.dist.data_parallel_replicate_size"
MODE, A2A = "train.dist.context_parallel_mode", "train.dist.context_parallel_a2a_size"
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
SCHEDULE, VIRTUAL = "train.dist.pipeline_schedule", "train.dist.virtual_pipeline_size"
ACCUM = "train.num_accumulation_steps"


def check(tmp_path, world_size: int, *overrides: str, recipe: str = "gpt_debug") -> None:
    cfg = load_config(recipe, [*overrides, f"train.output_dir={tmp_path / 'run'}"])
    preflight(cfg, world_size=world_size)


# id: (world size, overrides, fragments the message must contain: the arithmetic, then the fix)
BAD_LAYOUTS = {
    "product-not-world-size": (
        4, [f"{DP}=2", f"{TP}=2", f"{PP}=2"],
        ["dp 2 x tp 2 x pp 2 = 8", "WORLD_SIZE is 4", "--nproc 8"],
    ),
    "cannot-infer": (
        4, [f"{DP}=-1", f"{TP}=3"],
        ["cannot infer train.dist.data_parallel_size", "world size 4 is not divisible", "tp 3 x pp 1 = 3"],
    ),
    "two-inferred": (4, [f"{DP}=-1", f"{TP}=-1"], ["only one size may be -1", "Set all but one"]),
    "zero-size": (4, [f"{TP}=0"], ["train.dist.tensor_parallel_size = 0 is not valid", "positive integer"]),
    "tp-heads": (
        8, [f"{TP}=8", "model.hidden_size=64"],
        ["model.num_attention_heads", "4 / tensor_parallel_size 8 = 0.5 is not whole",
         "choose a tensor_parallel_size that divides 4"],
    ),
    "tp-ffn": (
        2, [f"{TP}=2", "model.ffn_hidden_size=129"],
        ["model.ffn_hidden_size", "129 / tensor_parallel_size 2 = 64.5"],
    ),
    "tp-vocab": (
        2, [f"{TP}=2", "model.vocab_size=385"],
        ["model.vocab_size", "385 / tensor_parallel_size 2 = 192.5", "model.vocab_size=386"],
    ),
    "pp-more-than-layers": (
        4, [f"{PP}=4", f"{ACCUM}=4"],
        ["pipeline_parallel_size 4 x virtual_pipeline_size 1 = 4 stages", "only 2 layers", "at most 2 stages"],
    ),
    "1f1b-too-few-microbatches": (
        2, [f"{PP}=2", f"{SCHEDULE}=1f1b", f"{ACCUM}=1"],
        ["1f1b needs at least as many micro-batches as pipeline ranks", "num_accumulation_steps is 1",
         "pipeline_parallel_size is 2", "Raise train.global_batch_size or train.num_accumulation_steps"],
    ),
    "gpipe-too-few-microbatches": (2, [f"{PP}=2", f"{SCHEDULE}=gpipe"], ["num_accumulation_steps is 1"]),
    "interleaved-without-virtual": (
        2, [f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{ACCUM}=2"],
        ["interleaved_1f1b schedule runs several stages per rank", "virtual_pipeline_size to 2 or more"],
    ),
    "interleaved-microbatches-not-multiple": (
        2, [f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{VIRTUAL}=2", f"{ACCUM}=3", "model.num_layers=4"],
        ["number of micro-batches (3) to be a multiple of pipeline_parallel_size 2"],
    ),
    "virtual-without-interleaved": (
        2, [f"{PP}=2", f"{VIRTUAL}=2", f"{ACCUM}=2", "model.num_layers=4"],
        ["virtual_pipeline_size=2 needs an interleaved schedule", "pipeline_schedule=interleaved_1f1b"],
    ),
    # the V schedules (dufu.parallel.pipeline.check_pipeline_schedule)
    "dualpipev-too-few-microbatches": (
        2, [f"{PP}=2", f"{SCHEDULE}=dualpipev", f"{VIRTUAL}=2", f"{ACCUM}=2", "model.num_layers=4"],
        ["2 x pipeline_parallel_size 2 = 4", "num_accumulation_steps is 2"],
    ),
    "zbv-without-two-stages": (
        2, [f"{PP}=2", f"{SCHEDULE}=zbv", f"{ACCUM}=2", "model.num_layers=4"],
        ["exactly two stages on every pipeline rank", "train.dist.virtual_pipeline_size=2"],
    ),
    "zbv-with-zero3": (
        4, ["train.dist.data_parallel_size=2", f"{PP}=2", f"{SCHEDULE}=zbv", f"{VIRTUAL}=2", f"{ACCUM}=2",
            "model.num_layers=4", *ZERO3],
        ["computes weight gradients apart from input gradients", "train.zero_optimization.stage=2"],
    ),
    "sequence-parallel-without-tp": (
        1, ["train.dist.sequence_parallel=True"],
        ["sequence_parallel=True needs tensor parallelism", "tensor_parallel_size is 1"],
    ),
    "sequence-parallel-seq-length": (
        2, [f"{TP}=2", "train.dist.sequence_parallel=True", "dataloader.train.seq_length=31"],
        ["seq_length 31 / 2 is not whole"],
    ),
    "zero-without-dp": (
        1, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"],
        ["ZeRO stage 2 shards state across data-parallel ranks", "data_parallel_size is 1",
         "zero_optimization.enabled=False"],
    ),
    "unknown-schedule": (
        1, [f"{SCHEDULE}=zigzag"],
        ["pipeline_schedule='zigzag' is not known", "gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble"],
    ),
    "custom-stage-ids-length": (
        2, [f"{PP}=2", f"{ACCUM}=2", "train.dist.custom_pipeline_stage_id=[0,0,1]"],
        ["custom_pipeline_stage_id has 3 entries but the model has 2 layers", "one stage id per layer"],
    ),
    "custom-stage-ids-unused-stage": (
        2, [f"{PP}=2", f"{ACCUM}=2", "train.dist.custom_pipeline_stage_id=[0,0]"],
        ["must be non-decreasing and use every stage 0..1"],
    ),
    "pipeline-num-layers-mismatch": (
        2, [f"{PP}=2", f"{ACCUM}=2", "train.dist.pipeline_num_layers=3"],
        ["pipeline_num_layers=3 but the model has 2 layers"],
    ),
    # hybrid sharding (HSDP): replicas of shards of the data-parallel ranks, under ZeRO
    "hsdp-replicas-not-dividing-dp": (
        4, [f"{REPLICATE}=3", *ZERO3],
        ["data_parallel_replicate_size 3 must divide train.dist.data_parallel_size 4", "4 / 3 = 1.33333",
         "among [1, 2, 4]"],
    ),
    "hsdp-without-zero": (
        4, [f"{REPLICATE}=2"],
        ["makes 2 replicas of dp 4 / 2 = 2 shards, but ZeRO is off", "train.zero_optimization.enabled=True",
         "data_parallel_replicate_size=1"],
    ),
    "hsdp-zero-size": (4, [f"{REPLICATE}=0", *ZERO3], ["data_parallel_replicate_size = 0 is not valid"]),
    # context parallelism's all-to-all modes: the heads of a tensor-parallel rank split over the all-to-all
    "ulysses-heads": (
        8, [f"{CP}=8", f"{MODE}=all_to_all"],
        ["context_parallel_mode=all_to_all splits the attention heads", "context_parallel_size 8",
         "has 4 query heads per rank, and 4 / 8 = 0.5 is not whole", "context_parallel_a2a_size among [2, 4]",
         "context_parallel_mode=all_gather"],
    ),
    "ulysses-heads-under-tp": (
        4, [f"{CP}=2", f"{TP}=2", f"{MODE}=all_to_all", "model.num_attention_heads=2"],
        ["2 / tensor_parallel_size 2 = 1 query heads per rank, and 1 / 2 = 0.5 is not whole"],
    ),
    "hierarchical-heads": (
        8, [f"{CP}=4", f"{TP}=2", f"{MODE}=hierarchical", f"{A2A}=2", "model.num_attention_heads=2"],
        ["context_parallel_mode=hierarchical", "context_parallel_a2a_size 2", "1 / 2 = 0.5 is not whole"],
    ),
    "hierarchical-a2a-not-dividing-cp": (
        4, [f"{CP}=4", f"{MODE}=hierarchical", f"{A2A}=3"],
        ["context_parallel_a2a_size 3 ranks, which must divide context_parallel_size 4", "4 / 3 = 1.33333",
         "among [2]"],
    ),
    "hierarchical-is-all-to-all": (
        2, [f"{CP}=2", f"{MODE}=hierarchical", f"{A2A}=2"],
        ["is one all-to-all over every rank", "context_parallel_mode=all_to_all"],
    ),
    "a2a-size-without-hierarchical": (
        2, [f"{CP}=2", f"{A2A}=2"],
        ["context_parallel_a2a_size = 2 is read by context_parallel_mode=hierarchical only",
         "the mode is 'all_gather'"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_bad_layout_fails_at_preflight(case, tmp_path):
    world_size, overrides, fragments = BAD_LAYOUTS[case]
    with pytest.raises(LayoutError) as info:
        check(tmp_path, world_size, *overrides)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{case}: {fragment!r} not in {message!r}"
    assert not (tmp_path / "run").exists(), "nothing may be written before the layout is checked"


SP = "train.dist.sequence_parallel=True"


# Models that need the whole sequence in every block refuse sequence parallelism, saying why, before the
# sequence-length check (an image model has no sequence length); tensor parallelism alone is their way.
@pytest.mark.parametrize("recipe", ["t5_debug", "vit_debug", "swin_debug"])
def test_models_that_refuse_sequence_parallelism_say_why(recipe, tmp_path):
    from dufu.config.instantiate import locate

    model_cls = load_config(recipe).model._target_
    model_cls = locate(model_cls) if isinstance(model_cls, str) else model_cls
    reason = model_cls.sequence_parallel_unsupported_reason.rstrip(".")
    with pytest.raises(LayoutError) as info:
        check(tmp_path, 2, f"{TP}=2", SP, recipe=recipe)
    message = str(info.value)
    assert f"{model_cls.__name__} does not support sequence parallelism: {reason}. " in message, message
    assert "Set train.dist.sequence_parallel=False (tensor parallelism alone works)." in message
    assert "seq_length" not in message
    check(tmp_path, 2, f"{TP}=2", recipe=recipe)  # and tensor parallelism alone passes


def test_a_model_that_refuses_pipelines_says_why_in_sentences():
    class Recurrent(nn.Module):
        pipeline_unsupported_reason = "its one cell runs every step"

    dims = ParallelDims(pipeline_parallel_size=2, world_size=2)
    with pytest.raises(LayoutError, match=r"stages: its one cell runs every step\. Use data/tensor parallelism"):
        validate_layout(dims, Recurrent(), schema_node(Dist), schema_node(ZeroOptimization), seq_length=32,
                        num_microbatches=2)


# Pre-norm (GPT, LLaMA) and post-norm (BERT, RoBERTa) blocks alike take sequence parallelism.
@pytest.mark.parametrize("recipe", ["llama_debug", "bert_debug"])
def test_sequence_parallelism_passes_preflight(recipe, tmp_path):
    check(tmp_path, 2, f"{TP}=2", SP, recipe=recipe)


@pytest.mark.parametrize(
    "world_size, overrides",
    [
        (4, [f"{DP}=-1", f"{TP}=2"]),  # dp inferred: 4 / 2 = 2
        (4, [f"{DP}=1", f"{TP}=-1", f"{PP}=2", f"{ACCUM}=2"]),  # tp inferred: 4 / 2 = 2 (dp set: -1 by default)
        (2, [f"{PP}=2", f"{ACCUM}=2"]),
        (2, [f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{VIRTUAL}=2", f"{ACCUM}=2", "model.num_layers=4"]),
        (2, [f"{DP}=2", "train.zero_optimization.enabled=True"]),
        (2, [f"{TP}=2", "train.dist.sequence_parallel=True"]),
    ],
)
def test_good_layouts_pass_preflight(world_size, overrides, tmp_path):
    check(tmp_path, world_size, *overrides)


@pytest.mark.parametrize("world_size, overrides, expected", [
    (2, [], "dp 2 x tp 1 x pp 1 = 2 processes"),  # `dufu train gpt_debug --nproc 2` alone: data parallel
    (4, [f"{TP}=2"], "dp 2 x tp 2 x pp 1 = 4 processes"),
    (1, [], "dp 1 x tp 1 x pp 1 = 1 process"),
])
def test_data_parallel_takes_the_processes_left_by_default(world_size, overrides, expected, tmp_path):
    from dufu.engine.preflight import plan_run

    cfg = load_config("gpt_debug", [*overrides, f"train.output_dir={tmp_path / 'run'}"])
    assert cfg.train.dist.data_parallel_size == -1
    assert plan_run(cfg, world_size).dims.describe() == expected


def test_the_launch_advice_counts_processes_in_words():
    with pytest.raises(LayoutError) as info:
        ParallelDims(data_parallel_size=1, world_size=2)
    assert "Launch 1 process (dufu train ... --nproc 1)" in str(info.value)
    with pytest.raises(LayoutError) as info:
        ParallelDims(data_parallel_size=4, world_size=2)
    assert "Launch 4 processes (dufu train ... --nproc 4)" in str(info.value)


def test_two_inferred_sizes_name_the_default():
    with pytest.raises(LayoutError) as info:
        ParallelDims(data_parallel_size=-1, tensor_parallel_size=-1, world_size=4)
    assert "data_parallel_size is -1 by default" in str(info.value)
    assert "train.dist.data_parallel_size=1" in str(info.value)


def test_minus_one_is_inferred():
    dims = ParallelDims(data_parallel_size=-1, tensor_parallel_size=2, pipeline_parallel_size=2, world_size=8)
    assert (dims.data_parallel_size, dims.describe()) == (2, "dp 2 x tp 2 x pp 2 = 8 processes")


def test_tp_not_dividing_hidden_size():
    """The hidden-size check, on a model without attention heads (with heads it follows from them)."""

    class Mixer(nn.Module):
        hidden_size = 66

        def __init__(self):
            super().__init__()
            from dufu.layers import Linear

            self.proj = Linear(66, 66, parallel="col")

    dims = ParallelDims(tensor_parallel_size=4, world_size=4)
    with pytest.raises(LayoutError, match=r"model.hidden_size across ranks, but 66 / tensor_parallel_size 4 = 16.5"):
        validate_layout(dims, Mixer(), schema_node(Dist), schema_node(ZeroOptimization), seq_length=32,
                        num_microbatches=1)


def test_cli_reports_a_bad_layout_in_one_paragraph(run_cli):
    proc = run_cli("train", "gpt_debug", "--nproc", "2", "train.dist.tensor_parallel_size=3",
                   "train.dist.data_parallel_size=1")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert err.startswith("error: ") and "\n\n" not in err and err.count("error:") == 1, err
    flat = " ".join(err.split())
    assert "dp 1 x tp 3 x pp 1 = 3, but WORLD_SIZE is 2" in flat
    assert "--nproc 3" in flat


# Batches with more than the main input (padding masks) and encoder-decoders pass the pipeline checks; an
# encoder-decoder counts its encoder plus decoder blocks as the layers to place (t5_debug: 2 + 2).
def preflight_recipe(tmp_path, recipe: str, world_size: int, *overrides: str) -> None:
    preflight(load_config(recipe, [*overrides, f"train.output_dir={tmp_path / 'run'}"]), world_size=world_size)


@pytest.mark.parametrize("recipe, overrides", [
    ("bert_classify_debug", [f"{PP}=2", f"{ACCUM}=2"]),
    ("t5_debug", [f"{PP}=2", f"{ACCUM}=2"]),
    ("t5_debug", [f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{VIRTUAL}=2", f"{ACCUM}=2"]),
    ("t5_debug", [f"{PP}=2", f"{ACCUM}=2", "train.dist.custom_pipeline_stage_id=[0,1,1,1]"]),
])
def test_pipelines_with_several_inputs_pass_preflight(recipe, overrides, tmp_path):
    preflight_recipe(tmp_path, recipe, 2, *overrides)


def test_an_encoder_decoder_counts_both_stacks_as_pipeline_layers(tmp_path):
    with pytest.raises(LayoutError) as info:
        preflight_recipe(tmp_path, "t5_debug", 2, f"{PP}=2", f"{ACCUM}=2", "train.dist.pipeline_num_layers=2")
    assert "pipeline_num_layers=2 but the model has 4 layers (encoder plus decoder blocks)" in str(info.value)
    with pytest.raises(LayoutError, match="at most 4 stages"):
        preflight_recipe(tmp_path, "t5_debug", 2, f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{VIRTUAL}=4",
                         f"{ACCUM}=2")


def test_a_bad_pretrained_source_fails_at_preflight(tmp_path):
    """model.pretrained is read only by the workers (each its own part), so the start-up checks look at the path
    and the source's sizes first: one clear error before any worker starts."""
    from dufu.errors import DataError
    from dufu.models.gpt import GPTModel
    from dufu.models.hub import save_pretrained

    with pytest.raises(DataError, match="do not exist"):
        preflight(load_config("gpt_debug", [f"model.pretrained={tmp_path / 'missing'}",
                                            f"train.output_dir={tmp_path / 'a'}"]), world_size=1)
    save_pretrained(GPTModel(vocab_size=384, hidden_size=32, num_layers=2, num_attention_heads=4,
                             max_position_embeddings=32), tmp_path / "hf")
    with pytest.raises(DataError, match=r"hidden_size=64 \(pretrained: 32\)"):
        preflight(load_config("gpt_debug", [f"model.pretrained={tmp_path / 'hf'}",
                                            f"train.output_dir={tmp_path / 'b'}"]), world_size=1)


# Expert parallelism (moe_debug: 8 experts): id -> (world size, overrides, recipe, message fragments)
BAD_EXPERT_LAYOUTS = {
    "ep-not-dividing-dp": (
        4, [f"{DP}=4", "train.dist.expert_parallel_size=3"], "moe_debug",
        ["expert_parallel_size 3 must divide train.dist.data_parallel_size 4", "4 / 3 = 1.33333", "[1, 2, 4]"],
    ),
    "experts-not-divisible": (
        6, [f"{DP}=6", "train.dist.expert_parallel_size=6"], "moe_debug",
        ["does not divide the 8 experts of blocks.0.mlp.experts", "8 / 6 = 1.33333 experts per rank", "[1, 2, 4, 8]"],
    ),
    "ep-without-experts": (
        2, [f"{DP}=2", "train.dist.expert_parallel_size=2"], "gpt_debug",
        ["expert_parallel_size = 2, but GPTModel has no mixture-of-experts layer", "expert_parallel_size=1"],
    ),
    "ep-zero": (2, [f"{DP}=2", "train.dist.expert_parallel_size=0"], "moe_debug",
                ["expert_parallel_size = 0 is not valid"]),
}


@pytest.mark.parametrize("case", list(BAD_EXPERT_LAYOUTS))
def test_impossible_expert_layouts_fail_with_the_arithmetic(case, tmp_path):
    world, overrides, recipe, fragments = BAD_EXPERT_LAYOUTS[case]
    with pytest.raises(LayoutError) as err:
        check(tmp_path, world, *overrides, recipe=recipe)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_token_ids_beyond_the_vocabulary_fail_at_preflight(tmp_path):
    """A Megatron pair tokenized for a larger vocabulary: the largest id in the data against the vocabulary the
    model is built for (the tokenizer's, which must equal model.vocab_size or be smaller), before any worker."""
    import numpy as np

    from dufu.data.indexed_dataset import IndexedDatasetWriter
    from dufu.errors import DataError

    prefix = tmp_path / "wide_vocab"
    writer = IndexedDatasetWriter(prefix, vocab_size=50_000, format="megatron")
    rng = np.random.default_rng(0)
    for _ in range(40):
        writer.add_document(rng.integers(0, 250, size=200))
    writer.add_document(np.array([249, 1000, 5]))  # one id far beyond the byte vocabulary
    writer.finalize()
    with pytest.raises(DataError) as err:
        check(tmp_path, 1, f"dataloader.train.data_path={prefix}")
    message = " ".join(str(err.value).split())
    assert "contains token id 1000" in message and "has only 257 tokens" in message
