"""A dataset and the run's tokenizer agree: ``dufu preprocess`` then ``dufu train`` as the README writes them.

A preprocessed dataset carries its tokenizer; a run on it adopts that tokenizer when the config names another,
says so, saves it as the run's tokenizer.json and writes it into config.yaml. A blend of datasets made with
different tokenizers is refused.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from dufu.config.loader import load
from dufu.data.dataset import data_tokenizer_file
from dufu.data.preprocess import preprocess
from dufu.data.tokenizer import Tokenizer, build_tokenizer
from dufu.errors import DataError

README = Path(__file__).resolve().parents[2] / "README.md"
SHORT = ("train.train_iter=2", "train.log_period=1", "train.evaluation.enabled=False", "train.amp.enabled=False",
         "train.generation.enabled=False")


def readme_commands() -> list[str]:
    """The shell lines of the README's block under "Your own text"."""
    section = README.read_text().split("Your own text", 1)
    assert len(section) == 2, "README.md has no section 'Your own text'"
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    assert block, "the README's 'Your own text' section has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()
            and not line.startswith("#")]


def test_the_readmes_preprocess_then_train_commands_work(tmp_path, run_cli):
    import launch

    lines = readme_commands()
    assert any(line.startswith("dufu preprocess") for line in lines) and lines[-1].startswith("dufu train")
    for line in lines:
        words = shlex.split(line)
        if words[0] == "dufu":
            extra = [*SHORT, f"train.output_dir={tmp_path / 'out'}"] if words[1] == "train" else []
            proc = run_cli(*words[1:], *extra, timeout=600)
        else:  # the line that writes the example corpus
            proc = launch.run(["bash", "-c", line.replace("python ", f"{launch.sys.executable} ", 1)], cwd=tmp_path)
        assert proc.returncode == 0, proc.describe()
    out = tmp_path / "out"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1, 2]
    prefix = re.search(r"--output-prefix (\S+)", " ".join(lines)).group(1)
    data_tok = Tokenizer.from_file(tmp_path / f"{prefix}.tokenizer.json")
    assert Tokenizer.from_file(out / "tokenizer.json").fingerprint == data_tok.fingerprint
    assert "training with the data's" in proc.output
    saved = load(out / "config.yaml").tokenization.tokenizer
    assert saved.kind == "pretrained" and Path(saved.path) == (tmp_path / f"{prefix}.tokenizer.json").resolve()


def test_a_run_adopts_a_smaller_data_tokenizer(tmp_path, train_run):
    small = build_tokenizer("bpe", vocab_size=300, corpus="builtin")
    prefix = preprocess("builtin", tmp_path / "ds", small, show_progress=False)
    small.save(prefix + ".tokenizer.json")
    run = train_run(f"dataloader.train.data_path={prefix}")  # gpt_debug: a 257-token byte tokenizer
    assert Tokenizer.from_file(run.output_dir / "tokenizer.json").fingerprint == small.fingerprint
    assert load(run.output_dir / "config.yaml").tokenization.tokenizer.kind == "pretrained"


def test_data_tokenizer_file(tmp_path):
    byte = build_tokenizer("byte")
    a = preprocess("builtin", tmp_path / "a", byte, show_progress=False)
    byte.save(a + ".tokenizer.json")
    b = preprocess("builtin", tmp_path / "b", byte, show_progress=False)  # carries none
    assert data_tokenizer_file(a) == Path(a + ".tokenizer.json")
    assert data_tokenizer_file(b) is None and data_tokenizer_file("builtin") is None
    assert data_tokenizer_file(f"0.5 {a} 0.5 {b}") == Path(a + ".tokenizer.json")
    other = build_tokenizer("bpe", vocab_size=300, corpus="builtin")
    other.save(b + ".tokenizer.json")
    with pytest.raises(DataError, match="preprocessed with different tokenizers"):
        data_tokenizer_file(f"0.5 {a} 0.5 {b}")
