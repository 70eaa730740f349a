"""A two-corpus blend trains gpt_debug to the single-process losses in dp2 and pp2, resumes exactly after a stop
mid-run, and evaluates each corpus on its own (eval_loss/<name>, eval_ppl/<name>).

The blend: the built-in corpus (weight 0.7) and a second corpus made of 30 of its documents written backwards
(weight 0.3), in Megatron's list form in a config file derived from gpt_debug.
"""

from __future__ import annotations

import json
import math

import pytest

import launch
from parity import EVAL_ARGS, PARITY_ARGS, Spec, assert_matches_reference, collect

pytestmark = pytest.mark.multiprocess

NAMES = ("builtin", "reversed")
DP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.pipeline_parallel_size=2"


@pytest.fixture(scope="module")
def blend_config(tmp_path_factory):
    """gpt_debug with dataloader.train.data_path = [0.7, "builtin", 0.3, "<dir>/reversed.jsonl"]."""
    from dufu.data import builtin_documents

    d = tmp_path_factory.mktemp("blend")
    corpus = d / "reversed.jsonl"
    corpus.write_text("".join(json.dumps({"text": doc[::-1]}) + "\n" for doc in builtin_documents()[:30]),
                      encoding="utf-8")
    config = d / "gpt_blend_debug.py"
    config.write_text(
        "from dufu.config import LazyConfig\n"
        "from dufu.config.packaged import resolve_config_path\n\n"
        "dataloader, model, optim, tokenization, train = LazyConfig.load(\n"
        '    resolve_config_path("gpt_debug"), keys=("dataloader", "model", "optim", "tokenization", "train"))\n'
        f'dataloader.train.data_path = [0.7, "builtin", 0.3, {str(corpus)!r}]\n',
        encoding="utf-8")
    return str(config)


def run(config, output_dir, nproc, *overrides, resume=False):
    proc = launch.run(launch.train_command(config, output_dir, nproc, *PARITY_ARGS, *EVAL_ARGS, *overrides,
                                           resume=resume), output_dir=output_dir)
    launch.assert_ok(proc)
    return proc


@pytest.fixture(scope="module")
def reference(blend_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run(blend_config, out, 1)
    return collect(out), proc.stdout + proc.stderr


def assert_per_dataset_evaluations(got, reference, what: str) -> None:
    for step, ref in reference.evals.items():
        for name in NAMES:
            a, b = got.evals[step][f"eval_loss/{name}"], ref[f"eval_loss/{name}"]
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {step} eval_loss/{name} {a} != single-process {b}"


def test_reference_reports_each_dataset(reference):
    result, output = reference
    assert sorted(result.evals) == [0, 5]
    for record in result.evals.values():
        losses = [record[f"eval_loss/{name}"] for name in NAMES]
        for name, loss in zip(NAMES, losses):
            assert math.isclose(record[f"eval_ppl/{name}"], math.exp(loss), rel_tol=1e-9)
        # the overall loss is the mean over all targets evaluated: both datasets' batches, eval_iter=2 each
        assert math.isclose(record["eval_loss"], sum(losses) / 2, rel_tol=1e-9)
        assert record["eval_samples"] == 2 * 2 * 8
    # the start-up summary: one line per dataset with tokens, weight and epochs
    text = " ".join(output.split())
    assert "data blend of 2 datasets" in text
    assert "weight 0.7:" in text and "weight 0.3:" in text and "epochs in 5 steps" in text


@pytest.fixture(scope="module")
def layout_runs(blend_config, shared_runs):
    """The 2-process runs of this module in one launch (tests/parity.py's SharedRuns); "resumed" starts from a copy
    of "stopped"."""
    runs = {
        "dp2": Spec(2, (*EVAL_ARGS, DP2), config=blend_config),
        "pp2": Spec(2, (*EVAL_ARGS, PP2), config=blend_config),
        "stopped": Spec(2, (*EVAL_ARGS, DP2, "train.stop_at_iter=3", "train.checkpointer.period=3"), config=blend_config),
        "resumed": Spec(2, (*EVAL_ARGS, PP2, "train.checkpointer.period=3"), config=blend_config, resume_of="stopped"),
    }
    return shared_runs(runs, uses={"test_blend_resumes_exactly_after_a_stop": "resumed"})


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_blend_layout_matches_single_process(layout, blend_config, reference, layout_runs):
    got, ref = layout_runs.result(layout), reference[0]
    assert_matches_reference(got, ref, f"blend {layout}")
    assert_per_dataset_evaluations(got, ref, f"blend {layout}")


def test_blend_resumes_exactly_after_a_stop(blend_config, reference, layout_runs):
    got, ref = layout_runs.result("resumed"), reference[0]
    assert_matches_reference(got, ref, "blend stopped at step 3 in dp2, resumed in pp2")
    assert_per_dataset_evaluations(got, ref, "blend resumed")
