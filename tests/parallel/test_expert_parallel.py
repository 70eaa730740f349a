"""Expert parallelism trains moe_debug to the numbers of one process, and its checkpoints reshard across ep.

moe_debug in fp32 with dropless routing, a fixed global batch of 8 in micro-batches of 2 for 5 steps
(PARITY_ARGS, as every layout test): losses within 1e-5 and the final weights, under

* dp4 with ep2 (experts replicated over the 2 ``expert_data`` ranks), dp2 with ep2, ZeRO-3 and selective
  activation checkpointing, dp2 x tp2 with ep2 and sequence parallelism, dp2 x pp2 with ep2;
* dp2 with ep2 in bf16 (FSDP gathering in fp32, train.amp.param_dtype=fp32) against one process in bf16 (the bf16
  tolerances of tests/parity.py);
* dp2 with ep2 stopped after step 3, then resumed at dp4 with ep4 and in one process (the checkpoint's
  experts are Shard(0) DTensors: DCP reshards them).

Auxiliary-loss-free balancing (DeepSeekMoE routing: sigmoid scores, group-limited, an expert-choice bias moved
after each step by the step's token counts summed over the data ranks, and the sequence-wise balance loss): dp2
with ep2, stopped after step 3 and resumed, equals one uninterrupted process (losses, gradient norms, weights)
and both ranks end with the one process's biases, bit for bit.

Capacity-factor dropping decides per micro-batch before the tokens leave their rank, so the same tokens are
dropped as on one device, and equality holds with dropping too: the layer-level worker proves it, with the
gradients, the global gradient norm and an update, for ep 2 and 4 under replication, ZeRO-2 and ZeRO-3.
"""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch

import launch
from dufu.cli import main as cli_main
from dufu.configs.common.models.moe import model as moe_node
from dufu.engine.hooks import Hook
from dufu.models.moe import MoEModel
from parity import PARITY_ARGS, Spec, assert_matches_reference, final_model_state

pytestmark = pytest.mark.multiprocess

DP2, DP4 = "train.dist.data_parallel_size=2", "train.dist.data_parallel_size=4"
EP2, EP4 = "train.dist.expert_parallel_size=2", "train.dist.expert_parallel_size=4"
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")

# id: (processes, overrides)
LAYOUTS = {
    "dp4-ep2": (4, [DP4, EP2]),
    "dp2-ep2-zero3-ac": (2, [DP2, EP2, *ZERO3, "train.activation_checkpoint.enabled=True"]),
    "dp2xtp2-ep2-sp": (4, [DP2, EP2, "train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
    "dp2xpp2-ep2": (4, [DP2, EP2, "train.dist.pipeline_parallel_size=2"]),
}


BF16 = ("train.amp.enabled=True", "train.amp.dtype=bf16")
# Every run of this module, launched together by world size (tests/parity.py's SharedRuns).
RUNS = {
    **{layout: Spec(nproc, tuple(overrides), config="moe_debug") for layout, (nproc, overrides) in LAYOUTS.items()},
    # fp32 gathers (one process's arithmetic): with the default bf16 gathers the residual stream between blocks is
    # bf16 under data parallelism, and the router's top-k of a few tokens flips against one process's fp32 stream
    "dp2-ep2-bf16": Spec(2, (DP2, EP2, *BF16, "train.amp.param_dtype=fp32"), config="moe_debug"),
    "dp2-ep2-stopped-at-3": Spec(2, (DP2, EP2, "train.stop_at_iter=3", "train.checkpointer.period=3"),
                                 config="moe_debug"),
}

# DeepSeekMoE routing with auxiliary-loss-free balancing (the rate is DeepSeek-V3's x10, so that 5 steps move
# choices) and the sequence-wise loss in place of the load-balancing loss.
BALANCE = ("model.score_func=sigmoid", "model.n_group=4", "model.topk_group=2", "model.routed_scaling_factor=2.5",
           "model.score_bias=True", "model.bias_update_rate=0.01", "model.aux_loss_coeff=0.0",
           "model.seq_aux_loss_coeff=0.001")
BALANCE_SUPPORTED = "bias_update_rate" in inspect.signature(MoEModel).parameters and "bias_update_rate" in moe_node
# each rank's biases at the end, in score_bias_rank<r>.json (this module's hook, importable by the workers, which
# have tests/ on their path)
WRITE_BIASES = "train.hooks=" + json.dumps([{"_target_": "parallel.test_expert_parallel.WriteScoreBiases"}])
if BALANCE_SUPPORTED:  # one run, stopped after step 3 and resumed: a resume is part of what must stay exact
    RUNS.update({
        "dp2-ep2-balance-stopped-at-3": Spec(2, (DP2, EP2, *BALANCE, WRITE_BIASES, "train.stop_at_iter=3",
                                                 "train.checkpointer.period=3"), config="moe_debug"),
        "dp2-ep2-balance-resumed": Spec(2, (DP2, EP2, *BALANCE, WRITE_BIASES, "train.checkpointer.period=3"),
                                        config="moe_debug", resume_of="dp2-ep2-balance-stopped-at-3"),
    })
USES = {"test_expert_parallelism_in_bf16_matches_single_process_in_bf16": "dp2-ep2-bf16",
        "test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_in_one_process": "dp2-ep2-stopped-at-3",
        "test_loss_free_balancing_keeps_one_bias_on_every_rank_equal_to_one_process": "dp2-ep2-balance-resumed"}
needs_balance = pytest.mark.skipif(not BALANCE_SUPPORTED, reason=(
    "MoEModel (and its config node, dufu/configs/common/models/moe.py) does not take the DeepSeekMoE router "
    "options (score_func, score_bias, bias_update_rate, ...)"))


class WriteScoreBiases(Hook):
    """At the end of a run, each rank writes its MoE layers' expert-choice biases to
    ``score_bias_rank<r>.json`` in the output directory."""

    def on_end(self, trainer, summary) -> None:
        biases = {f"{i}.{name}": m.score_bias.tolist() for i, part in enumerate(trainer.model_parts)
                  for name, m in part.named_modules() if getattr(m, "score_bias", None) is not None}
        (trainer.output_dir / f"score_bias_rank{trainer.rank}.json").write_text(json.dumps(biases))


def _biases(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith("score_bias")}


@pytest.fixture(scope="module")
def moe_runs(shared_runs):
    return shared_runs(RUNS, uses=USES)


@pytest.fixture(scope="module")
def moe_reference(reference_run):
    return reference_run("moe_debug")  # one process, in this one


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_process(layout, moe_reference, moe_runs):
    got = moe_runs.result(layout)
    assert_matches_reference(got, moe_reference, f"moe_debug {layout}")
    # the load-balance record sums every rank's tokens: 8 samples x 32 tokens x top-2 per layer and step
    tokens = [json.loads(line) for line in (got.output_dir / "moe_tokens.jsonl").read_text().splitlines()]
    assert [sum(sum(c) for c in r["tokens_per_expert"].values()) for r in tokens] == [2 * 256 * 2] * 5
    ref = [json.loads(line) for line in (moe_reference.output_dir / "moe_tokens.jsonl").read_text().splitlines()]
    assert tokens == ref


def test_expert_parallelism_in_bf16_matches_single_process_in_bf16(reference_run, moe_runs):
    reference = reference_run("moe_debug", *BF16)
    got = moe_runs.result("dp2-ep2-bf16")
    assert_matches_reference(got, reference, "moe_debug dp2 ep2 bf16", precision="bf16")


def test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_in_one_process(moe_reference, moe_runs, tmp_path):
    base = tmp_path / "ep2"
    shutil.copytree(moe_runs.output_dir("dp2-ep2-stopped-at-3"), base)
    one = tmp_path / "one_process"
    shutil.copytree(base, one)
    resumed = launch.run(launch.train_command("moe_debug", base, 4, *PARITY_ARGS, DP4, EP4,
                                              "train.checkpointer.period=3", resume=True), output_dir=base)
    launch.assert_ok(resumed)
    assert "ep 4" in resumed.stdout
    assert_matches_reference(base, moe_reference, "moe_debug saved at dp2 ep2, resumed at dp4 ep4")
    tokens = [json.loads(line) for line in (base / "moe_tokens.jsonl").read_text().splitlines()]
    assert [r["step"] for r in tokens] == [1, 2, 3, 4, 5]  # one record per step, none twice after the resume
    # in this process, as `dufu train` runs one
    assert cli_main(["train", "moe_debug", "--resume", f"train.output_dir={one}", *PARITY_ARGS,
                     "train.checkpointer.period=3"]) == 0
    assert_matches_reference(one, moe_reference, "moe_debug saved at dp2 ep2, resumed in one process")


def test_one_moe_layer_under_expert_parallelism_equals_one_device(tmp_path):
    worker = launch.REPO / "tests" / "parallel" / "expert_parallel_worker.py"
    proc = launch.run(launch.torchrun_command(worker, 4, tmp_path), output_dir=tmp_path, timeout=300)
    launch.assert_ok(proc)
    results = json.loads((tmp_path / "errors.json").read_text())
    assert len(results) == 6
    for case, err in results.items():
        assert err["experts_not_split"] == 0.0 and err["tokens"] == 0.0, (case, err)
        assert err["output"] < 1e-6 and err["grad"] < 1e-6 and err["param"] < 1e-6, (case, err)
        assert err["grad_norm"] < 1e-6, (case, err)


@needs_balance
def test_loss_free_balancing_keeps_one_bias_on_every_rank_equal_to_one_process(reference_run, moe_runs):
    """dp2 x ep2, stopped after step 3 and resumed, against one uninterrupted process: losses, gradient norms,
    weights, and the biases of both ranks bit for bit."""
    reference = reference_run("moe_debug", *BALANCE)
    got = moe_runs.result("dp2-ep2-balance-resumed")
    assert_matches_reference(got, reference, "moe_debug dp2 ep2, loss-free balancing, stopped at 3 and resumed")
    ref_biases = _biases(reference.state)
    assert sorted(ref_biases) == ["blocks.0.mlp.score_bias", "blocks.1.mlp.score_bias"]
    stopped = final_model_state(moe_runs.output_dir("dp2-ep2-balance-stopped-at-3"))
    for name, bias in ref_biases.items():
        # 5 steps of +-0.01 (or 0) per expert, from zeros: it moved, by whole steps of the rate, after the resume too
        assert bias.abs().max() > 0 and torch.allclose(bias / 0.01, (bias / 0.01).round(), atol=1e-4), (name, bias)
        assert not torch.equal(stopped[name], bias), name
        assert torch.equal(got.state[name], bias), (name, got.state[name], bias)  # the checkpoint's
    ranks = [json.loads((got.output_dir / f"score_bias_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 2  # every rank's own copy, after the last step
    for key, values in ranks[0].items():  # "<part>.<module>": one part, no pipeline
        assert torch.equal(torch.tensor(values), ref_biases[key.split(".", 1)[1] + ".score_bias"]), key
    # the records' per-step max load (the busiest expert over the mean, over all ranks) is the one process's
    for step, ref in reference.train.items():
        assert got.train[step]["moe_max_load_step"] == pytest.approx(ref["moe_max_load_step"], rel=1e-12)
