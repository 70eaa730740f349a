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
from pathlib import Path

import pytest

import launch
from parity import PARITY_ARGS, assert_matches_reference, parity_run

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
def references(tmp_path_factory):
    """The single-process run of each delta, made once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            config, overrides = DELTAS[kind]
            made[kind] = parity_run(tmp_path_factory.mktemp(f"ref-{kind}"), 1, *overrides, config=config)
        return made[kind]

    return get


# LoRA in every layout; each other kind in the layouts where its own code differs: under tensor parallelism
# (sharded factors, magnitudes, adapters and prefixes split by heads, a prompt regathered under SP), under ZeRO-3
# (parameters gathered per unit with frozen ones beside them) and under pipelining (virtual tokens and prefixes
# on their stage). The full grid ran 30 jobs for the same coverage of code paths.
GRID = [("lora", layout) for layout in LAYOUTS] + [
    ("dora", "tp2"), ("dora", "dp2-zero3"), ("bitfit", "tp2"), ("adapter", "tp2-sp"),
    ("adapter", "dp2-zero3"), ("prefix", "tp2"), ("prefix", "pp2"), ("prompt", "tp2-sp"), ("prompt", "pp2")]


@pytest.mark.parametrize("kind,layout", GRID, ids=[f"{k}-{lay}" for k, lay in GRID])
def test_delta_matches_single_process(kind, layout, references, tmp_path):
    config, overrides = DELTAS[kind]
    nproc, layout_overrides = LAYOUTS[layout]
    reference = references(kind)
    got = parity_run(tmp_path / layout, nproc, *overrides, *layout_overrides, config=config)
    assert got.state and set(got.state) == set(reference.state)
    assert_matches_reference(got, reference, f"{kind} {layout}")


def _checkpoint_keys(ckpt: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def test_lora_checkpoint_holds_only_the_delta_and_resumes_in_another_layout(references, tmp_path):
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
    first = launch.run(launch.train_command(config, out, 2, *PARITY_ARGS, *overrides, TP2, "train.stop_at_iter=3",
                                            "train.checkpointer.period=3"), output_dir=out)
    launch.assert_ok(first)
    second = launch.run(launch.train_command(config, out, 2, *PARITY_ARGS, *overrides, PP2,
                                             "train.checkpointer.period=3", "--resume"), output_dir=out)
    launch.assert_ok(second)
    assert_matches_reference(out, reference, "lora saved at tp2, resumed at pp2")

    # a delta belongs to its base: another seed is another base, and the resume says so
    other = launch.run(launch.train_command(config, out, 1, *PARITY_ARGS, *overrides, "train.seed=7", "--resume"),
                       output_dir=out)
    assert other.returncode != 0
    # the error is wrapped at 100 columns, where the line breaks depends on the temporary path's length
    assert "holds a delta trained on another base" in " ".join((other.stdout + other.stderr).split())


def test_lora_in_three_dimensions_with_zero3_matches_single_process(references, tmp_path):
    config, overrides = LORA
    got = parity_run(tmp_path / "3d", 8, *overrides, DP2, TP2, PP2, *ZERO3, config=config)
    assert_matches_reference(got, references("lora"), "lora dp2 x tp2 x pp2, ZeRO-3")


@pytest.mark.parametrize("stage", [1, 2])
def test_lora_under_zero_1_and_2_matches_single_process(stage, references, tmp_path):
    config, overrides = LORA
    got = parity_run(tmp_path / f"zero{stage}", 2, *overrides, DP2, "train.zero_optimization.enabled=True",
                     f"train.zero_optimization.stage={stage}", config=config)
    assert_matches_reference(got, references("lora"), f"lora dp2 ZeRO-{stage}")
