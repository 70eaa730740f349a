"""Expert parallelism trains moe_debug to the numbers of one process, and its checkpoints reshard across ep.

moe_debug in fp32 with dropless routing, a fixed global batch of 8 in micro-batches of 2 for 5 steps
(PARITY_ARGS, as every layout test): losses within 1e-5 and the final weights, under

* dp4 with ep2 (experts replicated over the 2 ``expert_data`` ranks), dp2 with ep2, ZeRO-3 and selective
  activation checkpointing, dp2 x tp2 with ep2 and sequence parallelism, dp2 x pp2 with ep2;
* dp2 with ep2 in bf16 (FSDP gathering in fp32, train.amp.param_dtype=fp32) against one process in bf16 (the bf16
  tolerances of tests/parity.py);
* dp2 with ep2 stopped after step 3, then resumed at dp4 with ep4 and in one process (the checkpoint's
  experts are Shard(0) DTensors: DCP reshards them).

Capacity-factor dropping decides per micro-batch before the tokens leave their rank, so the same tokens are
dropped as on one device, and equality holds with dropping too: the layer-level worker proves it, with the
gradients, the global gradient norm and an update, for ep 2 and 4 under replication, ZeRO-2 and ZeRO-3.
"""

from __future__ import annotations

import json
import shutil

import pytest

import launch
from dufu.cli import main as cli_main
from parity import PARITY_ARGS, Spec, assert_matches_reference

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
USES = {"test_expert_parallelism_in_bf16_matches_single_process_in_bf16": "dp2-ep2-bf16",
        "test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_in_one_process": "dp2-ep2-stopped-at-3"}


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
