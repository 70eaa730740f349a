"""dufu's config system: plain-Python configs in the style of detectron2's LazyConfig.

A config is a tree of `ConfigDict` nodes. A node made with
``LazyCall(Cls)(a=1)`` records a call; `instantiate` makes it. Recipes derive
from shared configs with relative imports and a few edits::

    # dufu/configs/gpt2_small.py
    from .common.train import train
    from .common.models.gpt import model

    model.num_layers = 12
    train.train_iter = 10_000

A namespace with a schema (``train``: `dufu.engine.schema.Train`) is a typed
node that names its schema dataclass, as a LazyCall node names its callable
(`dufu.config.schema`). `LazyConfig` loads ``.py``/``.yaml`` files and applies
command-line overrides, checking both the same way (an unknown key or a value
of the wrong type is an error naming the closest keys); it saves YAML that
reproduces a run and prints a config back as Python.
"""

from .instantiate import callable_path, instantiate, locate
from .lazy import LazyCall
from .lazy_config import LazyConfig
from .node import ConfigDict, ConfigKeyError, flatten
from .overrides import parse_value
from .packaged import get_config, list_recipes, resolve_config_path
from .schema import check_config, schema_defaults, schema_node
from .typecheck import Lazy

__all__ = [
    "ConfigDict",
    "ConfigKeyError",
    "Lazy",
    "LazyCall",
    "LazyConfig",
    "callable_path",
    "check_config",
    "flatten",
    "get_config",
    "instantiate",
    "list_recipes",
    "locate",
    "parse_value",
    "resolve_config_path",
    "schema_defaults",
    "schema_node",
]
