"""LazyConfig.apply_overrides: value parsing, type rules, unknown keys, '+' keys, bad input."""

import collections
import dataclasses

import pytest

from dufu.config import ConfigDict, LazyCall, LazyConfig, parse_value
from dufu.errors import ConfigError


@dataclasses.dataclass
class Amp:
    """A typed node's schema: `enabled` is a switch that also takes words."""

    enabled: bool | str = False
    dtype: str = "bf16"


def make_cfg():
    return ConfigDict(
        train=dict(
            train_iter=100,
            warmup_iter=10,
            lr=1e-3,
            output_dir="output",
            resume=None,
            amp=dict(_schema_=Amp, enabled=False, dtype="bf16"),
            tensorboard=True,
            milestones=[10, 20],
            betas=(0.9, 0.95),
        ),
        model=LazyCall(collections.OrderedDict)(hidden_size=64),
    )


def apply(*overrides):
    return LazyConfig.apply_overrides(make_cfg(), list(overrides))


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-3", 1e-3),
        ("3", 3),
        ("True", True),
        ("true", True),
        ("FALSE", False),
        ("null", None),
        ("None", None),
        ("none", None),
        ("[1, 2]", [1, 2]),
        ("(1, 2)", (1, 2)),
        ("'x'", "x"),
        ("'123'", "123"),
        ("gpt2", "gpt2"),
        ("path/to/dir", "path/to/dir"),
        ("", ""),
    ],
)
def test_parse_value(text, value):
    parsed = parse_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_valid_overrides_are_applied_in_place():
    cfg = make_cfg()
    out = LazyConfig.apply_overrides(
        cfg,
        [
            "train.train_iter=5",
            "train.lr=1",  # int accepted for a float key, stored as float
            "train.output_dir=runs/x",
            "train.resume=ckpt/last",  # None accepts anything
            "train.amp.enabled=true",
            "train.milestones=(1, 2, 3)",  # container type of the current value is kept
            "train.betas=[0.8, 0.9]",
            "model.hidden_size=128",
            "model._target_=collections.Counter",
            "train.output_dir='123'",
        ],
    )
    assert out is cfg
    assert cfg.train.train_iter == 5
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.output_dir == "123"
    assert cfg.train.resume == "ckpt/last"
    assert cfg.train.amp.enabled is True
    assert cfg.train.milestones == [1, 2, 3] and type(cfg.train.milestones) is list
    assert cfg.train.betas == (0.8, 0.9) and type(cfg.train.betas) is tuple
    assert cfg.model.hidden_size == 128 and cfg.model._target_ == "collections.Counter"


def test_single_string_and_float_specials():
    cfg = LazyConfig.apply_overrides(make_cfg(), "train.lr=inf")
    assert cfg.train.lr == float("inf")


def test_bool_keys_need_bools():
    for text in ("train.tensorboard=1", "train.tensorboard=0", "train.tensorboard=yes"):
        with pytest.raises(ConfigError) as info:
            apply(text)
        message = str(info.value)
        assert "'train.tensorboard'" in message and "a bool" in message and "true" in message


def test_a_switch_or_choice_key_takes_a_bool_or_a_word_but_not_a_number():
    # train.amp.enabled is True/False or a word ("auto", "bf16"); which words is validate_config's business
    assert apply("train.amp.enabled=auto").train.amp.enabled == "auto"
    assert apply("train.amp.enabled=true").train.amp.enabled is True
    with pytest.raises(ConfigError, match="'train.amp.enabled' expects a bool"):
        apply("train.amp.enabled=1")


def test_int_keys_reject_floats_bools_and_text():
    expected = r"'train\.train_iter' expects an int.*1\.5 of type float"
    with pytest.raises(ConfigError, match=expected):
        apply("train.train_iter=1.5")
    with pytest.raises(ConfigError, match=r"train\.train_iter=2\b"):
        apply("train.train_iter=2.0")
    with pytest.raises(ConfigError, match="of type bool"):
        apply("train.train_iter=true")
    with pytest.raises(ConfigError, match="of type str"):
        apply("train.train_iter=many")


def test_float_keys_reject_text_and_bools():
    with pytest.raises(ConfigError, match=r"'train\.lr' expects a float.*'fast' of type str"):
        apply("train.lr=fast")
    with pytest.raises(ConfigError, match="of type bool"):
        apply("train.lr=True")


def test_str_keys_reject_numbers_and_suggest_quoting():
    with pytest.raises(ConfigError) as info:
        apply("train.output_dir=123")
    message = str(info.value)
    assert "'train.output_dir' expects a str" in message and "of type int" in message
    assert "train.output_dir=\"'123'\"" in message
    with pytest.raises(ConfigError, match="of type NoneType"):
        apply("train.output_dir=none")


def test_numbers_and_lists_can_be_reset_to_none():
    cfg = apply("train.lr=null")
    assert cfg.train.lr is None
    cfg = apply("train.milestones=None")
    assert cfg.train.milestones is None


def test_list_keys_need_lists():
    with pytest.raises(ConfigError, match=r"'train\.milestones' expects a list.*\[1, 2\]"):
        apply("train.milestones=5")


def test_group_keys_cannot_become_scalars():
    with pytest.raises(ConfigError) as info:
        apply("train.amp=false")
    message = str(info.value)
    assert "group of keys" in message and "train.amp.enabled=" in message


def test_callable_keys_accept_dotted_paths_only():
    with pytest.raises(ConfigError, match="dotted import path"):
        apply("model._target_=3")


def test_unknown_key_names_the_closest_keys():
    with pytest.raises(ConfigError) as info:
        apply("train.lr_warmup=5")
    message = str(info.value)
    assert message.startswith("Unknown config key 'train.lr_warmup'")
    assert "Did you mean: 'train.warmup_iter'" in message
    assert "--show-config" in message and "+train.lr_warmup=" in message
    with pytest.raises(ConfigError, match=r"Did you mean: 'train\.amp\.enabled'"):
        apply("train.amp.enable=true")
    with pytest.raises(ConfigError, match="Unknown config key 'trian.amp.enabled'"):
        apply("trian.amp.enabled=true")


def test_plus_adds_new_keys():
    cfg = apply(
        "+train.grad_clip=1.0", "+train.extra={}", "+train.extra.nested=[1]", "+new_top='x'"
    )
    assert cfg.train.grad_clip == 1.0 and cfg.new_top == "x"
    assert type(cfg.train.extra) is ConfigDict and cfg.train.extra.nested == [1]
    cfg = apply("+train.sched={}", "+train.sched.name=cosine")
    assert cfg.train.sched == {"name": "cosine"}
    with pytest.raises(ConfigError, match="already exists.*Drop the '\\+'"):
        apply("+train.lr=1.0")
    with pytest.raises(ConfigError, match="parent 'train.sched' does not exist"):
        apply("+train.sched.name=cosine")
    with pytest.raises(ConfigError, match="not a group of keys"):
        apply("+train.lr.x=1")


def test_list_elements_can_be_overridden_by_index():
    cfg = apply("train.milestones.1=30")
    assert cfg.train.milestones == [10, 30]
    with pytest.raises(ConfigError, match="index 5 does not exist"):
        apply("train.milestones.5=1")


def test_scalar_parent_is_an_error():
    with pytest.raises(ConfigError, match=r"'train\.lr' holds a float"):
        apply("train.lr.value=1")


@pytest.mark.parametrize("bad", ["train.train_iter", "=3", "train..lr=1", "+", 3])
def test_malformed_overrides_show_the_expected_form(bad):
    with pytest.raises(ConfigError, match="`key=value`"):
        apply(bad)
