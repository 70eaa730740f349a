"""PEFT interchange: a PEFT LoRA adapter loads onto the dufu model with PEFT's logits, a dufu model with LoRA
is written as an adapter PEFT loads with the same logits (or merged, for transformers alone), dufu and
transformers + PEFT train to the same losses from the same adapter, a delta run converts to an adapter, and
bad adapters fail with messages that say what is wrong.

Tiny random transformers models are built from a config and saved; PEFT makes the adapters.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

import dufu
from dufu.delta import LoRA, PrefixTuning, apply_delta, lora_layers
from dufu.errors import DataError, DufuError

# PEFT's notes on Conv1D's fan_in_fan_out and transformers' deprecations are not what these tests look at
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:peft"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

SMALL = dict(vocab_size=96, num_attention_heads=4)
# family: (transformers class, config, PEFT target_modules, PEFT task type)
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64,
        **SMALL), ["q_proj", "v_proj", "o_proj", "gate_proj"], "CAUSAL_LM"),
    "qwen2": (transformers.Qwen2ForCausalLM, lambda: transformers.Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, **SMALL), ["q_proj", "k_proj", "up_proj"], "CAUSAL_LM"),
    # c_attn: transformers fuses q | k | v (dufu's three layers share A); c_proj: both attn.c_proj and mlp.c_proj
    "gpt2": (transformers.GPT2LMHeadModel, lambda: transformers.GPT2Config(
        n_embd=32, n_layer=2, n_positions=64, n_head=4, vocab_size=96, bos_token_id=0, eos_token_id=0),
        ["c_attn", "c_proj", "c_fc"], "CAUSAL_LM"),
    # SEQ_CLS: PEFT also keeps the classifier whole (modules_to_save)
    "bert": (transformers.BertForSequenceClassification, lambda: transformers.BertConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64, num_labels=3,
        **SMALL), ["query", "value", "dense"], "SEQ_CLS"),
    "roberta": (transformers.RobertaForMaskedLM, lambda: transformers.RobertaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=70, type_vocab_size=1,
        pad_token_id=1, **SMALL), ["query", "key", "intermediate.dense"], None),
    "t5": (transformers.T5ForConditionalGeneration, lambda: transformers.T5Config(
        d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=96,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0),
        ["q", "v", "wi", "wo"], "SEQ_2_SEQ_LM"),
}


def make_base(family: str, path):
    """A random transformers model of ``family`` saved at ``path`` (every tensor perturbed, so none is zero)."""
    cls, config, *_ = FAMILIES[family]
    torch.manual_seed(0)
    hf = cls(config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(path)
    return path


def load_base(family: str, path):
    return FAMILIES[family][0].from_pretrained(path).eval()


def inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    if family == "t5":
        return dict(input_ids=ids, decoder_input_ids=torch.randint(3, 96, (2, 7), generator=g))
    if family in ("bert", "roberta"):
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    return dict(input_ids=ids)


@torch.no_grad()
def logits(model, family: str) -> torch.Tensor:
    return model.eval()(**inputs(family)).logits


def peft_adapter(family: str, base, path, **options):
    """A PEFT adapter on ``family``'s base with random (non-zero) factors, saved at ``path``; its logits."""
    _, _, targets, task = FAMILIES[family]
    torch.manual_seed(2)
    config = dict(r=4, lora_alpha=8, target_modules=targets, task_type=task, init_lora_weights=False)
    model = peft.get_peft_model(load_base(family, base), peft.LoraConfig(**{**config, **options}))
    model.save_pretrained(path)
    return logits(model, family)


def close(a, b, tol=1e-5):
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), (a - b).abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_go_both_ways_with_pefts_logits(family, tmp_path):
    base = make_base(family, tmp_path / "base")
    expected = peft_adapter(family, base, tmp_path / "peft")
    plain = logits(load_base(family, base), family)
    assert (expected - plain).abs().max() > 1e-3  # the adapter matters

    model = dufu.from_pretrained(base, adapter=tmp_path / "peft")
    layers = lora_layers(model)
    assert layers and all(m.lora_rank == 4 and m.lora_scaling == 2.0 and not m.lora_merged for m in layers.values())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(model.delta_info.trainable)
    close(logits(model, family), expected)

    # back to PEFT: the same file keys as PEFT's own, the same logits on transformers' base
    dufu.save_pretrained(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == FAMILIES[family][3]
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8, False)
    assert config["base_model_name_or_path"] == str(base.resolve())
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=0)
    again = peft.PeftModel.from_pretrained(load_base(family, base), tmp_path / "ours")
    close(logits(again, family), expected)

    # merged: a plain transformers directory
    dufu.save_pretrained(model, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    close(logits(load_base(family, tmp_path / "merged"), family), expected, 1e-4)


def test_a_dufu_adapter_loads_in_peft_with_rank_and_alpha_patterns_dora_and_rslora(tmp_path):
    base = make_base("llama", tmp_path / "base")
    model = dufu.from_pretrained(base)
    apply_delta(model, [LoRA(targets=["q_proj", "v_proj"], rank=4, alpha=8, dora=True),
                        LoRA(targets=["down_proj"], rank=2, alpha=3, dora=True)])
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(std=0.1)
            m.lora_magnitude_vector.weight.mul_(1.1)
    dufu.save_pretrained(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"] and config["use_dora"]
    assert config["rank_pattern"] == {"down_proj": 2} and config["alpha_pattern"] == {"down_proj": 3}
    theirs = peft.PeftModel.from_pretrained(load_base("llama", base), tmp_path / "ours")
    close(logits(theirs, "llama"), logits(model, "llama"))
    dufu.save_pretrained(model, tmp_path / "merged", merge=True)  # DoRA merged: each row rescaled
    close(logits(load_base("llama", tmp_path / "merged"), "llama"), logits(model, "llama"), 1e-4)

    # PEFT's own rsLoRA + rank_pattern + DoRA adapter loads back with its logits
    expected = peft_adapter("llama", base, tmp_path / "peft", use_rslora=True, use_dora=True,
                            rank_pattern={"gate_proj": 2}, alpha_pattern={"o_proj": 5})
    back = dufu.from_pretrained(base, adapter=tmp_path / "peft")
    gate, o_proj = back.get_submodule("blocks.1.mlp.gate_proj"), back.get_submodule("blocks.0.attn.out_proj")
    assert gate.lora_rank == 2 and gate.lora_scaling == pytest.approx(8 / 2 ** 0.5)
    assert o_proj.lora_scaling == pytest.approx(5 / 2)
    close(logits(back, "llama"), expected)

    # PEFT's selection rules: all linear layers but the head, except k_proj; some layers only
    expected = peft_adapter("llama", base, tmp_path / "all", target_modules="all-linear", exclude_modules=["k_proj"])
    some = dufu.from_pretrained(base, adapter=tmp_path / "all")
    linear = ("attn.out_proj", "attn.q_proj", "attn.v_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")
    assert sorted(lora_layers(some)) == [f"blocks.{i}.{m}" for i in (0, 1) for m in linear]
    close(logits(some, "llama"), expected)
    expected = peft_adapter("llama", base, tmp_path / "some", target_modules=["q_proj", "down_proj"],
                            layers_to_transform=[1])
    some = dufu.from_pretrained(base, adapter=tmp_path / "some")
    assert sorted(lora_layers(some)) == ["blocks.1.attn.q_proj", "blocks.1.mlp.down_proj"]
    close(logits(some, "llama"), expected)


def adamw_losses(model, batches, lr=1e-2) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    model.train()
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ten_adamw_steps_give_transformers_and_peft_losses(tmp_path):
    """The same base, PEFT's initial adapter (A Kaiming-uniform, B zero) and the same batches: dufu and
    transformers + PEFT train to the same losses, and the adapters they end with agree."""
    base = make_base("llama", tmp_path / "base")
    torch.manual_seed(3)
    theirs = peft.get_peft_model(load_base("llama", base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0,
        task_type="CAUSAL_LM"))
    theirs.save_pretrained(tmp_path / "initial")
    ours = dufu.from_pretrained(base, adapter=tmp_path / "initial")
    g = torch.Generator().manual_seed(4)
    data = [torch.randint(0, 96, (4, 24), generator=g) for _ in range(2)]
    batches = [data[i % 2] for i in range(10)]  # seen again: the loss falls
    expected = adamw_losses(theirs, batches)
    got = adamw_losses(ours, batches)
    print("\nstep  transformers+PEFT  dufu  rel.diff")
    for i, (e, o) in enumerate(zip(expected, got)):
        print(f"{i + 1:4d}  {e:.7f}  {o:.7f}  {abs(o - e) / e:.1e}")
    assert expected[-1] < expected[0] - 0.05  # it trains
    assert got == pytest.approx(expected, rel=1e-5)
    theirs.save_pretrained(tmp_path / "peft_final")
    dufu.save_pretrained(ours, tmp_path / "dufu_final")
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("peft_final", "dufu_final"))
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------- errors
def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_bad_adapters_say_what_is_wrong(tmp_path):
    base = make_base("llama", tmp_path / "base")
    peft_adapter("llama", base, tmp_path / "peft")
    # an adapter of another base: a wider model
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=48, num_hidden_layers=2, num_key_value_heads=2, **SMALL))
    peft.get_peft_model(wide, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "wide")
    with pytest.raises(DataError, match=r"model.layers.0.self_attn.q_proj's LoRA A has shape \(4, 48\) in the "
                                        r"adapter but \(4, 32\) in the model"):
        dufu.from_pretrained(base, adapter=tmp_path / "wide")
    # another PEFT type
    peft.get_peft_model(load_base("llama", base), peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[])
                        ).save_pretrained(tmp_path / "ia3")
    with pytest.raises(DataError, match=r"PEFT 'IA3' adapter; dufu loads LORA adapters only"):
        dufu.from_pretrained(base, adapter=tmp_path / "ia3")
    # LoRA options dufu does not compute
    edit_config(tmp_path / "peft", lora_bias=True, bias="all")
    with pytest.raises(DataError, match=r"lora_bias.*bias='all'.*Supported: r, lora_alpha"):
        dufu.from_pretrained(base, adapter=tmp_path / "peft")
    # target modules that match nothing (a key the model lacks is named too)
    edit_config(tmp_path / "peft", lora_bias=False, bias="none", target_modules=["query_key_value"])
    with pytest.raises(DataError, match=r"target_modules \['query_key_value'\] match no module of LlamaModel; .*"
                                        r"q_proj"):
        dufu.from_pretrained(base, adapter=tmp_path / "peft")
    edit_config(tmp_path / "peft", target_modules=["q_proj"])
    with pytest.raises(DataError, match="not a PEFT adapter directory"):
        dufu.from_pretrained(base, adapter=tmp_path)


def test_what_peft_cannot_hold_is_refused_with_what_maps(tmp_path):
    base = make_base("gpt2", tmp_path / "base")
    model = dufu.from_pretrained(base)
    apply_delta(model, LoRA(targets=["q_proj"], rank=2))
    with pytest.raises(DufuError, match=r"transformer.h.0.attn.c_attn.*only blocks.0.attn.q_proj carry LoRA.*"
                                        r"block-structured B"):
        dufu.save_pretrained(model, tmp_path / "out")
    dufu.save_pretrained(model, tmp_path / "merged", merge=True)  # merged, it is a plain GPT-2
    torch.testing.assert_close(logits(load_base("gpt2", tmp_path / "merged"), "gpt2"), logits(model, "gpt2"))

    model = dufu.from_pretrained(base)
    apply_delta(model, LoRA(targets=["q_proj", "k_proj", "v_proj"], rank=2))  # each its own A
    with pytest.raises(DufuError, match="A factors differ"):
        dufu.save_pretrained(model, tmp_path / "out")

    model = dufu.from_pretrained(make_base("llama", tmp_path / "llama"))
    apply_delta(model, [LoRA(targets=["q_proj"]), PrefixTuning(num_virtual_tokens=2)])
    with pytest.raises(DufuError, match="prefix tuning"):
        dufu.save_pretrained(model, tmp_path / "out")


# ---------------------------------------------------------------------------------------------- dufu convert
def test_a_delta_run_converts_to_a_peft_adapter_naming_its_base(tmp_path):
    """`dufu convert RUN --to-hf DIR` of a LoRA run: a seeded base is written beside the adapter (DIR/base)
    and named; a Hugging Face base the run started from is named as it is; --merge gives the merged model."""
    from dufu_testing import load_config, train

    from dufu.cli import main
    from dufu.config import instantiate
    from dufu.engine.delta_run import load_delta_run
    from dufu.engine.weights.convert import resolve_checkpoint

    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(5))
    short = ["train.train_iter=2", "train.checkpointer.period=2", "optim.lr=0.01"]

    def run_logits(out):
        with torch.no_grad():
            return load_delta_run(resolve_checkpoint(out)).eval()(input_ids=ids).logits

    seeded = train(tmp_path / "seeded", short, recipe="llama_lora_debug").output_dir
    assert main(["convert", str(seeded), "--to-hf", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "a" / "base").resolve())
    assert config["target_modules"] == ["q_proj", "v_proj"] and (config["r"], config["lora_alpha"]) == (4, 8)
    expected = run_logits(seeded)
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "a")  # finds the base by that name
    close(logits_of(theirs, ids), expected)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "base")
    assert (logits_of(plain, ids) - expected).abs().max() > 1e-4  # the adapter matters
    assert main(["convert", str(seeded), "--to-hf", str(tmp_path / "merged"), "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    close(logits_of(merged, ids), expected, 1e-4)

    # a run from a Hugging Face directory: the adapter names it, nothing is copied
    torch.manual_seed(0)
    hf_base = dufu.save_pretrained(instantiate(load_config("llama_debug").model), tmp_path / "hf_base")
    started = train(tmp_path / "started", [*short, f"model.pretrained={hf_base}"], recipe="llama_lora_debug").output_dir
    assert main(["convert", str(started), "--to-hf", str(tmp_path / "b")]) == 0
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_base.resolve()) and not (tmp_path / "b" / "base").exists()
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_base), tmp_path / "b")
    close(logits_of(theirs, ids), run_logits(started))


@torch.no_grad()
def logits_of(model, ids):
    return model.eval()(input_ids=ids).logits
