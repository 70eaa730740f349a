"""A finished delta run read back whole: base + delta in one process, for `dufu generate`."""

from __future__ import annotations

import pytest
import torch

import launch
from parity import PARITY_ARGS, final_model_state

pytestmark = pytest.mark.multiprocess


def test_a_delta_run_reads_back_as_its_base_plus_its_delta(tmp_path):
    from dufu.config import LazyConfig, instantiate
    from dufu.engine.delta_run import load_delta_run
    from dufu.engine.weights.convert import resolve_checkpoint
    from dufu.parallel.materialize import materialize_

    out = tmp_path / "run"
    launch.assert_ok(launch.run(launch.train_command("llama_lora_debug", out, 1, *PARITY_ARGS), output_dir=out))
    ckpt = resolve_checkpoint(out)
    model = load_delta_run(ckpt)
    state = model.state_dict()
    delta = final_model_state(out)
    assert delta and all(".lora_" in k for k in delta)
    for k, v in delta.items():  # the delta as trained
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
        assert "lora_B" not in k or v.abs().sum() > 0  # B left zero: the run did not train
    # the base as the run built it: the seeded initialisation of the same model
    cfg = LazyConfig.load(str(ckpt / "config.yaml"))
    with torch.device("meta"):
        base = instantiate(cfg.model)
    materialize_(base, base, torch.device("cpu"), seed=int(cfg.train.seed))
    for k, v in base.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    # and `dufu generate` serves it
    proc = launch.run(launch.dufu_command("generate", str(out), "--prompt", "The ", "--max-new-tokens", "4",
                                          "--greedy"))
    launch.assert_ok(proc)
    assert proc.stdout.startswith("The ")
