"""The promise: every layout trains to the same numbers as one process.

gpt_debug, fp32, fixed global batch 8, 5 steps: the logged losses equal the single-process losses within
1e-5 relative, and the weights after the last step match.
"""

from __future__ import annotations

import pytest

from parallel_runs import PARITY_ARGS, assert_matches_reference, assert_ok, run_dufu

DP2, TP2, PP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"
ZERO = "train.zero_optimization.enabled=True"

# id: (processes, model layers, overrides)
LAYOUTS = {
    "dp2": (2, 2, [DP2]),
    "dp2-zero1": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=1"]),
    "dp2-zero2": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=2"]),
    "dp2-zero3": (2, 2, [DP2, ZERO, "train.zero_optimization.stage=3"]),
    "dp4-zero3": (4, 2, ["train.dist.data_parallel_size=4", ZERO, "train.zero_optimization.stage=3"]),
    "tp2": (2, 2, [TP2]),
    "tp2-sp": (2, 2, [TP2, "train.dist.sequence_parallel=True"]),
    "pp2-gpipe": (2, 2, [PP2, "train.dist.pipeline_schedule=gpipe"]),
    "pp2-1f1b": (2, 2, [PP2, "train.dist.pipeline_schedule=1f1b"]),
    "pp2-interleaved": (2, 4, [PP2, "train.dist.pipeline_schedule=interleaved_1f1b", "train.dist.virtual_pipeline_size=2"]),
    "pp2-zero-bubble": (2, 4, [PP2, "train.dist.pipeline_schedule=interleaved_zero_bubble", "train.dist.virtual_pipeline_size=2"]),
    "dp2xtp2": (4, 2, [DP2, TP2]),
    "dp2xpp2": (4, 2, [DP2, PP2]),
    "tp2xpp2": (4, 2, [TP2, PP2]),
    "dp2xtp2xpp2": (8, 2, [DP2, TP2, PP2]),
    "dp2xtp2xpp2-ac-zero3": (8, 2, [DP2, TP2, PP2, "train.activation_checkpoint.enabled=True", ZERO,
                                    "train.zero_optimization.stage=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, parity_reference, tmp_path):
    nproc, layers, overrides = LAYOUTS[layout]
    reference = parity_reference(layers)
    out = tmp_path / layout
    assert_ok(run_dufu(out, nproc, *PARITY_ARGS, f"model.num_layers={layers}", *overrides))
    assert_matches_reference(out, reference, layout)
