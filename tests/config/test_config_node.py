"""ConfigDict: attribute access, conversion of nested dicts, nearest-key errors, copying."""

import copy
import pickle

import pytest

from dufu.config import ConfigDict, ConfigKeyError, flatten
from dufu.errors import ConfigError


def make():
    return ConfigDict(
        train={"amp": {"enabled": False, "dtype": "bf16"}, "train_iter": 10, "warmup_iter": 2},
        layers=[{"size": 4}, 5],
    )


def test_attribute_and_item_access():
    cfg = make()
    assert cfg.train.amp.enabled is False
    cfg.train.amp.enabled = True
    assert cfg["train"]["amp"]["enabled"] is True
    cfg.new = 3
    assert cfg["new"] == 3
    del cfg.new
    assert "new" not in cfg
    assert cfg == {
        "train": {"amp": {"enabled": True, "dtype": "bf16"}, "train_iter": 10, "warmup_iter": 2},
        "layers": [{"size": 4}, 5],
    }


def test_nested_dicts_become_configdicts_everywhere():
    cfg = make()
    assert type(cfg.train) is ConfigDict and type(cfg.train.amp) is ConfigDict
    assert type(cfg.layers[0]) is ConfigDict and cfg.layers[0].size == 4
    cfg.opt = {"lr": {"base": 1.0}}
    assert cfg.opt.lr.base == 1.0
    cfg["tup"] = ({"a": 1},)
    assert type(cfg.tup) is tuple and cfg.tup[0].a == 1
    cfg.update(upd={"x": 1}, other={"y": {"z": 2}})
    assert cfg.other.y.z == 2 and type(cfg.upd) is ConfigDict
    assert cfg.setdefault("sd", {"k": 1}).k == 1
    assert type(cfg.copy()) is ConfigDict
    merged = cfg | {"m": {"n": 1}}
    assert type(merged) is ConfigDict and merged.m.n == 1
    cfg |= {"p": {"q": 1}}
    assert cfg.p.q == 1


def test_lists_without_dicts_keep_their_identity():
    values = [1, 2]
    cfg = ConfigDict()
    cfg.values_ = values
    values.append(3)
    assert cfg.values_ == [1, 2, 3]


def test_missing_key_names_the_closest_keys():
    cfg = make()
    with pytest.raises(AttributeError) as info:
        cfg.train.train_itr
    message = str(info.value)
    assert "'train_itr'" in message and "'train_iter'" in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ConfigKeyError)
    assert not hasattr(cfg, "train_itr")
    assert getattr(cfg, "nothing", 7) == 7


def test_missing_key_without_similar_keys_lists_existing_ones():
    with pytest.raises(AttributeError, match="Existing keys: 'train', 'layers'"):
        make().zzzzzz


def test_dict_method_names_cannot_be_set_as_attributes():
    cfg = ConfigDict()
    with pytest.raises(AttributeError, match=r"cfg\['items'\]"):
        cfg.items = 1
    cfg["items"] = 1
    assert cfg["items"] == 1


def test_pickle_and_deepcopy_keep_type_and_independence():
    cfg = make()
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone == cfg
        assert type(clone) is ConfigDict and type(clone.train.amp) is ConfigDict
        assert type(clone.layers[0]) is ConfigDict
        clone.train.amp.enabled = True
        assert cfg.train.amp.enabled is False
    shallow = copy.copy(cfg)
    assert type(shallow) is ConfigDict and shallow.train is cfg.train


def test_flatten_gives_dotted_leaf_paths():
    cfg = make()
    cfg.empty = {}
    assert flatten(cfg) == {
        "train.amp.enabled": False,
        "train.amp.dtype": "bf16",
        "train.train_iter": 10,
        "train.warmup_iter": 2,
        "layers": [{"size": 4}, 5],
        "empty": {},
    }
