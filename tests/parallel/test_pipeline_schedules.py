"""The V-shaped pipeline schedules (``train.dist.pipeline_schedule`` = "dualpipev" or "zbv") train to the numbers of
one process, and their checkpoints load into other layouts.

* gpt_debug with 4 layers at pp2 (two stages per rank in a V: rank 0 holds stages 0 and 3, with the embedding and
  the tied head), fixed global batch of 4 micro-batches: DualPipeV and ZB-V each log the single-process losses,
  gradient norms and evaluations, and end with its weights (tests/parity.py's bounds).
* a DualPipeV run stopped at step 3 resumes under 1F1B at pp2 (the other placement) and on one process, and both
  log steps 4-5 as the uninterrupted single-process run does: model and optimizer state, the tied head included,
  are keyed by parameter name in every placement.
* an impossible combination is refused with its arithmetic before anything runs
  (:func:`dufu.parallel.pipeline.check_pipeline_schedule`), and so is ZeRO-3, whose gradients were measured
  wrong under the split backward of these schedules; the placement is torch's.

All 2-process runs share one launch (tests/parity.py's SharedRuns).
"""

from __future__ import annotations

import shutil

import pytest

from dufu_testing import train
from parity import EVAL_ARGS, PARITY_ARGS, Spec, assert_matches_reference, collect
from dufu.errors import LayoutError
from dufu.parallel.pipeline import V_SCHEDULES, check_pipeline_schedule, rank_stages

PP2 = "train.dist.pipeline_parallel_size=2"
LAYERS = "model.num_layers=4"  # 4 stages of one layer at pp2
V2 = "train.dist.virtual_pipeline_size=2"
STOP = ("train.stop_at_iter=3", "train.checkpointer.period=3")


def schedule(name: str) -> str:
    return f"train.dist.pipeline_schedule={name}"


RUNS = {
    "pp2-dualpipev": Spec(2, (LAYERS, *EVAL_ARGS, PP2, schedule("dualpipev"), V2)),
    "pp2-zbv": Spec(2, (LAYERS, *EVAL_ARGS, PP2, schedule("zbv"), V2)),
    "dualpipev-stopped": Spec(2, (LAYERS, *EVAL_ARGS, PP2, schedule("dualpipev"), V2, *STOP)),
    "1f1b-resumed": Spec(2, (LAYERS, *EVAL_ARGS, PP2, schedule("1f1b"), "train.checkpointer.period=3"),
                         resume_of="dualpipev-stopped"),
}


@pytest.fixture(scope="module")
def schedule_runs(shared_runs):
    return shared_runs(RUNS, uses={
        "test_dualpipev_checkpoint_resumes_under_1f1b": "1f1b-resumed",
        "test_dualpipev_checkpoint_resumes_on_one_process": "dualpipev-stopped",
    })


@pytest.fixture(scope="module")
def reference(parity_reference):
    return parity_reference(4, *EVAL_ARGS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["pp2-dualpipev", "pp2-zbv"])
def test_v_schedule_matches_single_process(layout, reference, schedule_runs):
    got = schedule_runs.result(layout)
    assert sorted(got.evals) == [0, 5], f"{layout}: evaluations at steps {sorted(got.evals)}"
    assert_matches_reference(got, reference, layout)


@pytest.mark.multiprocess
def test_dualpipev_checkpoint_resumes_under_1f1b(reference, schedule_runs):
    got = schedule_runs.result("1f1b-resumed")
    assert sorted(got.train) == [1, 2, 3, 4, 5]
    assert_matches_reference(got, reference, "dualpipev at pp2 stopped at step 3, resumed under 1f1b at pp2")


@pytest.mark.multiprocess
def test_dualpipev_checkpoint_resumes_on_one_process(reference, schedule_runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(schedule_runs.output_dir("dualpipev-stopped"), run_dir)
    train(run_dir, (*PARITY_ARGS, LAYERS, *EVAL_ARGS, "train.checkpointer.period=3"), resume=True, fast=False)
    got = collect(run_dir)
    assert sorted(got.train) == [1, 2, 3, 4, 5]
    assert_matches_reference(got, reference, "dualpipev at pp2 stopped at step 3, resumed on one process")


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_placement_is_torchs(name, pp):
    """Rank r holds stages r and 2 pp - 1 - r, the map torch's V schedules check the stages against."""
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping  # torch-private: the reference

    torchs = generate_rank_to_stage_mapping(pp, 2 * pp, style="v")
    assert {r: rank_stages(name, pp, r, 2) for r in range(pp)} == torchs
    assert rank_stages(name, 2, 0, 2) == [0, 3] and rank_stages(name, 2, 1, 2) == [1, 2]
    assert rank_stages("interleaved_1f1b", 2, 0, 2) == [0, 2]  # looped, for contrast


# (schedule, pp, virtual_pipeline_size, layers, micro-batches) -> fragments of the message: the arithmetic, the fix
REFUSED = {
    "dualpipev-too-few-microbatches": (("dualpipev", 2, 2, 4, 3),
                                       ["2 x pipeline_parallel_size 2 = 4", "num_accumulation_steps is 3",
                                        "train.num_accumulation_steps to 4 or more", "or use zbv"]),
    "dualpipev-pp4-too-few-microbatches": (("dualpipev", 4, 2, 8, 6),
                                           ["2 x pipeline_parallel_size 4 = 8", "num_accumulation_steps is 6"]),
    "zbv-without-virtual": (("zbv", 2, 1, 4, 4),
                            ["places exactly two stages on every pipeline rank", "virtual_pipeline_size is 1",
                             "train.dist.virtual_pipeline_size=2"]),
    "dualpipev-three-per-rank": (("dualpipev", 2, 3, 6, 4), ["virtual_pipeline_size is 3"]),
    "zbv-too-few-layers": (("zbv", 2, 2, 3, 4),
                           ["pipeline_parallel_size 2 x virtual_pipeline_size 2 = 4 stages", "only 3 layers",
                            "With zbv, use pipeline_parallel_size at most 1"]),
    "zbv-fewer-microbatches-than-ranks": (("zbv", 4, 2, 8, 3),
                                          ["num_accumulation_steps is 3", "pipeline_parallel_size is 4"]),
    # measured at dp 2 x pp 2: ZeRO-3 gives these schedules wrong gradients (see check_pipeline_schedule)
    "dualpipev-zero3": (("dualpipev", 2, 2, 4, 4, 3),
                        ["ZeRO stage 3", "train.zero_optimization.stage=2", "interleaved_1f1b with ZeRO-3"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_impossible_v_layout_is_refused_with_the_arithmetic(case):
    args, fragments = REFUSED[case]
    with pytest.raises(LayoutError) as info:
        check_pipeline_schedule(*args)
    for fragment in fragments:
        assert fragment in str(info.value), f"{case}: {fragment!r} not in {str(info.value)!r}"


def test_possible_v_layouts_pass():
    """torch's ZB-V takes any number of micro-batches (no multiple of pp, unlike the looped interleaved schedules);
    DualPipeV takes 2 pp or more."""
    check_pipeline_schedule("zbv", 2, 2, 4, 3)
    check_pipeline_schedule("dualpipev", 2, 2, 4, 5)
    check_pipeline_schedule("dualpipev", 4, 2, 9, 8)  # 9 layers in 8 stages: uneven, as for every schedule
    check_pipeline_schedule("zbv", 2, 2, 4, 4, zero_stage=2)
    check_pipeline_schedule("interleaved_1f1b", 2, 2, 4, 4, zero_stage=3)
    with pytest.raises(LayoutError, match=r"number of micro-batches \(3\) to be a multiple"):
        check_pipeline_schedule("interleaved_1f1b", 2, 2, 4, 3)
