"""The promise for the model zoo beyond GPT: a layout trains to the same numbers as one process.

* bert_debug (masked LM, the same masks in every layout) under tensor (also with sequence parallelism: post-norm
  blocks add a norm's output to the attention output, both sequence shards) and pipeline parallelism: batches
  carry only ``input_ids`` and ``labels``: the stages pass hidden states and the last stage takes BERT's
  masked-LM loss (``pipeline_loss``); RoBERTa (its own positions) under tensor + sequence
  parallelism.
* bert_classify_debug (padded sentences: ``input_ids``, ``attention_mask``, ``labels``) under pipeline
  parallelism: every stage takes the mask from its own copy of the batch.
* a transformers architecture trained as-is (hf_auto_gpt_neox_debug) under data parallelism with ZeRO 3.

fp32, fixed global batch 8, 5 steps: logged losses equal the single-process ones within 1e-5 relative, and the
weights after the last step match.
"""

from __future__ import annotations

import pytest

from parity import Spec, assert_matches_reference

pytestmark = pytest.mark.multiprocess

# id: (recipe, processes, overrides)
LAYOUTS = {
    "bert-tp2": ("bert_debug", 2, ["train.dist.tensor_parallel_size=2"]),
    "bert-pp2": ("bert_debug", 2, ["train.dist.pipeline_parallel_size=2"]),
    # padded batches (attention_mask) under pipeline parallelism: every stage gets the mask from its own batch
    "bert-classify-pp2": ("bert_classify_debug", 2, ["train.dist.pipeline_parallel_size=2"]),
    "bert-tp2-sp": ("bert_debug", 2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
    "roberta-tp2-sp": ("roberta_debug", 2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
    "hf-auto-dp2-zero3": ("hf_auto_gpt_neox_debug", 2, ["train.dist.data_parallel_size=2",
                                                         "train.zero_optimization.enabled=True",
                                                         "train.zero_optimization.stage=3"]),
}
# Models that are a packaged recipe plus overrides: RoBERTa is bert_debug with RoBERTa's positions (counted from
# pad_token_id + 1, hence 2 more) and no token types.
VARIANTS = {
    "roberta_debug": ("bert_debug", ["model._target_=dufu.models.bert.RobertaForMaskedLM", "model.pad_token_id=0",
                                     "model.max_position_embeddings=34", "model.type_vocab_size=1"]),
}


def recipe_args(name: str) -> tuple[str, list[str]]:
    return VARIANTS.get(name, (name, []))


def spec(layout: str) -> Spec:
    recipe, nproc, overrides = LAYOUTS[layout]
    config, model_overrides = recipe_args(recipe)
    return Spec(nproc, (*model_overrides, *overrides), config=config)


@pytest.fixture(scope="module")
def layout_runs(shared_runs):
    """Every layout's run, launched together by world size (tests/parity.py's SharedRuns)."""
    return shared_runs({layout: spec(layout) for layout in LAYOUTS})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zoo_layout_matches_single_process(layout, recipe_reference, layout_runs):
    recipe = LAYOUTS[layout][0]
    config, model_overrides = recipe_args(recipe)
    reference = recipe_reference(config, *model_overrides)
    got = layout_runs.result(layout)
    assert_matches_reference(got, reference, layout)
