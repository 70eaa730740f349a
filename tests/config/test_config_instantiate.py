"""LazyCall and instantiate: recursion, container types, dotted targets, error messages."""

import collections
import copy
import types

import pytest

from dufu.config import ConfigDict, LazyCall, instantiate, locate
from dufu.errors import ConfigError


class Block:
    def __init__(self, size, activation="gelu"):
        self.size = size
        self.activation = activation


class Model:
    def __init__(self, hidden_size, blocks=(), head=None, num_layers=2):
        self.hidden_size = hidden_size
        self.blocks = blocks
        self.head = head
        self.num_layers = num_layers


class Outer:
    class Inner:
        def __init__(self, x=0):
            self.x = x


def explode(message):
    raise ValueError(message)


Pair = collections.namedtuple("Pair", "left right")


def test_lazycall_records_the_call():
    node = LazyCall(Block)(size=4, extra={"a": 1})
    assert type(node) is ConfigDict
    assert list(node) == ["_target_", "size", "extra"]
    assert node._target_ is Block and node.size == 4 and type(node.extra) is ConfigDict
    assert LazyCall("pkg.mod.Name")()["_target_"] == "pkg.mod.Name"


def test_lazycall_rejects_positional_args_and_non_callables():
    with pytest.raises(ConfigError, match="positional"):
        LazyCall(Block)(4)
    with pytest.raises(ConfigError, match="needs a class, a function"):
        LazyCall(3)
    with pytest.raises(ConfigError, match="not a dotted import path"):
        LazyCall("not a path!")
    with pytest.raises(ConfigError, match="reserved"):
        LazyCall(Block)(_target_=1)


def test_instantiate_nested_lists_tuples_and_dicts():
    cfg = ConfigDict(
        model=LazyCall(Model)(
            hidden_size=8,
            blocks=[LazyCall(Block)(size=1), LazyCall(Block)(size=2, activation="relu")],
            head=(LazyCall(Block)(size=3),),
        ),
        pair=Pair(LazyCall(Block)(size=5), 6),
        plain={"a": [1, {"b": LazyCall(Block)(size=7)}]},
        scalar=1.5,
    )
    out = instantiate(cfg)
    assert type(out) is ConfigDict
    model = out.model
    assert isinstance(model, Model) and model.hidden_size == 8
    assert type(model.blocks) is list and [b.size for b in model.blocks] == [1, 2]
    assert model.blocks[1].activation == "relu"
    assert type(model.head) is tuple and model.head[0].size == 3
    assert type(out.pair) is Pair and out.pair.left.size == 5 and out.pair.right == 6
    assert type(out.plain) is ConfigDict and out.plain.a[1].b.size == 7
    assert out.scalar == 1.5


def test_instantiate_does_not_mutate_the_config():
    cfg = ConfigDict(model=LazyCall(Model)(hidden_size=8, blocks=[LazyCall(Block)(size=1)]))
    before = copy.deepcopy(cfg)
    blocks = cfg.model.blocks
    instantiate(cfg)
    assert cfg == before and cfg.model.blocks is blocks
    assert isinstance(cfg.model.blocks[0], ConfigDict)
    plain = ConfigDict(sizes=[1, 2], pair=(3, 4))
    out = instantiate(plain)
    assert out == plain and out.sizes is not plain.sizes and out.pair is not plain.pair


def test_objects_returned_by_targets_are_kept_as_they_are():
    out = instantiate({"d": LazyCall(dict)(a={"x": 1})})
    assert type(out["d"]) is dict


def test_dotted_string_targets_including_nested_attributes():
    out = instantiate(
        {
            "od": {"_target_": "collections.OrderedDict", "a": 1},
            "ns": {"_target_": "types.SimpleNamespace", "x": 1},
            "inner": {"_target_": f"{__name__}.Outer.Inner", "x": 3},
            "dec": {"_target_": "json.decoder.JSONDecoder", "strict": False},
        }
    )
    assert out.od == collections.OrderedDict(a=1)
    assert out.ns == types.SimpleNamespace(x=1)
    assert isinstance(out.inner, Outer.Inner) and out.inner.x == 3
    assert out.dec.strict is False
    assert locate("collections.OrderedDict") is collections.OrderedDict


def test_bad_import_path_names_key_and_target():
    with pytest.raises(ConfigError) as info:
        instantiate({"optim": {"_target_": "collections.OrderedDic"}})
    message = str(info.value)
    assert "'collections.OrderedDic'" in message and "optim" in message
    assert "OrderedDict" in message  # the suggestion
    with pytest.raises(ConfigError, match="no module named 'no_such_pkg_xyz'"):
        instantiate({"m": {"_target_": "no_such_pkg_xyz.Thing"}})
    with pytest.raises(ConfigError, match="cannot be called"):
        instantiate({"m": {"_target_": "math.pi"}})


def test_unknown_kwarg_names_key_path_target_and_accepted_params():
    cfg = ConfigDict(model=LazyCall(Model)(hidden_sizee=8))
    with pytest.raises(ConfigError) as info:
        instantiate(cfg)
    message = str(info.value)
    assert "'model.hidden_sizee'" in message
    assert "Model" in message and "'hidden_size'" in message
    for name in ("hidden_size", "blocks", "head", "num_layers"):
        assert name in message
    # The key path can be given when instantiating a sub-tree.
    with pytest.raises(ConfigError, match=r"'model\.hidden_sizee'"):
        instantiate(cfg.model, key="model")


def test_missing_required_parameter_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'hidden_size'.*\+model\.hidden_size=VALUE"):
        instantiate({"model": LazyCall(Model)(num_layers=2)})


def test_builtin_without_signature_unexpected_kwarg():
    with pytest.raises(ConfigError, match="keyword argument"):
        instantiate({"r": LazyCall(range)(stop=3)})


def test_errors_raised_inside_the_target_propagate_unchanged():
    with pytest.raises(ValueError) as info:
        instantiate({"thing": LazyCall(explode)(message="boom")})
    assert type(info.value) is ValueError and str(info.value) == "boom"
    assert any("thing" in note for note in getattr(info.value, "__notes__", ["thing"]))


def test_type_error_inside_target_is_not_disguised():
    def bad(x):
        return x + "a"

    with pytest.raises(TypeError, match="unsupported operand"):
        instantiate({"v": LazyCall(bad)(x=1)})
