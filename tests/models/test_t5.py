"""T5: the model as the paper describes it, logits equal to transformers' both ways, span-corruption data,
the recipes, and a short training run through the trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dufu.data import build_tokenizer
from dufu.data.span_corruption import (
    build_span_corruption_datasets,
    compute_lengths,
    corrupted_lengths,
    noise_mask,
)
from dufu.errors import LayoutError
from dufu.layers import HeadwiseEmbedding
from dufu.engine.weights.pretrained import from_pretrained
from dufu.models import hub
from dufu.models.t5 import (
    T5EncoderModel,
    T5ForConditionalGeneration,
    T5Model,
    count_t5_parameters,
    relative_position_bucket,
)

KW = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
          relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0)


def make(cls=T5ForConditionalGeneration, **kw):
    torch.manual_seed(0)
    return cls(**{**KW, **kw})


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 99, (2, 30), generator=g)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, 20:] = 0  # the second sequence is padded
    labels = torch.randint(2, 99, (2, 25), generator=g)
    labels[0, 20:] = -100
    dec_mask = torch.ones(2, 25, dtype=torch.long)
    dec_mask[0, 20:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels, decoder_attention_mask=dec_mask)


# ------------------------------------------------------------------ the model


def test_relative_position_bucket_matches_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)[None, :] - torch.arange(0, 40)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 20)):
            ours = relative_position_bucket(rel, bidirectional, buckets, distance)
            theirs = T5Attention._relative_position_bucket(rel, bidirectional, buckets, distance)
            assert torch.equal(ours, theirs)
            assert ours.min() >= 0 and ours.max() < buckets


def test_forward_shapes_loss_and_shift_right(batch):
    model = make()
    out = model(**batch)
    assert out.logits.shape == (2, 25, 99)
    # near uniform at initialisation: a tied N(0, 1) table scaled by d^-1/2 gives logits ~N(0, 1), so the loss sits
    # near log V + 0.5 (0.25 to 0.94 above it over 12 seeds)
    assert abs(out.loss.item() - math.log(99)) < 1.0
    labels = batch["labels"]
    keep = labels != -100
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[keep], labels[keep]))
    # labels -> decoder inputs: start token, then labels shifted right, -100 as padding
    dec = model.shift_right(labels)
    assert (dec[:, 0] == model.decoder_start_token_id).all()
    assert torch.equal(dec[1, 1:], labels[1, :-1])
    assert (dec[0, 21:] == model.pad_token_id).all()
    explicit = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=dec,
                     decoder_attention_mask=batch["decoder_attention_mask"])
    torch.testing.assert_close(explicit.logits, out.logits)
    assert explicit.loss is None
    with pytest.raises(ValueError, match="decoder_input_ids or labels"):
        model(input_ids=batch["input_ids"])


def test_decoder_is_causal_and_padding_is_ignored(batch):
    model = make().eval()
    ids, labels = batch["input_ids"], batch["labels"].clamp(min=0)
    base = model(input_ids=ids, labels=labels).logits
    changed = labels.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 99
    after = model(input_ids=ids, labels=changed).logits
    # decoder input t+1 is label t: positions <= 10 cannot see the change, later ones do
    torch.testing.assert_close(after[:, :11], base[:, :11])
    assert not torch.allclose(after[:, 11:], base[:, 11:])
    # a padded encoder position changes nothing when masked
    mask = batch["attention_mask"]
    other = ids.clone()
    other[1, 25] = 3
    a = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    b = model(input_ids=other, attention_mask=mask, labels=labels).logits
    torch.testing.assert_close(a, b)


def test_no_biases_rms_norms_scale_one_and_tied_rescale():
    model = make()
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.endswith("bias") for n in names)
    assert isinstance(model.encoder.final_norm, torch.nn.RMSNorm)
    attn = model.decoder.blocks["0"].self_attn
    assert attn.scale == 1.0 and attn.causal and not model.encoder.blocks["0"].self_attn.causal
    assert model.decoder.blocks["0"].cross_attn is not None and model.encoder.blocks["0"].cross_attn is None
    # tied head: one tensor, decoder output rescaled by d_model^-0.5; untied (v1.1): neither
    assert model.lm_head.weight is model.wte.weight and model.scale_decoder_outputs
    untied = make(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight and not untied.scale_decoder_outputs
    assert hasattr(untied.encoder.blocks["0"].mlp, "gate_proj")


def test_relative_bias_table_is_split_by_head_under_tensor_parallelism():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from dufu.parallel.tensor_parallel import tensor_parallel_plan

    model = make()
    for stack in (model.encoder, model.decoder):
        table = stack.relative_bias.table
        assert isinstance(table, HeadwiseEmbedding) and table.parallel == "col"
        assert table.weight.shape == (KW["relative_attention_num_buckets"], KW["num_heads"])
    plan = tensor_parallel_plan(model, head=model.lm_head)
    assert isinstance(plan["encoder.relative_bias.table"], ColwiseParallel)
    assert isinstance(plan["decoder.blocks.0.cross_attn.k_proj"], ColwiseParallel)


def test_parameter_count_formula_and_meta_build():
    for kw in ({}, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)):
        model = make(**kw)
        unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        assert unique == count_t5_parameters(99, 32, 8, 48, 2, 4, num_decoder_layers=3, num_buckets=8, **{
            k: v for k, v in kw.items() if k in ("feed_forward_proj", "tie_word_embeddings")})
    with torch.device("meta"):
        model = T5ForConditionalGeneration(**KW)
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.wte.weight
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _run_stages(model, stage_ids, batch):
    """Chain the stages the pipeline builder makes, passing what each returns to the next, as torch's
    PipelineStage does: the first gets the main input, every stage gets the other inputs as keywords."""
    from dufu.parallel.pipeline import build_stage_module, split_pipeline_batch

    n = max(stage_ids) + 1
    stages = [build_stage_module(model, s, n, stage_ids) for s in range(n)]
    args, kwargs, target = split_pipeline_batch(stages[0], batch, "input_ids")
    out = args
    for stage in stages:
        out = stage(*out, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
    (logits,) = out
    return stages, logits, T5ForConditionalGeneration.pipeline_loss(logits, target)


# 2 encoder + 3 decoder blocks in one stage order; cuts inside the encoder, at its end and inside the decoder
@pytest.mark.parametrize("stage_ids", [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 1, 2, 2, 3],
                                       [0, 1, 2, 3, 4]])
def test_pipeline_stages_compute_the_whole_forward(stage_ids):
    model = make().eval()
    torch.manual_seed(1)
    ids, labels = torch.randint(2, 99, (3, 9)), torch.randint(2, 99, (3, 5))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding in the encoder input
    labels[2, 3:] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref = model(**batch)
    stages, logits, loss = _run_stages(model, stage_ids, batch)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=0)
    # each parameter has one owner, under its unsplit name (the tied head: a copy on the last stage)
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    first, last = stages[0], stages[-1]
    assert first.encoder.relative_bias is not None and last.lm_head is not None and last.wte is None
    dec0 = stage_ids[KW["num_layers"]]
    assert all((st.decoder.relative_bias is not None) == (s == dec0) for s, st in enumerate(stages))


def test_pipeline_stages_pass_gradients_to_every_parameter():
    model = make()
    batch = {"input_ids": torch.randint(2, 99, (2, 7)), "labels": torch.randint(2, 99, (2, 4))}
    stages, _, loss = _run_stages(model, [0, 0, 1, 1, 1], batch)
    loss.backward()
    model.zero_grad()
    model(**batch).loss.backward()
    ref = dict(model.named_parameters())
    for st in stages:
        for name, p in st.named_parameters():
            if name not in ("wte.weight", "lm_head.weight"):
                torch.testing.assert_close(p.grad, ref[name].grad, msg=name)
    # the tied embedding: the first stage's part plus the last stage's copy (summed by the trainer)
    torch.testing.assert_close(stages[0].wte.weight.grad + stages[1].lm_head.weight.grad, ref["wte.weight"].grad)


def test_encoder_only_t5_refuses_pipeline_parallelism_with_the_reason():
    from dufu.parallel.pipeline import build_stage_module

    encoder = T5EncoderModel(**{k: v for k, v in KW.items() if k != "num_decoder_layers"})
    with pytest.raises(LayoutError, match="not for the encoder alone"):
        build_stage_module(encoder, 0, 2, [0, 1])


def test_greedy_generate_runs_the_encoder_once():
    model = make().eval()
    out = model.generate(torch.randint(2, 99, (2, 7)), max_new_tokens=5)
    assert out.shape == (2, 6) and (out[:, 0] == model.decoder_start_token_id).all()


# ------------------------------------------------------------- transformers parity


def _hf_t5(cls_name: str, ff: str, tie: bool):
    import transformers

    cfg = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                dropout_rate=0.0, feed_forward_proj=ff, tie_word_embeddings=tie,
                                decoder_start_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # norms away from 1, so their mapping matters
        if not tie and hasattr(model, "lm_head"):
            model.config.tie_word_embeddings = False  # T5 v1.1: a head of its own
            model.lm_head.weight = torch.nn.Parameter(torch.randn(99, 32) * 32 ** -0.5)
    return model


def _outputs(model, batch, encoder_only=False):
    with torch.no_grad():
        if encoder_only:
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        labels = batch["labels"]
        kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  decoder_attention_mask=batch["decoder_attention_mask"])
        if hasattr(model, "lm_head") and model.lm_head is not None:
            out = model(**kw, labels=labels)
            return out.logits, out.loss
        start = torch.zeros_like(labels[:, :1])
        dec = torch.cat([start, labels[:, :-1]], 1).masked_fill(torch.cat([start, labels[:, :-1]], 1) < 0, 0)
        return model(**kw, decoder_input_ids=dec).last_hidden_state


@pytest.mark.parametrize("cls_name,ff,tie,ours", [
    ("T5ForConditionalGeneration", "relu", True, T5ForConditionalGeneration),
    ("T5ForConditionalGeneration", "gated-gelu", False, T5ForConditionalGeneration),
    ("T5Model", "relu", True, T5Model),
    ("T5EncoderModel", "gated-gelu", True, T5EncoderModel),
])
def test_transformers_parity_both_ways(cls_name, ff, tie, ours, batch, tmp_path):
    import transformers

    hf = _hf_t5(cls_name, ff, tie)
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf").eval()
    assert type(model) is ours
    encoder_only = cls_name == "T5EncoderModel"
    expected, got = _outputs(hf, batch, encoder_only), _outputs(model, batch, encoder_only)
    if cls_name == "T5ForConditionalGeneration":
        assert model.tie_word_embeddings == tie and model.scale_decoder_outputs == tie
        torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    # and back: dufu -> save_pretrained -> transformers
    hub.save_pretrained(model, tmp_path / "dufu")
    again = getattr(transformers, cls_name).from_pretrained(tmp_path / "dufu").eval()
    back = _outputs(again, batch, encoder_only)
    if cls_name == "T5ForConditionalGeneration":
        torch.testing.assert_close(back[0], got[0], rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(back, got, rtol=1e-4, atol=1e-4)


def test_a_head_of_its_own_unties_a_model_whose_config_says_tied(batch, tmp_path):
    """transformers 5 writes tie_word_embeddings=True for every T5; a checkpoint with a different head wins."""
    import json

    hf = _hf_t5("T5ForConditionalGeneration", "gated-gelu", tie=False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(tie_word_embeddings=True, scale_decoder_outputs=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path).eval()
    assert not model.tie_word_embeddings and model.lm_head.weight is not model.wte.weight
    torch.testing.assert_close(model.wte.weight, hf.shared.weight)
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight)
    torch.testing.assert_close(_outputs(model, batch)[0], _outputs(hf, batch)[0], rtol=1e-4, atol=1e-4)


def test_dufu_trained_weights_export_to_transformers(batch, tmp_path):
    """A dufu-initialised (not imported) model: transformers reads what dufu writes and agrees."""
    import transformers

    model = make(feed_forward_proj="gated-gelu", tie_word_embeddings=False).eval()
    hub.save_pretrained(model, tmp_path)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_outputs(hf, batch)[0], _outputs(model, batch)[0], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------- span corruption


def test_t5_pretraining_lengths():
    assert compute_lengths(512) == (568, 114)  # T5's published input/target lengths
    for n in (16, 32, 64, 128, 512):
        tokens, targets = compute_lengths(n)
        assert corrupted_lengths(tokens, 0.15, 3.0) == (n, targets)
        assert corrupted_lengths(tokens + 1, 0.15, 3.0)[0] > n


def test_noise_mask_density_and_span_lengths():
    rng = np.random.default_rng(0)
    masks = [noise_mask(568, 0.15, 3.0, rng) for _ in range(50)]
    assert all(m.sum() == round(568 * 0.15) for m in masks)
    spans = [np.diff(np.flatnonzero(np.diff(np.concatenate([[0], m, [0]]).astype(int)))) [::2] for m in masks]
    mean_len = np.mean(np.concatenate(spans))
    assert mean_len == pytest.approx(3.0, rel=0.05)
    assert not any(m[0] for m in masks)  # starts with a kept span, as T5


@pytest.fixture(scope="module")
def span_data():
    tok = build_tokenizer("byte")
    return tok, build_span_corruption_datasets("builtin", tok, inputs_length=64, seed=7)


def test_span_corruption_samples_reconstruct_the_text(span_data):
    tok, (train, valid) = span_data
    assert len(train) > 1000 and valid is not None and len(valid) > 10
    sentinels = set(train.sentinels.tolist())
    assert min(sentinels) == tok.vocab_size and max(sentinels) == tok.vocab_size + 99
    for i in (0, 5, len(train) - 1):
        s = train[i]
        assert s["input_ids"].shape == (64,) and s["labels"].shape == (train.targets_length,)
        assert s["input_ids"][-1] == s["labels"][-1] == tok.eod_id
        # put the spans back where their sentinels are: the raw tokens come out
        spans, current = {}, None
        for t in s["labels"][:-1]:
            if t in sentinels:
                current = t
                spans[t] = []
            else:
                spans[current].append(t)
        rebuilt = []
        for t in s["input_ids"][:-1]:
            rebuilt.extend(spans[t] if t in sentinels else [t])
        assert rebuilt == train.tokens[i][: train.tokens_length].tolist()
        # sentinels in order <extra_id_0>, <extra_id_1>, ...
        used = [t for t in s["input_ids"] if t in sentinels]
        assert used == train.sentinels[: len(used)].tolist()


def test_span_corruption_is_deterministic_per_index_and_seed(span_data):
    tok, (train, _) = span_data
    a, b = train[3], train[3]
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(train[3]["input_ids"], train[4]["input_ids"])
    other, _ = build_span_corruption_datasets("builtin", tok, inputs_length=64, seed=8)
    assert not np.array_equal(other[3]["input_ids"], a["input_ids"])
    assert train.seq_length == 64  # the trainer sizes runs from it


# -------------------------------------------------------------- recipes, training


def test_t5_base_has_the_published_parameter_count():
    from dufu.config import LazyConfig, instantiate, resolve_config_path

    cfg = LazyConfig.load(resolve_config_path("t5_base"))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert unique == count_t5_parameters(32128, 768, 64, 3072, 12, 12) == 222_903_552
    assert model.lm_head.weight is model.wte.weight


def test_t5_debug_trains(tmp_path):
    from dufu_testing import train

    run = train(tmp_path / "t5", ["train.train_iter=8", "train.evaluation.enabled=True",
                                  "train.evaluation.eval_period=8", "train.evaluation.eval_iter=2"],
                recipe="t5_debug")
    losses = run.losses
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1]
    assert abs(losses[1] - math.log(384)) < 1.0
    evals = [r for r in run.records if "eval_loss" in r]
    assert evals and math.isfinite(evals[-1]["eval_loss"])
