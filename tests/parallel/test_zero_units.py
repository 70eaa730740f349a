"""ZeRO's FSDP units (dufu.parallel.data_parallel): embeddings, blocks and the output end are separate units, a
tied head holds a sharded copy of the embedding whose gradient shard is added to the embedding's, and the
numbers equal one device's."""

from __future__ import annotations

import json

import pytest
import torch

import launch
from dufu.models.gpt import GPTModel
from dufu.parallel.data_parallel import describe_zero_stage, end_units

SIZES = dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=32)


def test_end_units_follow_the_pipeline_layout():
    with torch.device("meta"):
        gpt = GPTModel(**SIZES)
    embeddings, last = end_units(gpt)
    assert embeddings == [gpt.wte, gpt.wpe] and last == [gpt.ln_f, gpt.lm_head]


def test_stage_one_is_described_as_run():
    assert describe_zero_stage(1) == "ZeRO stage 1 (run with stage-2 sharding: same communication, less memory)"
    assert describe_zero_stage(3) == "ZeRO stage 3"


@pytest.fixture(scope="module")
def stage_runs(request, tmp_path_factory):
    """``stage_runs(stage)`` -> the directory of each rank's ``rank_R.json`` for one ZeRO stage; the stages of
    the selected tests run in one 2-process job of zero_units_worker.py (tests/launch.py's run_in_turn)."""
    worker = launch.REPO / "tests" / "parallel" / "zero_units_worker.py"
    wanted = [str(item.callspec.params["stage"]) for item in request.session.items
              if getattr(item, "module", None) is request.module and hasattr(item, "callspec")]
    root, outcomes = tmp_path_factory.mktemp("zero_units"), {}

    def get(stage: int):
        if str(stage) not in outcomes:
            pending = [s for s in wanted if s not in outcomes] if str(stage) in wanted else [str(stage)]
            outcomes.update(launch.run_in_turn(
                pending, lambda job, stages: launch.torchrun_command(worker, 2, f"train.output_dir={job}", *stages),
                root, timeout=300))
        job, failure = outcomes[str(stage)]
        assert failure is None, failure
        return job / str(stage)

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_units_and_tied_copy_on_two_ranks(stage, stage_runs):
    out = stage_runs(stage)
    for rank in (0, 1):
        seen = json.loads((out / f"rank_{rank}.json").read_text())
        err = seen["errors"]
        assert err["loss"] < 1e-6 and err["grad"] < 1e-6 and err["param"] < 1e-6, err
        assert err["state_dict_copy"] < 1e-6 and err["logits"] < 1e-5 and err["second_step_logits"] < 1e-5, err
        if stage < 3:
            # Stages 1 and 2: the root holds embeddings, head and final norm (one tied parameter), gathered from
            # forward to backward like the blocks.
            assert seen["tie"] == {"untied": False, "copies": 0, "tied": 0, "copy_grad_dropped": False}
            assert seen["after_forward"] == {"wte_gathered": True, "block0_gathered": True, "head_gathered": True}
            continue
        assert seen["tie"] == {"untied": True, "copies": 1, "tied": 2, "copy_grad_dropped": True}
        # After forward: the embedding tables are freed at once, the head stays gathered for its backward and
        # the blocks are freed.
        assert seen["after_forward"] == {"wte_gathered": False, "block0_gathered": False, "head_gathered": True}
        # When backward reaches the first block, the head's gradient is already reduce-scattered (not held
        # in full until the embedding's backward) and the head is freed; the embedding is not gathered.
        assert seen["head_grad_reduced"] and not seen["head_gathered"] and not seen["wte_gathered"]
        assert not seen["wte_grad"]
