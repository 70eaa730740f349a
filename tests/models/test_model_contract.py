"""Every model family keeps the declared contract (dufu.models.base.ModelContract), checked on a tiny instance.

The families are found, not listed: every public class under dufu.models that inherits ModelBase. A new family
without an entry in TINY fails here, and so does a packaged debug config whose model is not a found family.
"""

from __future__ import annotations

import ast
import collections.abc
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import dufu.configs
import dufu.models
from dufu.config import get_config
from dufu.models.base import CONTRACT, ModelBase, ModelContract, tied_names
from dufu.models.hub import adapter_for_model, build_from_hf_config, hf_tensor_sources, read_hf_config, \
    save_pretrained
from dufu.models.llama.model import LlamaDecoder
from dufu.parallel.pipeline import block_containers, build_stage_module, layer_stage_ids, pipeline_num_layers

DUFU = Path(dufu.models.__file__).resolve().parents[1]

# Tiny sizes: hidden 64 (Swin: 32 doubled to 64 in its second stage), 2 layers, vocabulary 256.
TEXT = dict(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, max_position_embeddings=64)
DECODER = dict(TEXT, num_key_value_heads=2, ffn_hidden_size=128)
T5 = dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
TINY = {
    "GPTModel": TEXT,
    "LlamaModel": DECODER,
    "MoEModel": dict(DECODER, num_experts=4, top_k=2, moe_ffn_hidden_size=64),
    # no MTP depth: the round trip rebuilds the model from its exported config, which never builds MTP modules
    "DeepseekV3Model": dict(TEXT, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, ffn_hidden_size=128, first_k_dense=1, num_experts=4, top_k=2,
                            moe_ffn_hidden_size=32, n_group=2, topk_group=1),
    "BertModel": TEXT,
    "BertForMaskedLM": TEXT,
    "BertForSequenceClassification": dict(TEXT, num_labels=3),
    "RobertaModel": TEXT,
    "RobertaForMaskedLM": TEXT,
    "RobertaForSequenceClassification": dict(TEXT, num_labels=3),
    "T5ForConditionalGeneration": T5,
    "T5Model": T5,
    "T5EncoderModel": T5,
    "ViTForImageClassification": dict(image_size=32, patch_size=8, num_labels=10, hidden_size=64, num_layers=2,
                                      num_attention_heads=4),
    "SwinForImageClassification": dict(image_size=32, patch_size=4, num_labels=10, embed_dim=32, depths=(1, 1),
                                       num_heads=(2, 4), window_size=4),
    "HFAutoModel": dict(model_type="gpt_neox", config=dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=128,
                                                           max_position_embeddings=64)),
}
# Classes the families are made of, not families of their own.
SHARED_BASES = {LlamaDecoder}  # the decoder LlamaModel and MoEModel share


def _families() -> dict[str, type]:
    for info in pkgutil.walk_packages(dufu.models.__path__, "dufu.models."):
        importlib.import_module(info.name)
    found, todo = {}, [ModelBase]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if (cls.__module__.startswith("dufu.models.") and not cls.__name__.startswith("_")
                and cls not in SHARED_BASES and cls.__module__ != "dufu.models.base"):
            found[cls.__name__] = cls
    return dict(sorted(found.items()))


FAMILIES = _families()


def test_every_family_has_a_tiny_instance_here():
    assert set(FAMILIES) == set(TINY), "give each family its tiny sizes in TINY"


def test_every_packaged_debug_config_builds_a_family():
    names = [m.name for m in pkgutil.iter_modules(dufu.configs.__path__) if m.name.endswith("_debug")]
    assert names
    targets = {name: get_config(name).model["_target_"] for name in names}
    strays = {name: t for name, t in targets.items() if t not in FAMILIES.values()}
    assert not strays, f"debug configs whose model is not a family inheriting ModelBase: {strays}"


def test_the_protocol_lists_what_the_base_declares():
    declared = {n for n in vars(ModelBase) if not n.startswith("_")}
    assert declared == set(CONTRACT)


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request) -> nn.Module:
    name = request.param
    if name == "HFAutoModel":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    return FAMILIES[name](**TINY[name]).eval()


def _conforms(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union:
        return any(_conforms(value, a) for a in args)
    if origin is collections.abc.Mapping:
        return isinstance(value, collections.abc.Mapping) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if origin is collections.abc.Callable:
        return callable(value)
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, hint)


def test_attributes_are_present_with_their_types(model):
    assert isinstance(model, ModelBase) and isinstance(model, ModelContract)
    hints = typing.get_type_hints(ModelContract)
    wrong = {name: repr(getattr(model, name)) for name, hint in hints.items()
             if not _conforms(getattr(model, name), hint)}
    assert not wrong, f"attributes of the wrong type: {wrong}"
    assert model.attention_layers is None or isinstance(model.attention_layers, int)
    modules = {id(m) for m in model.modules()}
    for end in (model.output_head(), model.token_embedding()):
        assert end is None or id(end) in modules
    assert model.main_input_name in inspect.signature(model.forward).parameters
    if model.main_input_name == "input_ids":
        ids = torch.ones(2, 8, dtype=torch.long)
        positions = model.default_position_ids(ids)
        assert positions.dtype == torch.long and positions.shape[-1] == 8 and positions.shape[0] in (1, 2)


def test_refusals_carry_the_familys_reason(model):
    cls = type(model)
    if cls.pipeline_layout is None:
        assert cls.pipeline_unsupported_reason.strip()
        assert cls.pipeline_unsupported_reason != ModelBase.pipeline_unsupported_reason, "say why this family"
    if not cls.supports_context_parallel:
        assert cls.context_parallel_unsupported_reason.strip()
        assert cls.context_parallel_unsupported_reason != ModelBase.context_parallel_unsupported_reason


def test_tied_parameters_are_the_ones_declared(model):
    assert dict(model.tied_parameter_names) == tied_names(model)
    head, embedding = model.output_head(), model.token_embedding()
    if head is not None and embedding is not None:
        assert bool(model.tied_parameter_names) == model.tie_word_embeddings
        assert (head.weight is embedding.weight) == model.tie_word_embeddings


def test_pipeline_layout_matches_the_blocks(model):
    layout = model.pipeline_layout
    if layout is None:
        return
    assert {"blocks", "first", "last"} <= set(layout) <= {"blocks", "first", "last", "before", "after"}
    blocks = []
    for container in block_containers(layout):
        stack = model.get_submodule(container)
        assert isinstance(stack, nn.ModuleDict) and list(stack) == [str(i) for i in range(len(stack))]
        assert all(block.layer_idx == int(key) for key, block in stack.items())
        blocks += [f"{container}.{key}" for key in stack]
    assert pipeline_num_layers(model) == len(blocks)
    ends = [*layout["first"], *layout["last"], *layout.get("before", {}), *layout.get("after", {})]
    for name in ends:  # each names a module of the model, or a slot the family leaves empty (T5Model's head)
        parent, _, attr = name.rpartition(".")
        assert hasattr(model.get_submodule(parent) if parent else model, attr), name
    owners = blocks + ends
    for name, _ in model.named_parameters(remove_duplicate=False):
        held = [o for o in owners if name.startswith(o + ".")]
        assert len(held) == 1, f"{name} belongs to {held or 'no part'} of the pipeline layout"
    # Two stages hold every parameter between them, under the model's own names.
    ids = layer_stage_ids(len(blocks), 2)
    stages = [build_stage_module(model, s, 2, ids) for s in range(2)]
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(model.state_dict())


def test_hugging_face_mapping_round_trips(model, tmp_path):
    mapped = (DUFU / "models" / type(model).__module__.split(".")[2] / "hf.py").is_file() \
        or model.hf_mapping is not None
    if not mapped:
        return
    ad = adapter_for_model(model)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_pretrained(model, tmp_path)
    sources = hf_tensor_sources(ad, model, tmp_path)
    missing = [k for k in sd if k not in sources and k not in model.tied_parameter_names]
    assert not missing, f"not read back: {missing}"
    for name, source in sources.items():
        value = source() if callable(source) else source
        torch.testing.assert_close(value, sd[name], rtol=0, atol=0, msg=name)
    hf_config = read_hf_config(tmp_path)
    if model.hf_mapping is not None:
        again = type(model)(path=str(tmp_path), load_weights=False)
    else:
        again = build_from_hf_config(hf_config)
    assert type(again) is type(model)
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in sd.items()}


# Code outside dufu.models reads the contract's names as declared attributes, never with getattr / hasattr and a
# default (dufu.models.base.contract_of answers the defaults for a module that is not a family).
NOT_CHECKED = ("models",)


def test_no_code_outside_the_models_probes_the_contract():
    probes = []
    for path in sorted(DUFU.rglob("*.py")):
        if path.relative_to(DUFU).parts[0] in NOT_CHECKED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in CONTRACT
                    and not any(w in ast.unparse(node.args[0]) for w in ("cfg", "config"))):
                probes.append(f"{path.relative_to(DUFU.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "read the declared attribute (dufu.models.base.contract_of for any module):\n" + \
        "\n".join(probes)
