"""`dufu train CONFIG --dry-run --world-size N`: a rank's part of a big run built on this machine (torch's fake
process group, the meta device) holds what the planner predicts, and a layout dufu refuses is refused here."""

from __future__ import annotations

import json

import pytest

from dufu.cli import main
from dufu.errors import LayoutError
from plan_testing import load

# llama3_8b's built-in corpus is small: a validation split that holds a 2,048-token sample, no evaluation
DATA = ("dataloader.train.valid_fraction=0.1", "train.evaluation.enabled=False")
# a 70B-class Llama (Llama 3 70B's shapes) from the 8B recipe
LLAMA_70B = ("model.num_layers=80", "model.hidden_size=8192", "model.num_attention_heads=64",
             "model.num_key_value_heads=8", "model.ffn_hidden_size=28672")
LLAMA3_8B_PARAMS = 8_030_261_248


def llama(tmp_path, *overrides):
    return load("llama3_8b", f"train.output_dir={tmp_path / 'run'}", *DATA, *overrides)


def rehearse(*args, **kwargs):
    from dufu.plan.rehearsal import rehearse as run  # imports torch

    return run(*args, **kwargs)


def assert_states_agree(reports):
    for r in reports:
        for key in ("parameters", "gradients", "optimizer"):
            assert r.sources[key] == "rehearsal"
            assert r.memory[key] > 0
            assert r.memory[key] == pytest.approx(r.planned[key], rel=0.05), (r.rank, key)


def test_llama3_8b_on_64_ranks_holds_what_the_planner_predicts(tmp_path):
    from dufu.plan import estimate

    cfg = llama(tmp_path, "train.dist.tensor_parallel_size=8", "train.dist.pipeline_parallel_size=2")
    reports = rehearse(cfg, 64)
    assert [r.rank for r in reports] == [0, 32]  # first and last pipeline rank (tp 8 x dp 4 per stage)
    assert [r.coordinate["pipeline"] for r in reports] == [0, 1]
    assert_states_agree(reports)
    # the shards are the real model's: both stages' parameters times tp (no ZeRO) are Llama 3.1 8B's, in fp32
    # (RMSNorm weights, replicated over tp, counted 8 times: 0.03%)
    held = sum(r.memory["parameters"] for r in reports) * 8 / 4
    assert held == pytest.approx(LLAMA3_8B_PARAMS, rel=1e-3)
    # the planner's prediction shown is dufu plan's own for the worst rank
    est = estimate(llama(tmp_path, "train.dist.tensor_parallel_size=8", "train.dist.pipeline_parallel_size=2"),
                   64, "h100-80gb")
    worst = est.memory_by_rank.index(max(est.memory_by_rank))
    assert reports[worst].planned["optimizer"] == est.model_states["optimizer"]
    assert reports[worst].planned["activations"] == est.memory["activations"]
    # collectives with their groups: tensor [0..7], data [0, 8, 16, 24], pipeline [0, 32]
    first = {(c["op"], c["group"]): c for c in reports[0].collectives}
    assert first[("all_reduce", "tensor")]["ranks"] == list(range(8))
    assert first[("all_reduce", "data")]["ranks"] == [0, 8, 16, 24]
    assert first[("send activations + recv gradients", "pipeline")]["ranks"] == [0, 32]
    # one micro-batch of 2,048 tokens x hidden 4,096 in bf16 crosses the stage boundary
    assert first[("send activations + recv gradients", "pipeline")]["bytes"] == 2048 * 4096 * 2
    grads = sum(c["bytes"] for c in reports[0].collectives if c["group"] == "data")
    assert grads == reports[0].memory["gradients"]  # replicate all-reduces every gradient once


def test_a_70b_model_on_1024_ranks_with_zero(tmp_path):
    cfg = llama(tmp_path, *LLAMA_70B, "train.dist.tensor_parallel_size=8", "train.dist.pipeline_parallel_size=8",
                "train.global_batch_size=1024", "train.zero_optimization.enabled=True",
                "train.zero_optimization.stage=1")
    reports = rehearse(cfg, 1024)
    assert [r.rank for r in reports] == [0, 896]
    assert [r.coordinate["pipeline"] for r in reports] == [0, 7]
    assert_states_agree(reports)
    # ZeRO shards over dp 16: a rank holds 1/(8 x 16) of its stage's ~8.7B parameters, about 0.3 GB in fp32
    assert 0.25e9 < reports[0].memory["parameters"] < 0.35e9
    ops = {(c["op"], c["group"]) for c in reports[0].collectives}
    assert {("all_gather", "data"), ("reduce_scatter", "data"), ("all_reduce", "tensor")} <= ops
    assert next(c for c in reports[1].collectives if c["group"] == "data")["ranks"] == list(range(896, 1024, 8))


def test_indivisible_shapes_are_refused(tmp_path):
    cfg = llama(tmp_path, "train.dist.tensor_parallel_size=16")  # 8 key-value heads over 16 ranks
    with pytest.raises(LayoutError, match="tensor_parallel_size 16 = 0.5 is not whole"):
        rehearse(cfg, 64)


def test_a_pipeline_stage_without_layers_is_refused(tmp_path):
    cfg = llama(tmp_path, "train.dist.pipeline_parallel_size=64")  # 32 layers over 64 stages
    with pytest.raises(LayoutError, match="only 32 layers and each stage needs at least one"):
        rehearse(cfg, 64)


def test_json_output(capsys, tmp_path):
    code = main(["train", "gpt_debug", "--dry-run", "--world-size", "8", "--json",
                 "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2",
                 "train.num_accumulation_steps=2", f"train.output_dir={tmp_path / 'run'}"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in data["ranks"]] == [0, 4]
    from dufu.plan.memory import KEYS  # dufu plan --json's memory categories

    for r in data["ranks"]:
        assert list(r["memory"]) == list(KEYS) and list(r["planned"]) == list(KEYS)
        assert all(isinstance(v, int) for v in r["memory"].values())
        assert r["collectives"] and all({"op", "group", "ranks", "bytes", "count"} <= set(c)
                                        for c in r["collectives"])
    code = main(["train", "gpt_debug", "--dry-run", "--world-size", "8", "--rank", "5", "--json",
                 "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2",
                 "train.num_accumulation_steps=2", f"train.output_dir={tmp_path / 'run'}"])
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [5]


def test_options_belong_to_a_dry_run(capsys, tmp_path):
    out = f"train.output_dir={tmp_path / 'run'}"
    for argv, words in ((["--world-size", "8"], "add --dry-run"), (["--dry-run"], "needs --world-size"),
                        (["--dry-run", "--world-size", "8", "--rank", "8"],
                         "--rank 8: a rank of 8 processes is 0 to 7")):
        assert main(["train", "gpt_debug", *argv, out]) == 2
        assert words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_experts_under_expert_parallelism_and_zero3(tmp_path):
    cfg = load("moe_debug", "train.dist.expert_parallel_size=2", "train.zero_optimization.enabled=True",
               "train.zero_optimization.stage=3", f"train.output_dir={tmp_path / 'run'}")
    (report,) = rehearse(cfg, 8)
    assert_states_agree([report])
    groups = {(c["op"], c["group"]): c["ranks"] for c in report.collectives}
    assert groups[("all_to_all", "expert")] == [0, 1]  # ep inner in the data axis
    assert groups[("all_gather", "expert_data")] == [0, 2, 4, 6]
    assert groups[("all_gather", "data")] == list(range(8))


def test_context_parallel_gathers_keys_and_values(tmp_path):
    cfg = load("llama_debug", "train.dist.context_parallel_size=2", "train.dist.tensor_parallel_size=2",
               f"train.output_dir={tmp_path / 'run'}")
    (report,) = rehearse(cfg, 8)
    assert_states_agree([report])
    gathers = [c for c in report.collectives if c["op"] == "all_gather" and c["group"] == "context"]
    assert gathers and all(c["ranks"] == [0, 2] for c in gathers)  # cp between data and tensor (tp inner)
    assert len(gathers) == cfg.model.num_layers


def _by_op(collectives, per: int = 1) -> dict:
    """{(op, group): (count, bytes)} summed, ``per``: divide the counts (a step's micro-batches)."""
    out: dict = {}
    for c in collectives:
        count, nbytes = out.get((c["op"], c["group"]), (0, 0))
        out[(c["op"], c["group"])] = (count + c["count"], nbytes + c["count"] * c["bytes"])
    return {k: (n / per, b / per) for k, (n, b) in out.items()}


GPT_STEP = ("train.global_batch_size=8", "train.train_micro_batch_size=2")


@pytest.mark.parametrize("layout, nproc, accum", [
    (("train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=2"), 2, 4),
    (("train.dist.data_parallel_size=2",), 2, 2),
    (("train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"),
     2, 2),
    (("train.dist.data_parallel_size=2", "train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"),
     2, 2),
    (("train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.zero_optimization.enabled=True",
      "train.zero_optimization.stage=3"), 4, 2),
], ids=["tp2", "dp2", "dp2-zero2", "dp2-zero3", "dp2xtp2-zero3"])
def test_the_executed_micro_batch_issues_the_derived_collectives(layout, nproc, accum, tmp_path):
    """One micro-batch run through the rank's parallelized modules (fake tensors, fake process group) issues, op by op
    and group by group, the collectives the derived list gives for it: tensor parallelism's per micro-batch, FSDP2's
    gathers per micro-batch (resharded units again for backward, lookup tables not), and the gradients' reduction
    once (the step's last micro-batch)."""
    cfg = load("gpt_debug", f"train.output_dir={tmp_path / 'run'}", *GPT_STEP, *layout)
    [report] = rehearse(cfg, nproc, [0])
    assert report.executed_note.startswith("executed: one micro-batch") and report.executed
    executed = _by_op(report.executed)
    derived = {k: v for k, v in _by_op([c for c in report.collectives if c["op"] != "all_gather"
                                        and c["group"] != "data"], per=accum).items()}
    # per micro-batch: tensor parallelism's collectives and FSDP2's gathers; the reduction once per step
    derived.update(_by_op([c for c in report.collectives if c["op"] == "all_gather" and c["group"] == "data"],
                          per=accum))
    derived.update(_by_op([c for c in report.collectives if c["op"] != "all_gather" and c["group"] == "data"]))
    assert executed == derived


def test_a_pipeline_layout_is_not_executed_and_says_so(tmp_path):
    cfg = load("gpt_debug", f"train.output_dir={tmp_path / 'run'}", *GPT_STEP, "train.dist.data_parallel_size=1",
               "train.dist.pipeline_parallel_size=2")
    [report] = rehearse(cfg, 2, [0])
    assert report.executed is None and "pipeline" in report.executed_note and report.collectives
    assert report.as_dict()["executed_collectives"] is None


def test_hybrid_sharding_and_muon_hold_and_issue_what_the_planner_says(tmp_path):
    """HSDP (2 replicas of 2 shards) with Muon: the rank's states are those the planner predicts (Muon's one momentum
    buffer for the hidden matrices), and the executed micro-batch issues the derived collectives: FSDP2's gathers and
    reduce-scatters over the shard group, the gradient shards' all-reduce across the replicas."""
    cfg = load("gpt_debug_muon", f"train.output_dir={tmp_path / 'run'}", *GPT_STEP, "train.dist.data_parallel_size=4",
               "train.dist.data_parallel_replicate_size=2", "train.zero_optimization.enabled=True",
               "train.zero_optimization.stage=3")
    [report] = rehearse(cfg, 4, [0])
    # within 5% of the planner's states: AdamW's 8 B for gpt_debug's hidden matrices (98,304 of 126,720 trained
    # elements) would be 1.6 times Muon's optimizer state
    assert_states_agree([report])
    groups = {c["group"] for c in report.collectives}
    assert {"dp_shard", "dp_replicate"} <= groups and "data" not in groups
    executed = _by_op(report.executed)
    accum = 1  # global 8 = micro 2 x dp 4
    derived = _by_op(report.collectives, per=accum)
    assert executed == derived
    assert executed[("all_reduce", "dp_replicate")][0] > 0
