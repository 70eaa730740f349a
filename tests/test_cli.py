"""The `dufu` command line: user errors are one paragraph and exit code 2, and they change nothing on disk.

Most cases call ``dufu.cli.main(argv)`` in this process (the same code path as the console script,
without ~3 s of imports per case); a few run ``python -m dufu`` in a subprocess to check the real exit
code and that no traceback reaches stderr.
"""

from __future__ import annotations

import json

import pytest
import yaml

from dufu.cli import main
from dufu.config import list_recipes
from dufu_testing import FAST, snapshot

TINY = [*FAST, "train.train_iter=2", "train.checkpointer.period=0"]


def assert_one_paragraph_error(stderr: str, *fragments: str) -> str:
    """stderr ends with one short paragraph starting "error: " (progress output, e.g. from tokenizing a
    corpus on first use, may come before it), contains no traceback, and names every fragment."""
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(starts) == 1, f"expected one error message:\n{stderr}"
    paragraph = lines[starts[0]:]
    assert all(line.strip() for line in paragraph) and len(paragraph) <= 8, f"not one short paragraph:\n{stderr}"
    joined = " ".join(" ".join(paragraph).split())
    for fragment in fragments:
        assert fragment in joined, f"{fragment!r} not in: {joined}"
    return joined


@pytest.fixture
def garbage_tokenizer(tmp_path):
    path = tmp_path / "garbage.json"
    path.write_bytes(b"\x00\x01 this is not a tokenizer.json \xff")
    return path


# (name, config, overrides, phrases the message must contain); "{garbage}" is the garbage tokenizer file.
ERROR_CASES = [
    ("unknown key", "gpt_debug", ["train.trian_iter=3"],
     ["Unknown config key 'train.trian_iter'", "Did you mean: 'train.train_iter'"]),
    ("wrong type", "gpt_debug", ["train.train_iter=abc"],
     ["'train.train_iter' expects an int", "'abc'"]),
    ("unknown recipe", "gpt_debgu", [],
     ["'gpt_debgu' is neither an existing config file nor a packaged recipe", "Did you mean: 'gpt_debug'"]),
    ("inconsistent batch", "gpt_debug", ["train.train_micro_batch_size=4", "train.global_batch_size=10"],
     ["global_batch_size 10", "train_micro_batch_size 4 x data_parallel_size 1 = 4"]),
    ("missing data", "gpt_debug", ["dataloader.train.data_path=/nonexistent.txt"],
     ["'/nonexistent.txt' does not exist"]),
    ("unreadable tokenizer", "gpt_debug",
     ["tokenization.tokenizer.kind=pretrained", "tokenization.tokenizer.path={garbage}"],
     ["{garbage} could not be read as a tokenizer.json"]),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_user_error_into_a_new_output_dir(case, tmp_path, monkeypatch, capsys, garbage_tokenizer):
    _, config, overrides, phrases = case
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new_run"
    argv = ["train", config, *TINY, f"train.output_dir={out}", *overrides]
    argv = [a.replace("{garbage}", str(garbage_tokenizer)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_paragraph_error(captured.err, *(p.replace("{garbage}", str(garbage_tokenizer)) for p in phrases))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.json"]  # nothing else created either


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_user_error_leaves_an_existing_run_untouched(case, copy_run, monkeypatch, capsys, garbage_tokenizer):
    _, config, overrides, phrases = case
    out = copy_run()
    monkeypatch.chdir(out.parent)
    before = snapshot(out)
    # --resume gets past the "directory already holds a run" check, so every error below happens
    # as late as it can: after the config is loaded and the run directory has been looked at.
    argv = ["train", config, "--resume", *TINY, f"train.output_dir={out}", *overrides]
    argv = [a.replace("{garbage}", str(garbage_tokenizer)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert_one_paragraph_error(captured.err, *(p.replace("{garbage}", str(garbage_tokenizer)) for p in phrases))
    assert snapshot(out) == before


def test_new_run_into_an_existing_run_dir_is_refused(copy_run, capsys):
    out = copy_run()
    before = snapshot(out)
    assert main(["train", "gpt_debug", *TINY, f"train.output_dir={out}"]) == 2
    assert_one_paragraph_error(capsys.readouterr().err, f"'{out}' already holds a run", "Nothing was changed",
                               "--resume")
    assert snapshot(out) == before


def test_resume_without_a_checkpoint_starts_at_step_0_and_says_so(tmp_path, capsys):
    # A restartable job script always passes --resume; its first attempt may have died before any checkpoint
    # (here: a directory with a partial save and a metrics file of the dead attempt).
    out = tmp_path / "first_attempt_died"
    (out / "checkpoints" / ".step_0000002.partial").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    assert main(["train", "gpt_debug", "--resume", *TINY, f"train.output_dir={out}"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "holds no complete checkpoint yet, so this run starts at step 0" in said
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and records[0]["loss"] != 9.0  # the dead attempt's record is gone


def test_max_restarts_without_periodic_checkpoints_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "gpt_debug", "--nproc", "2", "--max-restarts", "2", *TINY, f"train.output_dir={out}"]
    assert main(argv) == 2
    assert_one_paragraph_error(capsys.readouterr().err, "--max-restarts 2 with periodic checkpoints turned off",
                               "would begin again at step 0", "train.checkpointer.period=100")
    assert not out.exists()


def test_an_elastic_range_whose_smallest_world_cannot_hold_the_layout_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "gpt_debug", "--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint", "localhost:29999",
            "train.dist.tensor_parallel_size=4", "train.dist.data_parallel_size=-1", *TINY,
            f"train.output_dir={out}"]
    assert main(argv) == 2
    assert_one_paragraph_error(capsys.readouterr().err, "--nnodes 1:2 lets the job run on 1 node(s) x 2 processes = 2",
                               "cannot infer train.dist.data_parallel_size", "train.dist.data_parallel_size=-1")
    assert not out.exists()


def test_unknown_option_and_command(capsys):
    assert main(["train", "gpt_debug", "--frobnicate"]) == 2
    assert_one_paragraph_error(capsys.readouterr().err, "unknown option(s) --frobnicate")
    assert main(["trian"]) == 2
    assert_one_paragraph_error(capsys.readouterr().err, "unknown command 'trian'", "did you mean 'train'?")


def test_show_config_prints_the_resolved_config(tmp_path, capsys):
    out = tmp_path / "never_created"
    assert main(["train", "gpt_debug", "--show-config", "train.train_iter=7", f"train.output_dir={out}"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["train_iter"] == 7
    assert shown["model"]["_target_"] == "dufu.models.gpt.model.GPTModel"
    assert not out.exists()


def test_train_then_resume_through_the_cli(tmp_path, capsys):
    out = tmp_path / "cli_run"
    assert main(["train", "gpt_debug", *FAST, "train.train_iter=4", "train.stop_at_iter=2",
                 "train.checkpointer.period=0", f"train.output_dir={out}"]) == 0
    assert (out / "checkpoints" / "step_0000002" / "manifest.json").is_file()
    assert not (out / "checkpoints" / "step_0000004").exists()
    capsys.readouterr()
    # The saved config.yaml is a valid CONFIG argument, and alone continues the run for its 2 remaining steps.
    assert main(["train", str(out / "config.yaml"), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (out / "checkpoints" / "step_0000004" / "manifest.json").is_file()


def test_value_rejected_by_a_constructor_is_a_user_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "gpt_debug", *TINY, f"train.output_dir={out}", "model.num_attention_heads=5"]) == 2
    assert_one_paragraph_error(capsys.readouterr().err, "num_attention_heads", "5")
    assert not out.exists()


# ------------------------------------------------------------------ real processes


def test_cli_process_unknown_key_exits_2_without_traceback(copy_run, run_cli):
    out = copy_run()
    before = snapshot(out)
    proc = run_cli("train", "gpt_debug", f"train.output_dir={out}", "train.trian_iter=3")
    assert proc.returncode == 2, proc.stderr
    assert_one_paragraph_error(proc.stderr, "Unknown config key 'train.trian_iter'", "'train.train_iter'")
    assert proc.stdout == ""
    assert snapshot(out) == before


def test_cli_process_recipes_and_unknown_recipe(run_cli, tmp_path):
    proc = run_cli("configs")
    assert proc.returncode == 0
    # a recipe's line starts with two spaces and its name; its description may go on in lines indented further
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ") and line[2] != " "]
    assert listed == list_recipes()
    proc = run_cli("train", "no_such_recipe")
    assert proc.returncode == 2
    assert_one_paragraph_error(proc.stderr, "'no_such_recipe' is neither an existing config file")
    assert list(tmp_path.iterdir()) == []  # ran in tmp_path; nothing written


# ------------------------------------------------------------------ the package


def test_every_command_runs_from_a_module_with_main():
    import importlib

    from dufu.cli import COMMANDS, USAGE

    for command, module in COMMANDS.items():
        assert callable(importlib.import_module(module).main), module
        assert f"\n  {command}" in USAGE, f"`dufu --help` does not list {command}"


def test_help_and_argument_errors_do_not_import_torch(tmp_path):
    # `dufu --help`, `dufu --version`, `dufu configs` and the --help of the commands that take a config answer in a
    # fraction of a second: dufu.cli imports a subcommand's module only when it runs, and those modules import torch
    # only when they need it.
    import subprocess
    import sys

    code = ("import sys\nfrom dufu.cli import main\n"
            "for argv in (['--help'], ['--version'], ['train', '--help'], ['eval', '--help'], ['plan', '--help'],\n"
            "             ['configs', 'llama']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
