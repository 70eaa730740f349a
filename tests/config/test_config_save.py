"""LazyConfig.save (YAML round trip, atomic write, rejected values) and LazyConfig.to_py."""

import collections
import copy
import fractions
import types

import pytest

from dufu.config import ConfigDict, LazyCall, LazyConfig, instantiate
from dufu.errors import ConfigError


class Head:
    def __init__(self, size, bias=True):
        self.size = size
        self.bias = bias

    def __eq__(self, other):
        return isinstance(other, Head) and vars(self) == vars(other)


def make_cfg():
    return ConfigDict(
        model=LazyCall(types.SimpleNamespace)(
            hidden_size=16,
            dropout=0.1,
            head=LazyCall(Head)(size=4),
            heads=[LazyCall(Head)(size=1, bias=False), LazyCall(Head)(size=2)],
            act=fractions.Fraction,  # a class as a plain value
        ),
        optim=LazyCall("collections.OrderedDict")(lr=1e-4, betas=(0.9, 0.95), eps=float("inf")),
        train=dict(train_iter=10, amp=dict(enabled=True, dtype=None), tags=["a", "b"], name="run"),
        seed=1234,
    )


def test_yaml_round_trip_gives_an_equal_config_that_instantiates_the_same(tmp_path):
    cfg = make_cfg()
    before = copy.deepcopy(cfg)
    path = LazyConfig.save(cfg, tmp_path / "out" / "nested" / "config.yaml")
    assert path.is_file() and cfg == before
    loaded = LazyConfig.load(path)

    expected = copy.deepcopy(cfg)
    expected.model._target_ = "types.SimpleNamespace"
    expected.model.act = "fractions.Fraction"
    expected.model.head._target_ = f"{Head.__module__}.Head"
    for head in expected.model.heads:
        head._target_ = f"{Head.__module__}.Head"
    expected.optim.betas = [0.9, 0.95]
    assert loaded == expected
    assert list(loaded) == ["model", "optim", "train", "seed"]
    assert list(loaded.model) == ["_target_", "hidden_size", "dropout", "head", "heads", "act"]

    a, b = instantiate(cfg), instantiate(loaded)
    assert vars(a.model) == {**vars(b.model), "act": fractions.Fraction}
    assert b.model.head == Head(4) and b.model.heads == [Head(1, False), Head(2)]
    assert a.optim == collections.OrderedDict(lr=1e-4, betas=(0.9, 0.95), eps=float("inf"))
    assert b.optim == collections.OrderedDict(lr=1e-4, betas=[0.9, 0.95], eps=float("inf"))
    assert a.train == b.train

    # Saving the loaded config again is byte-identical.
    again = LazyConfig.save(loaded, tmp_path / "again.yaml")
    assert again.read_text() == path.read_text()


def test_save_overwrites_atomically_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")
    LazyConfig.save({"new": 2}, path)
    assert LazyConfig.load(path) == {"new": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_save_rejects_arbitrary_objects_naming_the_key(tmp_path):
    cfg = make_cfg()
    cfg.model.head.extra = {"obj": object()}
    path = tmp_path / "config.yaml"
    with pytest.raises(ConfigError) as info:
        LazyConfig.save(cfg, path)
    assert "'model.head.extra.obj'" in str(info.value) and "builtins.object" in str(info.value)
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_save_rejects_lambdas_and_local_functions_naming_the_key(tmp_path):
    def local(x):
        return x

    with pytest.raises(ConfigError, match=r"'train\.fn'.*lambda"):
        LazyConfig.save({"train": {"fn": lambda x: x}}, tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match=r"'model\._target_'"):
        LazyConfig.save({"model": LazyCall(local)(x=1)}, tmp_path / "b.yaml")


def test_to_yaml_is_readable():
    text = LazyConfig.to_yaml({"model": LazyCall(Head)(size=4), "tags": ["a"]})
    assert text == f"model:\n  _target_: {Head.__module__}.Head\n  size: 4\ntags:\n  - a\n"


def _exec(source):
    """Execute generated source; return its data variables (as LazyConfig.load collects them)."""
    namespace = {}
    exec(compile(source, "<to_py>", "exec"), namespace)
    data = (dict, list, tuple, str, int, float, bool, type(None))
    return {k: v for k, v in namespace.items() if not k.startswith("_") and isinstance(v, data)}


def test_to_py_round_trip():
    cfg = make_cfg()
    cfg.odd = {"not an identifier": 1, 3: (1,), "empty": ()}
    cfg.lazy_odd = LazyCall(dict)(**{"a b": 1, "class": 2})
    source = LazyConfig.to_py(cfg)
    assert "from dufu.config import LazyCall" in source
    assert "from types import SimpleNamespace" in source
    assert "LazyCall('collections.OrderedDict')(" in source
    assert "model = LazyCall(SimpleNamespace)(" in source
    assert "lazy_odd = LazyCall(dict)(**{'a b': 1, 'class': 2})" in source
    assert _exec(source) == cfg


def test_to_py_output_loads_as_a_config_file(tmp_path):
    cfg = make_cfg()
    path = tmp_path / "generated.py"
    path.write_text(LazyConfig.to_py(cfg))
    loaded = LazyConfig.load(path)
    assert loaded == cfg and type(loaded.train) is ConfigDict
    assert instantiate(loaded).model.head == Head(4)


def test_to_py_aliases_clashing_names_and_supports_prefix():
    other = type("Head", (), {"__module__": "fractions"})  # not importable: rejected below
    cfg = ConfigDict(Head=1, model=LazyCall(Head)(size=2))
    source = LazyConfig.to_py(cfg)
    assert "import Head as Head_2" in source
    assert _exec(source) == cfg
    prefixed = LazyConfig.to_py(cfg, prefix="cfg.")
    namespace = {"cfg": ConfigDict()}
    exec(prefixed, namespace)
    assert namespace["cfg"] == cfg
    with pytest.raises(ConfigError, match=r"'model\._target_'"):
        LazyConfig.to_py({"model": LazyCall(other)()})
    with pytest.raises(ConfigError, match=r"'model\.obj'"):
        LazyConfig.to_py({"model": {"obj": object()}})
