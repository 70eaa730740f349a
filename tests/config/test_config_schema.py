"""Typed config nodes: config files and YAML are checked like overrides, against the train schema and against
the signatures of LazyCall targets; keys added on purpose survive YAML; every default is written once."""

import ast
import collections
import dataclasses
from pathlib import Path

import pytest

import dufu.config
from dufu.config import ConfigDict, LazyCall, LazyConfig, get_config, schema_defaults, schema_node
from dufu.engine.schema import AUTO_KEYS, Train, auto_layout_keys, validate_train
from dufu.errors import ConfigError

# A recipe written as a user would, deriving from the packaged config files by absolute path.
HEAD = "from dufu.config import get_config\ntrain = get_config('common/train.py').train\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        LazyConfig.apply_overrides(LazyConfig.load(path), list(overrides))
    return str(info.value)


def test_a_typo_in_a_python_config_names_file_line_key_and_closest_key(tmp_path):
    path = write(tmp_path, "my_config.py", HEAD + "train.train_iter = 5\ntrain.trian_iter = 3\n")
    message = error_of(path)
    assert message.startswith(f"In config file {path.resolve()}, line 4: Unknown config key 'train.trian_iter'")
    assert "Did you mean: 'train.train_iter'" in message
    assert "train.add(trian_iter=...)" in message and "+train.trian_iter=" in message


def test_a_typo_in_a_nested_key_or_in_update_is_refused(tmp_path):
    nested = write(tmp_path, "nested.py", HEAD + "train.amp.enabeld = True\n")
    message = error_of(nested)
    assert "line 3: Unknown config key 'train.amp.enabeld'" in message
    assert "Did you mean: 'train.amp.enabled'" in message
    updated = write(tmp_path, "updated.py", HEAD + "train.update(\n    output_dir='x',\n    log_periode=1,\n)\n")
    message = error_of(updated)
    assert "line 5: Unknown config key 'train.log_periode'" in message and "'train.log_period'" in message


def test_a_typo_in_an_imported_config_file_names_that_file(tmp_path):
    write(tmp_path, "base.py", HEAD + "train.evaluation.eval_perod = 3\n")
    top = write(tmp_path, "top.py", "from .base import train\ntrain.train_iter = 5\n")
    message = error_of(top)
    assert f"In config file {(tmp_path / 'base.py').resolve()}, line 3:" in message
    assert "'train.evaluation.eval_period'" in message


def saved_yaml(tmp_path: Path, recipe: str = "gpt_debug") -> Path:
    return LazyConfig.save(get_config(recipe), tmp_path / "config.yaml")


def edit_yaml(path: Path, after: str, line: str) -> Path:
    """Insert `line` after the first line equal to `after` (indentation included)."""
    lines = path.read_text().splitlines()
    lines.insert(lines.index(after) + 1, line)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_typo_in_a_yaml_config_names_file_line_key_and_closest_key(tmp_path):
    path = edit_yaml(saved_yaml(tmp_path), "  train_iter: 20", "  trian_iter: 3")
    line = path.read_text().splitlines().index("  trian_iter: 3") + 1
    message = error_of(path)
    assert message.startswith(f"In config file {path}, line {line}: Unknown config key 'train.trian_iter'")
    assert "Did you mean: 'train.train_iter'" in message


@pytest.mark.parametrize("old, new, bad, key, expected", [
    ("  num_layers: 2\n", "  num_layers: 2\n  num_heads_typo: 4\n", "  num_heads_typo: 4", "model.num_heads_typo",
     "is not a parameter of"),
    ("  log_period: 1\n", '  log_period: "1"\n', '  log_period: "1"', "train.log_period", "expects an int"),
    ("    enabled: true\n    eval_period", "    enabled: maybe\n    eval_period", "    enabled: maybe",
     "train.evaluation.enabled", "expects a bool"),
    ("    timeout_minutes: 10.0\n", "    timeout_minutes: 1e-3\n", "    timeout_minutes: 1e-3",
     "train.dist.timeout_minutes", "1.0e-3"),  # YAML 1.1 reads 1e-3 as text: the message says so
])
def test_a_wrong_key_or_type_in_a_yaml_config_is_refused(tmp_path, old, new, bad, key, expected):
    path = saved_yaml(tmp_path)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    line = path.read_text().splitlines().index(bad) + 1
    message = error_of(path)
    assert message.startswith(f"In config file {path}, line {line}: "), message
    assert f"'{key}'" in message and expected in message


def test_num_layers_two_in_yaml_names_the_key_and_the_type(tmp_path):
    path = write(tmp_path, "model.yaml", "model:\n  _target_: dufu.models.gpt.GPTModel\n  num_layers: two\n")
    message = error_of(path)
    assert message.startswith(f"In config file {path}, line 3: Config key 'model.num_layers' expects an int")
    assert "'two' of type str" in message


def test_train_iter_as_text_in_yaml_is_refused(tmp_path):
    path = saved_yaml(tmp_path)
    path.write_text(path.read_text().replace("  train_iter: 20\n", "  train_iter: '3'\n"))
    message = error_of(path)
    assert "Config key 'train.train_iter' expects an int" in message and "'3' of type str" in message


def test_a_lazycall_keyword_typo_is_refused_with_the_closest_parameter(tmp_path):
    path = write(tmp_path, "model.py", "from dufu.config import get_config\nmodel = get_config('gpt_debug').model\n"
                                       "model.num_layrs = 3\n")
    message = error_of(path)
    assert "line 3: Config key 'model.num_layrs' is not a parameter of dufu.models.gpt.model.GPTModel" in message
    assert "Did you mean: 'model.num_layers'" in message
    assert "is not a parameter" in error_of(saved_yaml(tmp_path), "+model.num_layrs=3")


def test_a_target_taking_kwargs_or_without_a_signature_accepts_any_key(tmp_path):
    path = write(tmp_path, "free.py", "from dufu.config import LazyCall\nimport collections\nimport types\n"
                                      "a = LazyCall(types.SimpleNamespace)(anything=1)\n"
                                      "b = LazyCall(collections.OrderedDict)(x=1)\n")
    assert LazyConfig.load(path).a.anything == 1


def test_plus_keys_in_a_file_and_as_override_survive_yaml_and_validation(tmp_path):
    path = write(tmp_path, "extra.py", HEAD + "train.add(my_setting=3)\ntrain.amp.add(note='x')\n")
    cfg = LazyConfig.apply_overrides(LazyConfig.load(path), ["+train.other=[1, 2]", "train.my_setting=4"])
    assert (cfg.train.my_setting, cfg.train.amp.note, cfg.train.other) == (4, "x", [1, 2])
    assert cfg.train["_new_"] == ["my_setting", "other"] and cfg.train.amp["_new_"] == ["note"]
    reloaded = LazyConfig.load(LazyConfig.save(cfg, tmp_path / "config.yaml"))
    assert LazyConfig.to_yaml(reloaded) == LazyConfig.to_yaml(cfg)
    validate_train(reloaded)
    with pytest.raises(ConfigError, match="already exists"):
        cfg.train.add(train_iter=3)
    with pytest.raises(ConfigError, match="already exists"):
        LazyConfig.apply_overrides(cfg, ["+train.train_iter=3"])


def test_a_saved_config_round_trips_and_still_validates(tmp_path):
    cfg = validate_train(get_config("gpt_debug"))
    first = LazyConfig.save(cfg, tmp_path / "config.yaml")
    reloaded = LazyConfig.load(first)
    assert LazyConfig.to_yaml(reloaded) == LazyConfig.to_yaml(cfg)
    assert reloaded.train["_schema_"] == "dufu.engine.schema.Train"
    validate_train(reloaded)
    assert LazyConfig.save(reloaded, tmp_path / "again.yaml").read_text() == first.read_text()


def test_a_config_without_the_schema_marker_is_typed_and_completed_by_validate_train(tmp_path):
    cfg = get_config("gpt_debug")
    old = {k: v for k, v in cfg.train.items() if k not in ("_schema_", "generation", "device", "hooks")}
    old["dist"] = {"data_parallel_size": " Auto "}  # an old config.yaml, or a train built in code
    cfg.train = old
    validate_train(cfg, source="config file old.yaml")
    assert cfg.train.generation == schema_defaults(Train).generation and cfg.train.hooks == []
    assert cfg.train.dist.data_parallel_size == "auto" and cfg.train.dist.tensor_parallel_size == 1
    assert list(cfg.train) == ["_schema_", *schema_defaults(Train)]
    cfg.train.trian_iter = 3
    with pytest.raises(ConfigError, match=r"In config file old.yaml: Unknown config key 'train.trian_iter'"):
        validate_train(cfg, source="config file old.yaml")


def test_typed_values_take_their_declared_form():
    train = schema_node(Train, stop_after_minutes=5, train_micro_batch_size="AUTO")
    assert train.stop_after_minutes == 5.0 and type(train.stop_after_minutes) is float
    assert train.train_micro_batch_size == "auto"
    cfg = LazyConfig.apply_overrides(ConfigDict(train=train), ["train.dist.timeout_minutes=1",
                                                                "train.compile.enabled=false",
                                                                "train.dist.pipeline_parallel_size=Auto"])
    assert type(cfg.train.dist.timeout_minutes) is float and cfg.train.compile.enabled is False
    assert cfg.train.dist.pipeline_parallel_size == "auto"
    with pytest.raises(ConfigError, match=r"'train\.dist\.tensor_parallel_size' expects an int or 'auto'.*"
                                          r"It also takes the word 'auto'"):
        LazyConfig.apply_overrides(cfg, ["train.dist.tensor_parallel_size=two"])
    with pytest.raises(ConfigError, match=r"'train\.stop_at_iter' expects an int or None"):
        LazyConfig.apply_overrides(cfg, ["train.stop_at_iter=1.5"])
    with pytest.raises(ConfigError, match="group of keys"):
        LazyConfig.apply_overrides(cfg, ["train.amp=3"])


def test_hooks_are_lazycall_nodes():
    train = schema_node(Train, hooks=[LazyCall(collections.OrderedDict)(a=1)])
    assert train.hooks[0]["_target_"] is collections.OrderedDict
    with pytest.raises(ConfigError, match=r"'hooks' expects a list of LazyCall nodes"):
        schema_node(Train, hooks=["dufu.engine.hooks.Something"])


def test_the_auto_keys_are_the_ones_the_schema_lets_take_auto():
    train = schema_node(Train)
    for key in AUTO_KEYS:
        *parents, last = key.split(".")[1:]
        node = train
        for part in parents:
            node = node[part]
        node[last] = "auto"
    cfg = ConfigDict(train=train)
    validate_train(cfg)
    assert auto_layout_keys(cfg) == list(AUTO_KEYS)


def test_the_packaged_train_is_the_schemas_defaults_written_nowhere_else():
    packaged = get_config("common/train.py").train
    assert packaged == schema_node(Train)
    assert {k: v for k, v in packaged.items() if k != "_schema_"} == schema_defaults(Train)
    source = Path(dufu.config.__file__).parents[1] / "configs" / "common" / "train.py"
    literals = [n.value for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.Constant)]
    assert literals == [], f"configs/common/train.py restates values of the schema: {literals}"


def test_every_schema_field_has_a_type_the_checker_knows():
    from dufu.config.schema import field_types, nested_schema
    from dufu.config.typecheck import is_checkable

    def visit(schema, prefix):
        for name, (tp, _) in field_types(schema).items():
            assert is_checkable(tp), f"{prefix}{name}: {tp}"
            if nested_schema(tp) is not None:
                visit(nested_schema(tp), f"{prefix}{name}.")

    visit(Train, "train.")


def test_the_generic_config_layer_names_no_train_key():
    """Knowledge of train keys lives in dufu.engine.schema: no module of dufu.config assigns a constant that
    names one (the old SWITCH_OR_CHOICE, AUTO_KEYS and OPTIONAL_KEYS of overrides.py)."""
    root = Path(dufu.config.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for const in ast.walk(node.value) if node.value is not None else ():
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        assert not const.value.startswith("train."), f"{path.name}:{node.lineno}: {const.value}"


@dataclasses.dataclass
class Inner:
    size: int = 2


@dataclasses.dataclass
class Outer:
    name: str = "x"
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_any_dataclass_can_be_a_schema_named_by_the_class_itself():
    node = ConfigDict(_schema_=Outer, inner={"size": 3})
    dufu.config.check_config(node)
    assert node == {"_schema_": Outer, "name": "x", "inner": {"size": 3}}
    node.inner.sise = 4
    with pytest.raises(ConfigError, match=r"In here: Unknown config key 'inner\.sise'.*Did you mean: 'inner\.size'"):
        dufu.config.check_config(node, source="here")
