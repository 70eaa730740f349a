"""Every packaged recipe loads, round-trips through YAML and builds its model on the meta device."""

from __future__ import annotations

import pytest
import torch

from dufu.config import LazyConfig, callable_path, instantiate, list_recipes, resolve_config_path
from dufu.models.gpt import GPTModel
from dufu_testing import count_gpt_parameters

RECIPES = list_recipes()


def normalise(value):
    """Plain data for comparison: tuples -> lists, classes/functions -> their dotted import paths."""
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    if isinstance(value, type) or callable(value):
        return callable_path(value)
    return value


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_the_packaged_recipes_are_listed():
    assert {"default", "gpt_debug", "gpt2_small"} <= set(RECIPES)
    assert RECIPES == sorted(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_round_trips_through_yaml_and_builds_on_meta(recipe, tmp_path):
    cfg = LazyConfig.load(resolve_config_path(recipe))
    for namespace in ("model", "train", "optim", "dataloader", "tokenization"):
        assert namespace in cfg, f"{recipe} lacks the {namespace} namespace"

    saved = LazyConfig.save(cfg, tmp_path / "config.yaml")
    reloaded = LazyConfig.load(saved)
    assert normalise(reloaded) == normalise(cfg)
    # Saving the reloaded config gives the same file: YAML is a fixed point.
    again = LazyConfig.save(reloaded, tmp_path / "again.yaml")
    assert again.read_text() == saved.read_text()

    with torch.device("meta"):
        model = instantiate(cfg.model)
        model_from_yaml = instantiate(reloaded.model)  # `_target_` is a dotted path string here
    assert all(p.is_meta for p in model.parameters())
    assert type(model_from_yaml) is type(model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in model_from_yaml.state_dict().items()}
    assert unique_numel(model) == unique_numel(model_from_yaml) > 0
    if isinstance(model, GPTModel):  # the GPT recipes: the count follows from the shapes alone
        m = cfg.model
        assert unique_numel(model) == count_gpt_parameters(
            m.vocab_size, m.hidden_size, m.num_layers, m.max_position_embeddings, m.ffn_hidden_size,
            tied=m.tie_word_embeddings,
        )


def test_gpt2_small_has_gpt2_small_parameter_count():
    cfg = LazyConfig.load(resolve_config_path("gpt2_small"))
    with torch.device("meta"):
        model = instantiate(cfg.model)
    # GPT-2 small, vocabulary padded to 50,304, head tied to the token embedding:
    #   50304*768 (wte) + 1024*768 (wpe) + 12 * (12*768^2 + 13*768) (blocks) + 2*768 (ln_f)
    expected = 50304 * 768 + 1024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768
    assert expected == 124_475_904
    assert unique_numel(model) == expected
    assert model.lm_head.weight is model.wte.weight
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (12, 768, 12)


def test_gpt_debug_is_the_tiny_test_model():
    cfg = LazyConfig.load(resolve_config_path("gpt_debug"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.max_position_embeddings) == (2, 64, 384, 32)
    assert cfg.dataloader.train.seq_length == 32
    assert cfg.tokenization.tokenizer.kind == "byte"
    assert m.embedding_dropout == m.hidden_dropout == m.attention_dropout == 0.0


def test_saved_config_has_the_usual_file_mode(tmp_path):
    import os
    import stat

    saved = LazyConfig.save(LazyConfig.load(resolve_config_path("gpt_debug")), tmp_path / "config.yaml")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # a file created the ordinary way, under this process's umask
    assert stat.S_IMODE(os.stat(saved).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
