"""`dufu convert` of a checkpoint written by 4 processes (tp 2 x pp 2), in one plain process.

The checkpoint is the final one (step 10) of run B resumed at tp 2 x pp 2; run A is the same training
(same global batch) on one process.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from checkpoint_runs import consolidated
from launch import assert_ok, run
from parity import assert_checkpoint_matches

pytestmark = pytest.mark.multiprocess

CKPT = ("checkpoints", "step_0000010")


def tp2_pp2_checkpoint(jobs):
    proc = jobs.result("resume_tp2_pp2")
    assert_ok(proc)
    ckpt = proc.output_dir.joinpath(*CKPT)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and "tp 2 x pp 2" in manifest["layout"]
    return ckpt


def convert(*args) -> "object":
    return run([sys.executable, "-m", "dufu", "convert", *map(str, args)], timeout=300)


@pytest.mark.checkpoint_jobs("resume_tp2_pp2")
def test_to_torch_gives_the_single_process_weights(jobs, reference, tmp_path):
    ckpt = tp2_pp2_checkpoint(jobs)
    out = tmp_path / "model.pt"
    proc = convert(ckpt, "--to-torch", out)
    assert_ok(proc)
    state = torch.load(out, weights_only=True)
    # run A's weights after its 10 steps (its own last checkpoint), within what AdamW lets layouts differ by
    assert_checkpoint_matches(state, reference.output_dir, 10, "dufu convert --to-torch of the tp 2 x pp 2 run")


@pytest.mark.checkpoint_jobs("resume_tp2_pp2")
def test_to_hf_loads_in_transformers_with_the_same_logits(jobs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from dufu.config import LazyConfig, instantiate

    ckpt = tp2_pp2_checkpoint(jobs)
    out = tmp_path / "hf"
    assert_ok(convert(ckpt, "--to-hf", out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()

    model = instantiate(LazyConfig.load(str(ckpt / "config.yaml")).model)
    model.load_state_dict(consolidated(ckpt))
    model.eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        got = hf(input_ids=ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_convert_of_a_missing_checkpoint_exits_2_with_a_clear_message(tmp_path):
    missing = tmp_path / "no_such_run"
    proc = convert(missing, "--to-torch", tmp_path / "out.pt")
    assert proc.returncode == 2, proc.describe()
    message = " ".join(proc.stderr.split())
    assert message.startswith("error:") and str(missing) in message and "does not exist" in message
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.pt").exists()
