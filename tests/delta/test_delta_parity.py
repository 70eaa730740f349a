"""Delta runs train to one-process numbers in every layout, save only the delta, and resume in another layout.

LoRA: llama_lora_debug with factors beside column-parallel (q_proj, v_proj) and row-parallel (out_proj,
down_proj) layers; DoRA beside q_proj and out_proj. BitFit + Freeze: gpt_debug's biases and final norm
(tests/delta/gpt_bitfit_debug.py). Houlsby adapters on gpt_debug (tests/delta/gpt_adapter_debug.py). Prefix tuning on the tiny LLaMA
(tests/delta/llama_prefix_debug.py; GQA: 2 key/value heads, split by heads under TP). Prompt tuning on
gpt_debug (tests/delta/gpt_prompt_debug.py; under SP the hooks regather the sequence).
Each kind in the layouts of GRID. Losses within 1e-5 of the single-process run and the final delta weights within tests/parity.py's bound.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import launch
from parity import PARITY_ARGS, Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
LORA = ("llama_lora_debug", ['delta.targets=["q_proj","v_proj","out_proj","down_proj"]'])
BITFIT = (str(HERE / "gpt_bitfit_debug.py"), [])
DORA = ("llama_lora_debug", ['delta.targets=["q_proj","out_proj"]', "delta.dora=True"])
ADAPTER = (str(HERE / "gpt_adapter_debug.py"), [])
PREFIX = (str(HERE / "llama_prefix_debug.py"), [])
PROMPT = (str(HERE / "gpt_prompt_debug.py"), [])
DELTAS = {"lora": LORA, "dora": DORA, "bitfit": BITFIT, "adapter": ADAPTER, "prefix": PREFIX, "prompt": PROMPT}

DP2, TP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
LAYOUTS = {
    "dp2": (2, [DP2]),
    "dp2-zero3": (2, [DP2, *ZERO3]),
    "tp2": (2, [TP2]),
    "tp2-sp": (2, [TP2, "train.dist.sequence_parallel=True"]),
    "pp2": (2, [PP2]),
}


@pytest.fixture(scope="module")
def references(reference_run):
    """The single-process run of each delta, made once (in this process)."""

    def get(kind: str):
        config, overrides = DELTAS[kind]
        return reference_run(config, *overrides)

    return get


# LoRA in every layout; each other kind in the layouts where its own code differs: under tensor parallelism
# (sharded factors, magnitudes, adapters and prefixes split by heads, a prompt regathered under SP), under ZeRO-3
# (parameters gathered per unit with frozen ones beside them) and under pipelining (virtual tokens and prefixes
# on their stage). The full grid ran 30 jobs for the same coverage of code paths.
GRID = [("lora", layout) for layout in LAYOUTS] + [
    ("dora", "tp2"), ("dora", "dp2-zero3"), ("bitfit", "tp2"), ("adapter", "tp2-sp"),
    ("adapter", "dp2-zero3"), ("prefix", "tp2"), ("prefix", "pp2"), ("prompt", "tp2-sp"), ("prompt", "pp2")]


def lora(nproc: int, *layout: str) -> Spec:
    config, overrides = LORA
    return Spec(nproc, (*overrides, *layout), config=config)


# Every run of this module, launched together by world size (tests/parity.py's SharedRuns).
RUNS = {
    **{f"{kind}-{layout}": Spec(LAYOUTS[layout][0], (*DELTAS[kind][1], *LAYOUTS[layout][1]), config=DELTAS[kind][0])
       for kind, layout in GRID},
    "lora-tp2-stopped-at-3": lora(2, TP2, "train.stop_at_iter=3", "train.checkpointer.period=3"),
    "lora-resumed-at-pp2": Spec(2, (*LORA[1], PP2, "train.checkpointer.period=3"), config=LORA[0],
                                resume_of="lora-tp2-stopped-at-3"),
    "lora-dp2xtp2xpp2-zero3": lora(8, DP2, TP2, PP2, *ZERO3),
    **{f"lora-dp2-zero{stage}": lora(2, DP2, "train.zero_optimization.enabled=True",
                                     f"train.zero_optimization.stage={stage}") for stage in (1, 2)},
}
USES = {
    "test_delta_matches_single_process": lambda p: f"{p['kind']}-{p['layout']}",
    "test_lora_checkpoint_holds_only_the_delta_and_resumes_in_another_layout": "lora-resumed-at-pp2",
    "test_lora_in_three_dimensions_with_zero3_matches_single_process": "lora-dp2xtp2xpp2-zero3",
    "test_lora_under_zero_1_and_2_matches_single_process": lambda p: f"lora-dp2-zero{p['stage']}",
}


@pytest.fixture(scope="module")
def delta_runs(shared_runs):
    return shared_runs(RUNS, uses=USES)


@pytest.mark.parametrize("kind,layout", GRID, ids=[f"{k}-{lay}" for k, lay in GRID])
def test_delta_matches_single_process(kind, layout, references, delta_runs):
    reference = references(kind)
    got = delta_runs.result(f"{kind}-{layout}")
    assert got.state and set(got.state) == set(reference.state)
    assert_matches_reference(got, reference, f"{kind} {layout}")


def _checkpoint_keys(ckpt: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def test_lora_checkpoint_holds_only_the_delta_and_resumes_in_another_layout(references, delta_runs, tmp_path):
    config, overrides = LORA
    reference = references("lora")
    # the reference's checkpoint: the factors, their AdamW moments, nothing of the frozen base
    ckpt = sorted((reference.output_dir / "checkpoints").glob("step_*"))[-1]
    keys = _checkpoint_keys(ckpt)
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), sorted(keys)[:8]
    assert any(k.startswith("optim.state.") for k in keys)
    meta = json.loads((ckpt / "manifest.json").read_text())
    assert meta["delta"]["base"] is None and len(meta["delta"]["fingerprint"]) == 64

    # stop at step 3 under tp2, resume to step 5 under dp2 x pp2... here dp2 (2 processes): the same losses
    out = tmp_path / "resumed"
    shutil.copytree(delta_runs.output_dir("lora-resumed-at-pp2"), out)  # stopped under tp2, resumed under pp2
    assert_matches_reference(out, reference, "lora saved at tp2, resumed at pp2")

    # a delta belongs to its base: another seed is another base, and the resume says so
    other = launch.run(launch.train_command(config, out, 1, *PARITY_ARGS, *overrides, "train.seed=7", "--resume",
                                                  "--override-saved", "train.seed"),
                       output_dir=out)
    assert other.returncode != 0
    # the error is wrapped at 100 columns, where the line breaks depends on the temporary path's length
    assert "holds a delta trained on another base" in " ".join((other.stdout + other.stderr).split())


def test_lora_in_three_dimensions_with_zero3_matches_single_process(references, delta_runs):
    got = delta_runs.result("lora-dp2xtp2xpp2-zero3")
    assert_matches_reference(got, references("lora"), "lora dp2 x tp2 x pp2, ZeRO-3")


@pytest.mark.parametrize("stage", [1, 2])
def test_lora_under_zero_1_and_2_matches_single_process(stage, references, delta_runs):
    got = delta_runs.result(f"lora-dp2-zero{stage}")
    assert_matches_reference(got, references("lora"), f"lora dp2 ZeRO-{stage}")
