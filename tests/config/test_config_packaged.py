"""Packaged configs: get_config, list_recipes and resolve_config_path on a stand-in tree."""

import pytest

import dufu.config.packaged as packaged
from dufu.config import get_config, list_recipes, resolve_config_path
from dufu.errors import ConfigError


@pytest.fixture
def configs_root(write_configs, monkeypatch):
    root = write_configs(
        {
            "common/train.py": "train = dict(train_iter=100)\n",
            "gpt2_small.py": "from .common.train import train\ntrain.train_iter = 5\n",
            "gpt2_medium.py": "x = 1\n",
            "_private.py": "x = 1\n",
            "debug/tiny.py": "x = 2\n",
        }
    )
    monkeypatch.setattr(packaged, "_configs_root", lambda: root)
    return root


def test_list_recipes(configs_root):
    assert list_recipes() == ["gpt2_medium", "gpt2_small"]


def test_get_config(configs_root):
    assert get_config("common/train.py").train.train_iter == 100
    assert get_config("common/train").train.train_iter == 100
    assert get_config("gpt2_small.py").train.train_iter == 5
    assert get_config("gpt2_small", keys="train") == {"train_iter": 5}
    with pytest.raises(ConfigError, match="Did you mean: 'common/train.py'"):
        get_config("common/trian.py")


def test_resolve_config_path(configs_root, tmp_path):
    own = tmp_path / "mine.py"
    own.write_text("x = 1\n")
    assert resolve_config_path(own) == own
    assert resolve_config_path(str(own)) == own
    assert resolve_config_path("gpt2_small") == configs_root / "gpt2_small.py"
    assert resolve_config_path("gpt2_small.py") == configs_root / "gpt2_small.py"
    assert resolve_config_path("debug/tiny") == configs_root / "debug/tiny.py"
    with pytest.raises(ConfigError) as info:
        resolve_config_path("gpt2_smal")
    message = str(info.value)
    assert "'gpt2_small'" in message and "`dufu configs`" in message


def test_missing_root_gives_no_recipes(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "_configs_root", lambda: tmp_path / "missing")
    assert list_recipes() == []
    with pytest.raises(ConfigError, match="dufu configs"):
        resolve_config_path("anything")


def test_real_root_is_the_package_directory():
    import dufu

    root = packaged._configs_root()
    assert root.name == "configs"
    assert root.parent.resolve() == packaged.Path(dufu.__file__).parent.resolve()
