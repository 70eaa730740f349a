"""HFAutoModel: any transformers architecture behind dufu's model contract, trained as-is."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dufu.errors import ConfigError, LayoutError  # noqa: E402
from dufu.models.hf_auto import HFAutoModel  # noqa: E402
from dufu.parallel import transformer_blocks  # noqa: E402

NEOX = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=32, tie_word_embeddings=False)
SMALL = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=32)


def tokens(B=2, T=17, seed=0):
    return torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shift_labels_loss_equals_transformers_labels_loss():
    torch.manual_seed(0)
    model = HFAutoModel(model_type="gpt_neox", config=NEOX)
    x = tokens()
    ours = model(input_ids=x[:, :-1], shift_labels=x[:, 1:])  # dufu's LM batch: no token wasted
    theirs = model.hf(input_ids=x, labels=x)  # transformers shifts inside
    torch.testing.assert_close(ours.loss, theirs.loss)
    assert ours.logits.shape == (2, 16, 384)
    passed = model(input_ids=x, labels=x)  # transformers' own labels go to the model
    torch.testing.assert_close(passed.loss, theirs.loss)
    ours.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_sizes_and_blocks_are_exposed():
    model = HFAutoModel(model_type="gpt_neox", config=NEOX)
    assert (model.vocab_size, model.hidden_size, model.num_layers, model.max_position_embeddings) == (384, 64, 2, 32)
    # transformers' layers carry no layer_idx; the wrapper marks them so FSDP/checkpointing/compile find blocks
    names = [n for n, _ in transformer_blocks(model)]
    assert names == ["hf.gpt_neox.layers.0", "hf.gpt_neox.layers.1"]
    assert model.hf.config.use_cache is False


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("mistral", {"num_key_value_heads": 2}),
                                               ("qwen2", {"num_key_value_heads": 2}), ("phi", {})])
def test_other_decoder_architectures_train(model_type, extra):
    torch.manual_seed(0)
    model = HFAutoModel(model_type=model_type, config={**SMALL, **extra})
    x = tokens()
    out = model(input_ids=x[:, :-1], shift_labels=x[:, 1:])
    out.loss.backward()
    assert torch.isfinite(out.loss) and len(transformer_blocks(model)) == 2


def test_an_encoder_with_its_own_labels():
    model = HFAutoModel(model_type="bert", auto_class="AutoModelForMaskedLM",
                        config=dict(SMALL, max_position_embeddings=64))
    x = tokens(T=10)
    labels = torch.full_like(x, -100)
    labels[:, 3] = x[:, 3]
    out = model(input_ids=x, attention_mask=torch.ones_like(x), labels=labels)
    assert torch.isfinite(out.loss) and out.logits.shape == (2, 10, 384)
    assert len(transformer_blocks(model)) == 2


def test_from_a_local_directory_with_and_without_weights(tmp_path):
    from dufu.engine.weights.pretrained import load_pretrained

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("gpt_neox", **NEOX))
    hf.save_pretrained(tmp_path)
    loaded = HFAutoModel(path=str(tmp_path))  # built from config.json; the weights are a separate step
    assert loaded.pretrained_path == str(tmp_path)
    load_pretrained(loaded)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, hf.eval()(input_ids=x).logits)
    torch.manual_seed(1)
    fresh = HFAutoModel(path=str(tmp_path), load_weights=False, config={"hidden_dropout": 0.0})
    assert fresh.hf.config.num_hidden_layers == 2 and fresh.pretrained_path is None
    assert not torch.equal(fresh.hf.gpt_neox.embed_in.weight, hf.gpt_neox.embed_in.weight)


def test_building_reads_no_weights_and_loading_checks_them(tmp_path):
    from dufu.engine.weights.pretrained import load_pretrained
    from dufu.errors import DataError

    transformers.AutoConfig.for_model("gpt_neox", **NEOX).save_pretrained(tmp_path)  # config.json, no weights
    model = HFAutoModel(path=str(tmp_path))
    assert model.pretrained_path == str(tmp_path) and model.num_layers == 2
    with pytest.raises(DataError, match="holds no weights"):
        load_pretrained(model)
    other = tmp_path / "wider"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("gpt_neox", **dict(NEOX, hidden_size=128))).save_pretrained(other)
    with pytest.raises(DataError, match=r"hidden_size=64 \(pretrained: 128\)"):
        load_pretrained(model, other)


def test_tied_weights_a_base_model_checkpoint_and_export(tmp_path):
    from dufu.engine.weights.pretrained import load_pretrained
    from dufu.models.hub import save_pretrained

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **SMALL, tie_word_embeddings=True)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path / "lm")  # the tied head is not stored
    hf.model.save_pretrained(tmp_path / "base")  # the bare model: names without "model."
    x = tokens()
    for source in ("lm", "base"):
        model = load_pretrained(HFAutoModel(path=str(tmp_path / source)))
        assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
        with torch.no_grad():
            torch.testing.assert_close(model.hf.model(input_ids=x).last_hidden_state,
                                       hf.eval().model(input_ids=x).last_hidden_state)
    save_pretrained(model, tmp_path / "out")  # dufu's export writes transformers' own layout
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, hf(input_ids=x).logits)


def test_the_trainer_loads_the_recorded_weights_after_its_build(tmp_path):
    from dufu.engine.trainer import Trainer
    from dufu_testing import FAST, load_config

    pretrained = tmp_path / "pretrained"
    cfg = load_config("hf_auto_gpt_neox_debug", [*FAST, f"model.path={pretrained}", f"train.output_dir={tmp_path}/run"])
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("gpt_neox", **dict(cfg.model.config))
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(pretrained)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    theirs = hf.state_dict()
    for name, tensor in trainer.model.hf.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], msg=name)


def test_meta_build_and_clear_errors():
    with torch.device("meta"):
        model = HFAutoModel(model_type="gpt_neox", config=NEOX)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ConfigError, match="model_type"):
        HFAutoModel()
    with pytest.raises(ConfigError, match="not a transformers Auto class"):
        HFAutoModel(model_type="gpt_neox", config=NEOX, auto_class="GPTNeoXLayer")
    with pytest.raises(ConfigError, match="no config.json"):
        HFAutoModel(path="/nonexistent")


def test_pipeline_parallelism_asks_for_dufu_layers():
    from dufu.parallel.pipeline import build_stage_module

    model = HFAutoModel(model_type="gpt_neox", config=NEOX)
    with pytest.raises(LayoutError, match="pipeline_layout"):
        build_stage_module(model, 0, 2, [0, 1])


def test_recipe_trains_with_and_without_activation_checkpointing(tmp_path):
    from dufu_testing import train

    plain = train(tmp_path / "plain", ["train.train_iter=6"], recipe="hf_auto_gpt_neox_debug")
    ckpt = train(tmp_path / "ac", ["train.train_iter=6", "train.activation_checkpoint.enabled=True"],
                 recipe="hf_auto_gpt_neox_debug")
    a, b = plain.losses, ckpt.losses
    assert a[6] < a[1] - 0.2
    for step in a:  # recomputation changes memory, not numbers
        assert b[step] == pytest.approx(a[step], rel=1e-6)
    assert plain.trainer.runtime.model_name == "HFAutoModel"
