"""The ``CONFIG [key=value ...]`` arguments of `dufu train` and `dufu plan`: read them into a loaded config with the
overrides applied, and name the flags a command does not know."""

from __future__ import annotations

import os

from dufu.config import LazyConfig, resolve_config_path
from dufu.errors import DufuError


def load_train_config(config: str | None, overrides: list[str]):
    """The config file with the overrides applied, its ``train`` checked against the schema (defaults filled in)."""
    from dufu.engine.schema import validate_train  # the engine (and torch) only once a command runs, not for --help

    path = resolve_config_path(config or "default")
    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(path)), overrides)
    validate_train(cfg, source=f"config file {path}")
    return cfg


def parse_config_args(parser, argv: list[str], command: str):
    """(args, config or None, overrides) of a command taking ``CONFIG [key=value ...]``."""
    args, extra = parser.parse_known_args(argv)
    overrides = list(args.overrides) + extra
    # `dufu train train.train_iter=10` (no config): the first positional is an override, not a config.
    config = args.config
    if config is not None and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    refuse_unknown_flags(overrides, command)
    return args, config, overrides


def refuse_unknown_flags(overrides: list[str], command: str) -> None:
    """argparse leaves flags it does not know among the key=value overrides: name them."""
    unknown_flags = [o for o in overrides if o.startswith("-")]
    if unknown_flags:
        raise DufuError(f"unknown option(s) {' '.join(unknown_flags)} for `dufu {command}`; see "
                        f"`dufu {command} --help`.")
