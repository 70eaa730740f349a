"""Structured pruning (dufu.compress.prune) and `dufu prune` (dufu.cli.prune).

The pruned model must compute exactly what the original computes with the pruned heads and neurons switched off.
The reference switches them off in a copy of the original by zeroing their columns of the output projection
(attention: every query head of a dropped key/value group; feed-forward: the down projection's column of a
dropped neuron), which removes their contribution and nothing else. Weights are drawn larger than the families'
initialisation (std 0.2) so that every head and neuron changes the logits visibly (checked), and a wrong cut
would show.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dufu_testing import FAST, count_gpt_parameters, load_config

from dufu.compress.prune import apply_plan, count_parameters, importance_scores, plan_pruning, prune_model
from dufu.compress.prune_families import mlp_projections
from dufu.errors import ConfigError, DataError, DufuError
from dufu.models.bert import (BertForMaskedLM, BertForSequenceClassification, BertModel,
                              RobertaForSequenceClassification)
from dufu.models.gpt import GPTModel
from dufu.models.llama import LlamaModel

V, C, T = 256, 64, 12


def _randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def gpt(**kw):
    torch.manual_seed(0)
    return _randomized(GPTModel(vocab_size=V, hidden_size=C, num_layers=2, num_attention_heads=4,
                                max_position_embeddings=32, **kw))


def llama(**kw):
    torch.manual_seed(0)
    args = dict(vocab_size=V, hidden_size=C, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                ffn_hidden_size=96, max_position_embeddings=32)
    return _randomized(LlamaModel(**{**args, **kw}))


def bert(cls=BertForSequenceClassification, **kw):
    torch.manual_seed(0)
    args = dict(vocab_size=V, hidden_size=C, num_layers=2, num_attention_heads=4, ffn_hidden_size=128,
                max_position_embeddings=40, hidden_dropout=0.0, attention_dropout=0.0)
    if cls in (BertForSequenceClassification, RobertaForSequenceClassification):
        args["num_labels"] = 3
    return _randomized(cls(**{**args, **kw}))


def inputs(model) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, T), generator=g)
    if isinstance(model, (GPTModel, LlamaModel)):
        return {"input_ids": ids}
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, 8:] = 0  # a padded sequence
    return {"input_ids": ids, "attention_mask": mask}


def lm_batches(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, V, (n, 2, T), generator=g)]


def outputs(model, x):
    with torch.no_grad():
        out = model(**x)
    return out.logits if out.logits is not None else out.last_hidden_state


def masked_reference(model, plan):
    """A copy of ``model`` with the output-projection columns of every pruned head and neuron zeroed."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for k, block in ref.blocks.items():
            a = block.attn
            group = a.num_heads // a.num_key_value_heads
            for g in range(a.num_key_value_heads):
                if g not in plan.heads[k]:
                    a.out_proj.weight[:, g * group * a.head_dim:(g + 1) * group * a.head_dim] = 0
            out = mlp_projections(block.mlp)[1]
            dropped = [i for i in range(out.in_features) if i not in plan.neurons[k]]
            out.weight[:, dropped] = 0
    return ref


MODELS = {
    "gpt": gpt,
    "llama-gqa": llama,
    "qwen2-tied": lambda: llama(qkv_bias=True, tie_word_embeddings=True, num_key_value_heads=4),
    "bert-classify": bert,
    "roberta-classify": lambda: bert(RobertaForSequenceClassification),
    "bert-mlm": lambda: bert(BertForMaskedLM),
    "bert-encoder": lambda: bert(BertModel),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_keeping_everything_gives_the_same_logits(name):
    model = MODELS[name]()
    x = inputs(model)
    kinds = [("magnitude", None)]
    if isinstance(model, (GPTModel, LlamaModel)):
        kinds.append(("first-order", lm_batches()))
    for importance, batches in kinds:
        small, kwargs = prune_model(model, 1.0, 1.0, importance=importance, batches=batches)
        assert type(small) is type(model)
        assert torch.equal(outputs(small, x), outputs(model, x))
        assert count_parameters(small) == count_parameters(model)


@pytest.mark.parametrize("name,heads_keep,ffn_keep,importance", [
    ("gpt", 0.75, 0.5, "magnitude"),
    ("gpt", 0.5, 0.25, "first-order"),
    ("llama-gqa", 0.5, 0.5, "magnitude"),
    ("llama-gqa", 0.5, 0.75, "first-order"),
    ("qwen2-tied", 0.5, 0.5, "magnitude"),
    ("bert-classify", 0.5, 0.5, "magnitude"),
    ("bert-classify", 0.75, 0.25, "first-order"),
    ("roberta-classify", 0.25, 0.5, "magnitude"),
    ("bert-mlm", 0.5, 0.5, "magnitude"),
])
def test_pruned_model_equals_the_original_with_the_pruned_units_masked(name, heads_keep, ffn_keep, importance):
    model = MODELS[name]()
    x = inputs(model)
    batches = None
    if importance == "first-order":
        if isinstance(model, BertForSequenceClassification):
            batches = [{**x, "labels": torch.tensor([0, 2, 1])}]
        else:
            batches = lm_batches()
    plan = plan_pruning(model, heads_keep, ffn_keep, importance, batches)
    small, kwargs = apply_plan(model, plan)
    expected = outputs(masked_reference(model, plan), x)
    got = outputs(small, x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the cut units mattered: switching them off moved the outputs
    assert (outputs(model, x) - expected).abs().max() > 1e-2
    # prune_model is plan_pruning + apply_plan
    again, _ = prune_model(model, heads_keep, ffn_keep, importance, batches)
    assert torch.equal(outputs(again, x), got)
    # the constructor kwargs rebuild it: same shapes, the weights load strictly, same outputs
    rebuilt = type(model)(**kwargs).eval()
    rebuilt.load_state_dict(small.state_dict(), strict=True)
    assert torch.equal(outputs(rebuilt, x), got)


def test_gpt_sizes_and_predicted_parameter_count():
    model = gpt()
    small, kwargs = prune_model(model, heads_keep=0.75, ffn_keep=0.5)
    assert (kwargs["num_attention_heads"], kwargs["head_dim"], kwargs["ffn_hidden_size"]) == (3, 16, 128)
    assert small.blocks["0"].attn.q_proj.weight.shape == (48, 64)
    assert small.blocks["1"].mlp.fc2.weight.shape == (64, 128)
    nh, hs, f = 3, 16, 128
    per_layer = 2 * C + 3 * (C * nh * hs + nh * hs) + (nh * hs * C + C) + 2 * C + (C * f + f) + (f * C + C)
    assert count_parameters(small) == V * C + 32 * C + 2 * per_layer + 2 * C == 77_216
    assert count_parameters(model) == count_gpt_parameters(V, C, 2, 32) == 118_528


def test_llama_gqa_prunes_whole_key_value_groups():
    model = llama()
    small, kwargs = prune_model(model, heads_keep=0.5, ffn_keep=0.5)
    # 4 query heads over 2 key/value heads: keeping half keeps one group, i.e. 2 query heads and 1 key/value head
    assert (kwargs["num_attention_heads"], kwargs["num_key_value_heads"], kwargs["head_dim"],
            kwargs["ffn_hidden_size"]) == (2, 1, 16, 48)
    nh, nkv, hs, f = 2, 1, 16, 48
    per_layer = C + C * nh * hs + 2 * C * nkv * hs + nh * hs * C + C + 3 * C * f
    assert count_parameters(small) == V * C + 2 * per_layer + C + V * C == 63_808


def test_bert_parameter_count_drops_by_the_removed_rows_and_columns():
    model = bert()
    small, kwargs = prune_model(model, heads_keep=0.25, ffn_keep=0.5)
    assert (kwargs["num_attention_heads"], kwargs["head_dim"], kwargs["ffn_hidden_size"],
            kwargs["num_labels"]) == (1, 16, 64, 3)
    heads_removed, hs, neurons_removed = 3, 16, 64
    removed = 2 * (heads_removed * (3 * (C * hs + hs) + hs * C) + neurons_removed * (C + 1 + C))
    assert count_parameters(small) == count_parameters(model) - removed


def test_magnitude_scores_are_the_norms_of_each_units_weights():
    model = llama()
    heads, neurons = importance_scores(model, "magnitude")
    a, m = model.blocks["1"].attn, model.blocks["1"].mlp
    # key/value group 1 = query heads 2 and 3 (rows 32..63) with key/value head 1 (rows 16..31)
    by_hand = torch.cat([a.q_proj.weight[32:64].flatten(), a.k_proj.weight[16:32].flatten(),
                         a.v_proj.weight[16:32].flatten(), a.out_proj.weight[:, 32:64].flatten()]).norm()
    torch.testing.assert_close(heads["1"][1], by_hand)
    by_hand = torch.cat([m.gate_proj.weight[7], m.up_proj.weight[7], m.down_proj.weight[:, 7]]).norm()
    torch.testing.assert_close(neurons["1"][7], by_hand)


def test_first_order_scores_are_weight_times_accumulated_gradient():
    model = gpt()
    batches = lm_batches(3)
    heads, neurons = importance_scores(model, "first-order", batches)
    for p in model.parameters():  # importance left no gradients behind
        assert p.grad is None
    ref = copy.deepcopy(model)
    for b in batches:
        ref(**b).loss.backward()
    a, m = ref.blocks["0"].attn, ref.blocks["0"].mlp
    rows = slice(16, 32)  # head 1
    by_hand = sum((w.weight * w.weight.grad)[rows].sum() for w in (a.q_proj, a.k_proj, a.v_proj))
    by_hand = (by_hand + (a.out_proj.weight * a.out_proj.weight.grad)[:, rows].sum()).abs()
    torch.testing.assert_close(heads["0"][1], by_hand.detach(), rtol=1e-4, atol=1e-7)
    by_hand = ((m.fc1.weight * m.fc1.weight.grad)[5].sum() + (m.fc2.weight * m.fc2.weight.grad)[:, 5].sum()).abs()
    torch.testing.assert_close(neurons["0"][5], by_hand.detach(), rtol=1e-4, atol=1e-7)


def test_pruning_leaves_the_original_model_alone():
    model = gpt()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small, _ = prune_model(model, 0.5, 0.5, importance="first-order", batches=lm_batches())
    assert model.training and small.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in small.parameters())
    assert small.lm_head.weight is small.wte.weight  # the tied head is still tied


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), "0.5", True, None])
def test_a_fraction_outside_zero_one_is_refused(value):
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        prune_model(gpt(), heads_keep=value, ffn_keep=1.0)
    with pytest.raises(ConfigError, match=r"ffn_keep=.*\(0, 1\]"):
        prune_model(gpt(), heads_keep=1.0, ffn_keep=value)


def test_a_fraction_that_keeps_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"heads_keep=0.2 keeps none of the 4 heads .*heads_keep >= 0.25"):
        prune_model(gpt(), heads_keep=0.2)
    with pytest.raises(ConfigError, match=r"keeps none of the 2 key/value groups"):
        prune_model(llama(), heads_keep=0.4)
    with pytest.raises(ConfigError, match=r"ffn_keep=0.001 keeps none of the 256 feed-forward neurons"):
        prune_model(gpt(), ffn_keep=0.001)


def test_first_order_needs_batches_with_labels():
    with pytest.raises(ConfigError, match='needs batches'):
        prune_model(gpt(), 0.5, 0.5, importance="first-order")
    with pytest.raises(ConfigError, match="non-empty list of dicts"):
        prune_model(gpt(), 0.5, 0.5, importance="first-order", batches=[])
    with pytest.raises(ConfigError, match="batch 0 gave no loss"):
        prune_model(gpt(), 0.5, 0.5, importance="first-order", batches=[{"input_ids": torch.zeros(1, 4).long()}])
    with pytest.raises(ConfigError, match="importance='taylor'"):
        prune_model(gpt(), 0.5, 0.5, importance="taylor")


def test_other_families_and_deltas_are_refused():
    from dufu.delta import LoRA, apply_delta
    from dufu.models.vit.model import ViTForImageClassification

    vit = ViTForImageClassification(image_size=8, patch_size=4, num_channels=1, num_labels=2, hidden_size=32,
                                    num_layers=1, num_attention_heads=2)
    with pytest.raises(DufuError, match=r"supports GPT .*LLaMA .*BERT .*got ViTForImageClassification"):
        prune_model(vit, 0.5, 0.5)
    model = gpt()
    apply_delta(model, LoRA(targets=["q_proj"], rank=2, alpha=4))
    with pytest.raises(DufuError, match="carries a delta"):
        prune_model(model, 0.5, 0.5)
    with torch.device("meta"):
        meta = GPTModel(vocab_size=V, hidden_size=C, num_layers=1, num_attention_heads=4)
    with pytest.raises(DufuError, match="meta device"):
        prune_model(meta, 0.5, 0.5)


# ---------------------------------------------------------------------------------------------------- dufu prune
def test_prune_run_writes_a_model_directory_dufu_loads(train_run, tmp_path, capsys):
    from dufu.config import LazyConfig
    from dufu.cli.generate import load_for_generation
    from dufu.engine.weights.pretrained import pretrained_model
    from dufu.cli.prune import load_source, main, prune_run, validation_batches

    run = train_run("train.train_iter=2")
    out = prune_run(run.output_dir, tmp_path / "pruned", heads_keep=0.5, ffn_keep=0.75, importance="first-order",
                    num_batches=2, batch_size=4)
    # the same pruning in this process: the run's model, its first 2 x 4 validation samples
    model, cfg, tokenizer_file, _ = load_source(run.output_dir)
    batches = validation_batches(cfg, tokenizer_file, 2, 4)
    assert [b["input_ids"].shape for b in batches] == [(4, 32), (4, 32)] and "shift_labels" in batches[0]
    expected, kwargs = prune_model(model.eval(), 0.5, 0.75, "first-order", batches)
    loaded = pretrained_model(out).eval()
    assert (loaded.num_attention_heads, loaded.head_dim, loaded.blocks["0"].mlp.fc1.out_features) == (2, 16, 192)
    x = {"input_ids": batches[0]["input_ids"]}
    assert torch.equal(outputs(loaded, x), outputs(expected, x))
    generating, tokenizer, _ = load_for_generation(out)
    assert torch.equal(outputs(generating, x), outputs(expected, x)) and tokenizer.vocab_size == 257

    record = json.loads((out / "prune.json").read_text())
    assert record["before"] == {"num_attention_heads": 4, "head_dim": 16, "ffn_hidden_size": 256,
                                "parameters": count_parameters(model)}
    assert record["after"] == {"num_attention_heads": 2, "head_dim": 16, "ffn_hidden_size": 192,
                               "parameters": count_parameters(expected)}
    assert len(record["kept_heads"]["1"]) == 2 and len(record["kept_neurons"]["0"]) == 192
    top = LazyConfig.load(str(out / "config.yaml"))
    assert top.model.path == str(out) and top.train.output_dir == f"{out}-finetune"
    assert top.dataloader.train.seq_length == 32  # the run's data settings, for fine-tuning

    assert main([str(out), str(tmp_path / "again"), "--heads-keep", "0.5", "--ffn-keep", "0.5"]) == 0
    assert "heads 2 -> 1, ffn 192 -> 96" in capsys.readouterr().out
    with pytest.raises(DufuError, match="already holds"):
        prune_run(run.output_dir, out, 0.5, 0.5)


def test_prune_run_from_a_hugging_face_directory_and_fine_tuning_from_it(tmp_path):
    import dufu
    from dufu.config import LazyConfig
    from dufu.engine.weights.pretrained import pretrained_model
    from dufu.cli.prune import prune_run
    from dufu.engine.trainer import Trainer

    model = llama(vocab_size=384)  # llama_debug's size: the byte tokenizer's 257 tokens fit
    dufu.save_pretrained(model, tmp_path / "hf")
    with pytest.raises(DataError, match="first-order importance needs data"):
        prune_run(tmp_path / "hf", tmp_path / "fo", 0.5, 0.5, importance="first-order")
    out = prune_run(tmp_path / "hf", tmp_path / "pruned", heads_keep=0.5, ffn_keep=0.5)
    expected, kwargs = prune_model(dufu.from_pretrained(tmp_path / "hf").eval(), 0.5, 0.5)
    x = inputs(model)
    assert torch.equal(outputs(pretrained_model(out).eval(), x), outputs(expected, x))
    # LLaMA's config has head_dim, so `dufu convert` writes the pruned model for transformers, same logits
    import transformers

    from dufu.engine.weights.convert import to_hf

    to_hf(out, tmp_path / "pruned-hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned-hf").eval()
    assert theirs.config.num_attention_heads == 2 and theirs.config.num_key_value_heads == 1
    with torch.no_grad():
        torch.testing.assert_close(theirs(**x).logits, outputs(expected, x), rtol=1e-5, atol=1e-5)
    # a fine-tuning run of llama_debug whose model is the pruned directory starts from the pruned weights
    cfg = load_config("llama_debug", [*FAST, "train.train_iter=1", "train.compile.enabled=False"])
    cfg.model = LazyConfig.load(str(out / "config.yaml")).model
    LazyConfig.apply_overrides(cfg, [f"train.output_dir={tmp_path / 'ft'}"])
    trainer = Trainer(cfg, log=lambda *a: None)
    state = trainer.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.state_dict().items())
    assert trainer.runtime.num_parameters == count_parameters(expected)
