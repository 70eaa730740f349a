"""The declarative Hugging Face config map: for every family, export then import gives back the constructor
arguments; values with no counterpart are clear errors."""

from __future__ import annotations

import pytest
import torch

from dufu.errors import DufuError
from dufu.models.bert import model as bert
from dufu.models.gpt.model import GPTModel
from dufu.models.hf_adapter import ConfigField, HFConfigMap, UnsupportedHFValue
from dufu.models.hub import adapter_for_model, adapters
from dufu.models.llama.model import LlamaModel
from dufu.models.swin.model import SwinForImageClassification
from dufu.models.t5.model import T5EncoderModel, T5ForConditionalGeneration, T5Model
from dufu.models.vit.model import ViTForImageClassification

# Non-default values wherever the export writes them, so a dropped or swapped row shows.
CASES = {
    "gpt": (GPTModel, dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                           max_position_embeddings=24, embedding_dropout=0.05, layernorm_epsilon=1e-6,
                           activation="relu", tie_word_embeddings=False, initializer_range=0.03)),
    "llama": (LlamaModel, dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, ffn_hidden_size=48, max_position_embeddings=64,
                               rms_norm_eps=1e-5, rope_theta=5e5, qkv_bias=True, out_bias=True, mlp_bias=True,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                               attention_dropout=0.1, tie_word_embeddings=True, initializer_range=0.03)),
    "qwen2": (LlamaModel, dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, ffn_hidden_size=48, qkv_bias=True,
                               rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "bert": (bert.BertForSequenceClassification,
             dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                  max_position_embeddings=40, type_vocab_size=3, hidden_dropout=0.05, attention_dropout=0.07,
                  layernorm_epsilon=1e-6, activation="gelu_tanh", pad_token_id=1, initializer_range=0.03,
                  num_labels=5)),
    "roberta": (bert.RobertaForMaskedLM, dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                                              ffn_hidden_size=48, max_position_embeddings=40, pad_token_id=1,
                                              tie_word_embeddings=False)),
    "t5": (T5ForConditionalGeneration, dict(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                            num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                                            relative_attention_num_buckets=16, relative_attention_max_distance=64,
                                            dropout_rate=0.05, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                                            scale_decoder_outputs=True, pad_token_id=1, decoder_start_token_id=2,
                                            initializer_factor=0.5)),
    "t5-model": (T5Model, dict(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4)),
    "t5-encoder": (T5EncoderModel, dict(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                        dropout_rate=0.0)),
    "vit": (ViTForImageClassification, dict(image_size=(16, 24), patch_size=4, num_channels=1, num_labels=7,
                                            hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                                            hidden_dropout=0.05, attention_dropout=0.07, layer_norm_eps=1e-6,
                                            qkv_bias=False, activation="gelu_tanh", initializer_range=0.03)),
    "swin": (SwinForImageClassification, dict(image_size=32, patch_size=4, num_channels=3, num_labels=4,
                                              embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4,
                                              mlp_ratio=2.0, qkv_bias=False, hidden_dropout=0.05,
                                              attention_dropout=0.07, drop_path_rate=0.2, activation="relu",
                                              use_absolute_embeddings=True, layer_norm_eps=1e-6,
                                              initializer_range=0.03)),
}


def as_constructed(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_then_import_gives_the_constructor_arguments(case):
    cls, kwargs = CASES[case]
    with torch.device("meta"):
        model = cls(**kwargs)
    adapter = adapter_for_model(model)
    hf = adapter.config_to_hf(model)
    assert hf["torch_dtype"] == "float32" and hf["architectures"]
    back = adapters()[hf["model_type"]].config_from_hf(hf)
    assert {k: back[k] for k in kwargs} == {k: as_constructed(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("model_type, key", [("gpt2", "activation_function"), ("bert", "hidden_act"),
                                             ("vit", "hidden_act"), ("swin", "hidden_act"), ("llama", "hidden_act")])
def test_an_unknown_activation_is_a_clear_error(model_type, key):
    with torch.device("meta"):
        model = CASES[model_type.replace("gpt2", "gpt")][0](**CASES[model_type.replace("gpt2", "gpt")][1])
    hf = {**adapter_for_model(model).config_to_hf(model), "model_type": model_type, key: "gelu_fast_v9"}
    with pytest.raises(UnsupportedHFValue, match=rf"{key} 'gelu_fast_v9' is not supported.*known: \["):
        adapters()[model_type].config_from_hf(hf)
    # still what older callers caught
    assert issubclass(UnsupportedHFValue, DufuError) and issubclass(UnsupportedHFValue, ValueError)


def test_an_activation_with_no_transformers_name_is_a_clear_error_on_export():
    with torch.device("meta"):
        model = GPTModel(vocab_size=16, hidden_size=8, num_layers=1, num_attention_heads=2)
    model.blocks["0"].mlp.activation = "made_up"
    with pytest.raises(UnsupportedHFValue, match="activation_function 'made_up' is not supported"):
        adapter_for_model(model).config_to_hf(model)


def test_rows_alternatives_defaults_and_a_missing_required_key():
    cmap = HFConfigMap(fields=[
        ConfigField("width", ("n_embd", "hidden_size")),
        ConfigField("ffn", "n_inner", default=lambda hf: 4 * hf.get("n_embd", hf.get("hidden_size")),
                    or_default=True),
        ConfigField(None, "kind", default=None, from_hf={"a": "a"}, hint=": only 'a'"),
    ])
    assert cmap.from_hf({"hidden_size": 8, "n_inner": None}) == {"width": 8, "ffn": 32}
    assert cmap.from_hf({"n_embd": 4, "hidden_size": 8, "n_inner": 6, "kind": "a"}) == {"width": 4, "ffn": 6}
    with pytest.raises(UnsupportedHFValue, match="kind 'b' is not supported: only 'a'"):
        cmap.from_hf({"n_embd": 4, "kind": "b"})
    with pytest.raises(UnsupportedHFValue, match="has no n_embd or hidden_size"):
        cmap.from_hf({"n_inner": 6})
