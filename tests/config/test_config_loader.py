"""LazyConfig.load: .py configs with relative imports between files, .yaml files, errors."""

import builtins
import collections

import pytest

from dufu.config import ConfigDict, LazyConfig, instantiate
from dufu.errors import ConfigError

TREE = {
    "common/train.py": """
        train = dict(train_iter=100, amp=dict(enabled=False), milestones=[10, 20])
        """,
    "common/optim.py": """
        from dufu.config import LazyCall
        import collections

        optim = LazyCall(collections.OrderedDict)(lr=1e-3, betas=(0.9, 0.95))
        """,
    "common/models/gpt.py": """
        from dufu.config import LazyCall

        model = LazyCall("types.SimpleNamespace")(hidden_size=64, num_layers=2)
        """,
    "recipes/gpt/small.py": """
        import math
        from ...common.train import train
        from ...common.optim import optim
        from ...common.models.gpt import model
        from ...common import train as train_file

        model.num_layers = 4
        train.train_iter = 10
        base_train_iter = train_file.train.train_iter
        source = __file__
        ratio = math.sqrt(4.0)
        _private = 1
        nothing = None
        names = ("a", "b")

        def helper():
            return 1

        class Local:
            pass
        """,
    "recipes/base.py": """
        from ..common.train import train
        from ..common.optim import *
        """,
}


def test_relative_imports_load_sibling_config_files(write_configs):
    root = write_configs(TREE)
    cfg = LazyConfig.load(root / "recipes/gpt/small.py")
    assert type(cfg) is ConfigDict
    assert list(cfg) == [
        "train", "optim", "model", "base_train_iter", "source", "ratio", "nothing", "names"
    ]
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 64
    assert cfg.train.train_iter == 10 and type(cfg.train.amp) is ConfigDict
    assert cfg.base_train_iter == 100  # each import executes the file afresh
    assert cfg.optim._target_ is collections.OrderedDict and cfg.optim.betas == (0.9, 0.95)
    assert cfg.source == str((root / "recipes/gpt/small.py").resolve())
    assert cfg.ratio == 2.0 and cfg.nothing is None and cfg.names == ("a", "b")
    assert builtins.__import__ is _original_import


_original_import = builtins.__import__


def test_two_level_relative_import_and_star_import(write_configs):
    root = write_configs(TREE)
    cfg = LazyConfig.load(root / "recipes/base.py")
    assert cfg.train.train_iter == 100 and cfg.optim.lr == 1e-3


def test_each_load_returns_fresh_objects(write_configs):
    root = write_configs(TREE)
    first = LazyConfig.load(root / "recipes/gpt/small.py")
    second = LazyConfig.load(root / "recipes/gpt/small.py")
    assert first == second
    first.train.amp.enabled = True
    first.train.milestones.append(30)
    assert second.train.amp.enabled is False and second.train.milestones == [10, 20]
    base = LazyConfig.load(root / "common/train.py")
    assert base.train.train_iter == 100  # the recipe's edit did not leak into the base file


def test_load_selected_keys(write_configs):
    root = write_configs(TREE)
    path = root / "recipes/gpt/small.py"
    model = LazyConfig.load(path, keys="model")
    assert model.hidden_size == 64
    train, optim = LazyConfig.load(path, keys=("train", "optim"))
    assert train.train_iter == 10 and optim.lr == 1e-3
    with pytest.raises(ConfigError, match="Did you mean: 'model'"):
        LazyConfig.load(path, keys="modle")


def test_checked_in_fixture_recipe(fixture_configs):
    cfg = LazyConfig.load(fixture_configs / "recipes/tiny.py")
    assert cfg.train.train_iter == 20 and cfg.optim.lr == 3e-4
    built = instantiate(cfg)
    assert built.model.hidden_size == 32
    assert built.optim == collections.OrderedDict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def test_missing_relative_import_file_names_the_path(write_configs):
    root = write_configs({"a.py": "from .common.trian import train\n"})
    with pytest.raises(ConfigError) as info:
        LazyConfig.load(root / "a.py")
    assert str(root / "common" / "trian.py") in str(info.value)
    assert builtins.__import__ is _original_import


def test_missing_imported_name_suggests_close_names(write_configs):
    root = write_configs({"a.py": "from .b import trian\n", "b.py": "train = dict(x=1)\n"})
    with pytest.raises(ConfigError, match="Did you mean: 'train'"):
        LazyConfig.load(root / "a.py")


def test_import_cycle_is_reported(write_configs):
    root = write_configs({"a.py": "from .b import y\nx = 1\n", "b.py": "from .a import x\ny = 2\n"})
    with pytest.raises(ConfigError, match="cycle"):
        LazyConfig.load(root / "a.py")


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        LazyConfig.load(tmp_path / "nope.py")
    assert "nope.py" in str(info.value) and "dufu configs" in str(info.value)
    (tmp_path / "cfg.json").write_text("{}")
    with pytest.raises(ConfigError, match="extension '.json'"):
        LazyConfig.load(tmp_path / "cfg.json")


def test_syntax_error_reports_file_and_line(write_configs):
    root = write_configs({"bad.py": "x = 1\ny = = 2\n"})
    with pytest.raises(ConfigError) as info:
        LazyConfig.load(root / "bad.py")
    assert f"{(root / 'bad.py').resolve()}:2" in str(info.value)


def test_syntax_error_in_imported_file_reports_that_file(write_configs):
    root = write_configs({"a.py": "from .b import x\n", "b.py": "x = (\n"})
    with pytest.raises(ConfigError, match=r"b\.py:1"):
        LazyConfig.load(root / "a.py")


def test_other_exceptions_propagate(write_configs):
    root = write_configs({"a.py": "x = 1 / 0\n"})
    with pytest.raises(ZeroDivisionError):
        LazyConfig.load(root / "a.py")
    assert builtins.__import__ is _original_import


def test_absolute_imports_are_normal(write_configs):
    root = write_configs({"a.py": "from collections import OrderedDict\nx = OrderedDict\ny = 1\n"})
    assert LazyConfig.load(root / "a.py") == {"y": 1}


def test_yaml_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  _target_: types.SimpleNamespace\n  sizes: [1, 2]\n  sub: {a: 1}\nlr: 1.0e-3\n"
    )
    cfg = LazyConfig.load(path)
    assert cfg == {
        "model": {"_target_": "types.SimpleNamespace", "sizes": [1, 2], "sub": {"a": 1}},
        "lr": 1e-3,
    }
    assert type(cfg.model.sub) is ConfigDict and type(cfg.model.sizes) is list
    assert instantiate(cfg).model.sizes == [1, 2]
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    assert LazyConfig.load(empty) == {}


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        LazyConfig.load(bad)
    seq = tmp_path / "seq.yaml"
    seq.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        LazyConfig.load(seq)


def test_config_errors_raised_by_a_config_file_name_its_line(write_configs):
    root = write_configs(
        {
            "a.py": """
                from .b import train

                x = train.amp.enabld
                """,
            "b.py": "train = dict(amp=dict(enabled=True))\n",
            "c.py": "from .missing import y\n",
        }
    )
    with pytest.raises(AttributeError) as info:  # still an AttributeError for getattr/hasattr
        LazyConfig.load(root / "a.py")
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert message.startswith(f"In config file {(root / 'a.py').resolve()}, line 3:")
    assert "Did you mean: 'enabled'" in message
    with pytest.raises(ConfigError, match=r"c\.py, line 1: `from \.missing import y` failed"):
        LazyConfig.load(root / "c.py")


def test_from_dot_import_module_and_unique_module_names(write_configs):
    root = write_configs(
        {
            "a.py": "from . import b\nvalue = b.train.x\nname = __name__\n",
            "b.py": "train = dict(x=1)\n",
        }
    )
    first, second = LazyConfig.load(root / "a.py"), LazyConfig.load(root / "a.py")
    assert first.value == 1
    assert first.name != second.name
