"""A config of one's own, in one's own folder, as the README writes it.

The README's example (the python block under "A config of your own") is saved outside the package and trained
with ``dufu train`` from that folder, so the documented form is the tested one. A recipe's relative imports copied
out of the package fail with the absolute import that works; two configs loaded in one process that import the
same packaged node each get their own copy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dufu.config.loader import load
from dufu.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text.split("A config of your own", 1)
    assert len(section) == 2, "README.md has no section 'A config of your own'"
    block = re.search(r"```python\n(.*?)```", section[1], re.S)
    assert block, "the README's 'A config of your own' section has no python block"
    return block.group(1)


def test_the_readme_example_trains_from_its_own_folder(tmp_path, run_cli):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "my_config.py").write_text(readme_example())
    out = folder / "out"
    proc = run_cli("train", "my_config.py", "train.train_iter=2", "train.log_period=1", f"train.output_dir={out}",
                   "train.evaluation.enabled=False", "train.checkpointer.period=1000", "train.amp.enabled=False",
                   cwd=folder, timeout=300)
    assert proc.returncode == 0, proc.describe()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
    saved = load(out / "config.yaml")
    assert saved.model.num_layers == 2 and saved.train.train_iter == 2  # the file's edits and the override


def test_a_recipes_relative_import_outside_the_package_names_the_absolute_one(tmp_path):
    path = tmp_path / "copied.py"
    path.write_text("from .common.train import train\ntrain.train_iter = 3\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert "`from dufu.configs.common.train import train`" in str(info.value)


def test_packaged_nodes_are_fresh_for_every_config(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from dufu.configs.common.train import train\ntrain.train_iter = 7\n")
    b.write_text("from dufu.configs.common.train import train\n")
    first, second = load(a), load(b)
    assert first.train.train_iter == 7 and second.train.train_iter != 7
    assert first.train is not second.train
