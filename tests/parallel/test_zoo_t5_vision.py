"""T5, ViT and Swin train to the same numbers in parallel layouts as on one process.

Each model's debug recipe, fp32, fixed global batch 8, 5 steps (as tests/parallel/test_loss_parity.py): the
logged losses equal the single-process losses within 1e-5 relative, and so do the weights after the last step.

* ViT: data parallel 2, tensor parallel 2 and pipeline parallel 2 (1F1B; stages pass the (B, 1 + N, C) hidden
  states), evaluated before and after training: eval_loss, eval_ppl and eval_accuracy equal one process's.
* Swin: tensor parallel 2 (the relative-bias tables split by head) and pipeline parallel 2 (the stages meet
  after patch merging, passing (B, 4*4, 2C)).
* T5: tensor parallel 2 (relative-bias tables split by head, vocabulary-parallel embedding and head), and
  pipeline parallel 2 with the 2 encoder + 2 decoder blocks in one stage order, so stages pass several
  tensors (``T5ForConditionalGeneration.pipeline_forward``): 1F1B cut between encoder and decoder (encoder
  output + decoder embeddings); interleaved 1F1B with one block per stage (every cut: inside the encoder,
  where the relative bias travels too, between the stacks, inside the decoder); and pp 2 x tp 2 cut inside
  the encoder (the travelling bias holds each tensor-parallel rank's heads).
"""

from __future__ import annotations

import pytest

from parity import EVAL_ARGS, Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

TP2, PP2 = "train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"

# id: (recipe, processes, overrides)
LAYOUTS = {
    "vit-dp2": ("vit_debug", 2, ["train.dist.data_parallel_size=2"]),
    "vit-tp2": ("vit_debug", 2, [TP2]),
    "vit-pp2": ("vit_debug", 2, [PP2]),
    "swin-tp2": ("swin_debug", 2, [TP2]),
    "swin-pp2": ("swin_debug", 2, [PP2]),
    "t5-tp2": ("t5_debug", 2, [TP2]),
    "t5-pp2": ("t5_debug", 2, [PP2]),
    "t5-pp2-interleaved": ("t5_debug", 2, [PP2, "train.dist.pipeline_schedule=interleaved_1f1b",
                                           "train.dist.virtual_pipeline_size=2"]),
    "t5-pp2-tp2": ("t5_debug", 4, [PP2, TP2, "train.dist.custom_pipeline_stage_id=[0,1,1,1]"]),
}
# Recipes evaluated too (a classifier: eval_accuracy besides eval_loss and eval_ppl).
EVALUATED = {"vit_debug"}


def spec(layout: str) -> Spec:
    recipe, nproc, overrides = LAYOUTS[layout]
    evaluation = EVAL_ARGS if recipe in EVALUATED else ()
    return Spec(nproc, (*evaluation, *overrides), config=recipe)


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    """Every layout's run, launched together by world size (tests/parity.py's SharedRuns)."""
    return shared_runs({layout: spec(layout) for layout in LAYOUTS})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, recipe_reference, layout_runs):
    recipe = LAYOUTS[layout][0]
    evaluation = EVAL_ARGS if recipe in EVALUATED else ()
    reference = recipe_reference(recipe, *evaluation)
    got = layout_runs.result(layout)
    if evaluation:
        assert sorted(got.evals) == [0, 5] and "eval_accuracy" in got.evals[5], got.evals
    assert_matches_reference(got, reference, layout)
