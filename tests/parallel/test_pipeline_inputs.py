"""Pipeline stages get every model input of the batch, not only the main one.

Each stage receives the batch's inputs other than the main input and the labels (attention masks, token
types ...) as keyword arguments, from its own rank's copy of the batch; only activations travel between
stages. In process: how a batch is split for the schedule, and that a stage chain with masks computes the
whole model's forward. Multi-process: a padded classification batch (bert_classify_debug: ``input_ids``,
``attention_mask``, ``labels``) trains under pipeline parallel 2 to the single-process numbers
(``bert-classify-pp2`` in tests/parallel/test_zoo_encoders.py).
"""

from __future__ import annotations

import pytest
import torch

from dufu.errors import LayoutError
from dufu.models.bert import BertForSequenceClassification
from dufu.models.t5 import T5ForConditionalGeneration
from dufu.parallel.pipeline import build_stage_module, split_pipeline_batch


def tiny_bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=4,
                                         max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                                         num_labels=3).eval()


def padded_batch():
    torch.manual_seed(1)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 9:] = 0
    return {"input_ids": torch.randint(1, 64, (4, 12)), "attention_mask": mask,
            "token_type_ids": (torch.arange(12) >= 6).long().expand(4, 12), "labels": torch.tensor([0, 2, 1, 2])}


def test_the_batch_splits_into_first_stage_input_every_stage_inputs_and_target():
    batch = padded_batch()
    first, kwargs, target = split_pipeline_batch(tiny_bert(), batch, "input_ids")
    assert first[0] is batch["input_ids"] and len(first) == 1
    assert set(kwargs) == {"attention_mask", "token_type_ids"} and target is batch["labels"]
    # causal LM data: the already-shifted labels are the target
    ids, shifted = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    _, kwargs, target = split_pipeline_batch(tiny_bert(), {"input_ids": ids, "shift_labels": shifted}, "input_ids")
    assert kwargs == {} and target is shifted


def test_a_seq2seq_first_stage_gets_its_decoder_inputs_from_the_labels():
    model = T5ForConditionalGeneration(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    labels = torch.tensor([[5, 6, -100]])
    _, kwargs, target = split_pipeline_batch(model, {"input_ids": torch.ones(1, 4, dtype=torch.long),
                                                     "labels": labels}, "input_ids")
    assert target is labels
    assert kwargs["decoder_input_ids"].tolist() == [[model.decoder_start_token_id, 5, 6]]


@pytest.mark.parametrize("batch, fragments", [
    ({"input_ids": torch.ones(2, 3)}, ["from the batch's labels", "only ['input_ids']", "labels"]),
    ({"pixel_values": torch.ones(2, 3), "labels": torch.ones(2)},
     ["main input 'input_ids'", "only ['pixel_values']", "dataset matches the model"]),
])
def test_a_batch_the_pipeline_cannot_take_is_named(batch, fragments):
    with pytest.raises(LayoutError) as info:
        split_pipeline_batch(tiny_bert(), batch, "input_ids")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_stages_with_the_padding_mask_compute_the_whole_forward():
    """Three stages of one block each, chained as torch's PipelineStage chains them; the mask matters in
    every block, so a later stage run without it would give other logits."""
    model, batch = tiny_bert(), padded_batch()
    stages = [build_stage_module(model, s, 3, [0, 1, 2]) for s in range(3)]
    first, kwargs, target = split_pipeline_batch(stages[0], batch, "input_ids")
    h = stages[0](*first, **kwargs)
    h1 = stages[1](h, **kwargs)
    logits = stages[2](h1, **kwargs)
    ref = model(**batch)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(type(model).pipeline_loss(logits, target), ref.loss, rtol=0, atol=0)
    unmasked = stages[2](stages[1](h, token_type_ids=kwargs["token_type_ids"]), **kwargs)
    assert not torch.allclose(unmasked, logits)
