"""DeepSeek-V3 (deepseek_v3_debug: MLA, DeepSeekMoE with group-limited sigmoid routing, a choice bias and the
sequence-wise balance loss, one multi-token-prediction depth) trains to the same numbers in parallel layouts as on
one process: losses, learning rates and gradient norms at every step and the final weights (tests/parity.py), in
fp32 over 3 steps of a global batch of 8. Layouts: dp2, dp2 ZeRO-3, tp2 with sequence parallelism (MLA's
up-projections split by heads, its down-projections replicated, the MTP module replicated), pp2 (blocks 0-1 and
block 2 with the MTP module on the last stage), dp2 x ep2 (the experts split), and cp2 (MLA gathering the
latents), which needs a model without MTP and without the sequence-wise loss: with either the run is refused at
start-up with the reason. All two-process runs share one job (tests/parity.py's SharedRuns)."""

from __future__ import annotations

import pytest

from dufu.errors import LayoutError
from parity import Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

CONFIG = "deepseek_v3_debug"
DP2, TP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2"
PP2 = "train.dist.pipeline_parallel_size=2"
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
EP2, CP2 = "train.dist.expert_parallel_size=2", "train.dist.context_parallel_size=2"
# 3 steps instead of parity's 5 (the final weights from a checkpoint at step 3): the model is the zoo's largest debug
# model, and three steps already compare losses and gradient norms after two updates
STEPS = ("train.train_iter=3", "train.checkpointer.period=3")
# context parallelism splits sequences: no multi-token prediction and no sequence-wise balance loss
CP_MODEL = ("model.mtp_depth=0", "model.seq_aux_loss_coeff=0")

LAYOUTS = {
    "dp2": (DP2,),
    "dp2-zero3": (DP2, *ZERO3),
    "tp2-sp": (TP2, "train.dist.sequence_parallel=True"),
    "pp2": (PP2,),
    "dp2xep2": (DP2, EP2),
    "cp2": (CP2, *CP_MODEL),
}


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    return shared_runs({layout: Spec(2, (*STEPS, *overrides), config=CONFIG) for layout, overrides in LAYOUTS.items()})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, layout_runs, reference_run):
    reference = reference_run(CONFIG, *STEPS, *(CP_MODEL if layout == "cp2" else ()))
    assert_matches_reference(layout_runs.result(layout), reference, f"{CONFIG} {layout}", steps=3)


def test_context_parallel_with_mtp_or_the_sequence_loss_is_refused():
    """The start-up check (dufu.parallel.checks, run by the launcher before any worker starts) names the reason."""
    import torch

    from dufu.config import LazyConfig, instantiate, resolve_config_path
    from dufu.parallel.checks import check_context_parallel

    for extra, reason in (((), "multi-token prediction"), (("model.mtp_depth=0",), "seq_aux_loss_coeff"),
                          (CP_MODEL, None)):
        cfg = LazyConfig.load(resolve_config_path(CONFIG))
        LazyConfig.apply_overrides(cfg, list(extra))
        with torch.device("meta"):
            model = instantiate(cfg.model)
        if reason is None:
            check_context_parallel(2, model, 32)  # accepted
            continue
        with pytest.raises(LayoutError, match=f"cannot be split by context parallelism: .*{reason}"):
            check_context_parallel(2, model, 32)
