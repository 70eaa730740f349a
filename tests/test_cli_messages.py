"""What a new user meets first in the command line and the run summary: an optional package that is not installed
is one line naming the pip command (exit code 2), `dufu --version`, `dufu configs [WORD ...]` with whole
sentences, `dufu generate --help` with its defaults and a notice past the model's positions, the end summary's
wording and file list, the resume hint as a working command, and weight files as readable as the rest."""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import stat
import sys
import tomllib
from pathlib import Path

import pytest

import dufu
import launch
from dufu.cli import OPTIONAL_PACKAGES, install_command, main as cli_main
from dufu.cli.configs import describe_recipes, first_sentence, format_listing, opening_comment
from dufu.cli.generate import build_parser as generate_parser, context_notice
from dufu.config import list_recipes, resolve_config_path
from dufu.engine.reporting.report import change, summary_text, written_files
from dufu.engine.resilience.preemption import resume_command_here
from dufu_testing import train

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==" + importlib.metadata.version("torch").split("+")[0]


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------ optional packages


def test_the_named_extras_are_pyprojects():
    """Each extra a message names exists in pyproject.toml and installs the package; a package named without an
    extra has none of its own there (once one is added, OPTIONAL_PACKAGES must name it)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def package_of(requirement: str) -> str:
        return requirement.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()

    for package, extra in OPTIONAL_PACKAGES.items():
        if extra is not None:
            assert package in map(package_of, extras[extra]), (package, extra, extras[extra])
            assert install_command(package) == f'pip install "dufu[{extra}]" {TORCH_PIN}'
        else:
            alone = [name for name, reqs in extras.items() if list(map(package_of, reqs)) == [package]]
            assert alone == [], f"pyproject.toml's extra {alone} installs {package}: name it in OPTIONAL_PACKAGES"
            assert install_command(package) == f"pip install {package} {TORCH_PIN}"


def test_quantize_without_torchao_is_one_line_in_a_real_process(tmp_path):
    """torchao hidden from the interpreter (sys.modules["torchao"] = None, set by a sitecustomize at start-up, is
    what an absent package looks like to both `import` and importlib.util.find_spec): exit code 2, one line."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
    source, out = tmp_path / "source", tmp_path / "q8"
    source.mkdir()
    proc = launch.run(launch.dufu_command("quantize", source, "--scheme", "int8-weight", "--output", out),
                      cwd=tmp_path, timeout=120, env={"PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)])})
    assert proc.returncode == 2, proc.stderr
    assert _one_line_error(proc.stderr) == (f"error: dufu quantize needs torchao, which is not installed: "
                                            f"pip install \"dufu[quant]\" {TORCH_PIN}")
    assert not out.exists()


def test_lighthouse_without_torchft_names_the_ft_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchft", None)
    assert cli_main(["lighthouse", "--bind", "[::]:0"]) == 2
    assert _one_line_error(capsys.readouterr().err) == (
        f'error: dufu lighthouse needs torchft, which is not installed: pip install "dufu[ft]" {TORCH_PIN}')


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_quantized_directory_without_torchao_says_so_before_loading(command, tmp_path, monkeypatch, capsys):
    from dufu.compress.quantize_io import MANIFEST

    (tmp_path / MANIFEST).write_text("{}")  # what marks a `dufu quantize` directory; torchao is asked for first
    monkeypatch.setitem(sys.modules, "torchao", None)
    argv = [command, str(tmp_path)] + (["--prompt", "The "] if command == "generate" else [])
    assert cli_main(argv) == 2
    assert _one_line_error(capsys.readouterr().err) == (
        f"error: dufu {command} needs torchao, which is not installed: pip install \"dufu[quant]\" {TORCH_PIN}")


def test_an_optional_import_deep_in_a_command_becomes_the_same_line(monkeypatch, capsys):
    """Wherever a command imports an optional package (dufu.data.hf_datasets, the torchft hook, ...), an absent
    one ends as that line; a missing module that is no optional package keeps its traceback (a broken install)."""
    import dufu.cli.configs

    def needs(module):
        def command(argv):
            __import__(module)
        return command

    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(dufu.cli.configs, "main", needs("datasets.arrow_dataset"))
    assert cli_main(["configs"]) == 2
    assert _one_line_error(capsys.readouterr().err) == (
        f'error: dufu configs needs datasets, which is not installed: pip install "dufu[hf]" {TORCH_PIN}')
    monkeypatch.setattr(dufu.cli.configs, "main", needs("dufu_no_such_module"))
    with pytest.raises(ModuleNotFoundError, match="dufu_no_such_module"):
        cli_main(["configs"])


def test_an_installed_package_without_the_module_asks_for_an_upgrade(monkeypatch, capsys):
    pytest.importorskip("datasets")
    import dufu.cli.configs

    monkeypatch.setattr(dufu.cli.configs, "main", lambda argv: __import__("datasets.no_such_part"))
    assert cli_main(["configs"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "dufu configs needs datasets.no_such_part, which the installed datasets" in err
    assert f'pip install "dufu[hf]" {TORCH_PIN} --upgrade' in err and "Traceback" not in err


# ------------------------------------------------------------------ --version


def test_version(capsys):
    assert cli_main(["--version"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"dufu {dufu.__version__} (torch {importlib.metadata.version('torch')}, Python ")
    assert dufu.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


# ------------------------------------------------------------------ dufu configs


def _listed(out: str) -> dict[str, str]:
    """name -> description (continuation lines joined) of `dufu configs` output."""
    entries: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            entries[name] = text.strip()
        elif line.strip():
            entries[name] += " " + line.strip()
    return entries


def test_configs_shows_whole_first_sentences_wrapped(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "90")
    assert cli_main(["configs"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 90
    listed = _listed(out)
    assert list(listed) == list_recipes()
    for name, text in listed.items():
        assert text == first_sentence(opening_comment(resolve_config_path(name).read_text())), name
    # the default recipe's comment runs on after its first sentence, over a line break of the file
    assert listed["default"].endswith("ending with a few generated samples.")
    assert listed["roberta_base"].startswith("RoBERTa-base (Liu et al. 2019): BERT-base's network")
    one = "A model (Liu et al. 2019), e.g. this one."
    assert first_sentence(f"{one} Second.") == one


def test_configs_filters_by_name_or_description(capsys):
    assert cli_main(["configs", "LLaMA"]) == 0
    listed = _listed(capsys.readouterr().out)
    assert {"llama_debug", "llama_sft", "gpt_sft"} <= set(listed)  # gpt_sft: "as llama_sft does for LLaMA"
    assert "gpt_debug" not in listed and "bert_base" not in listed
    assert all("llama" in f"{n} {d}".lower() for n, d in listed.items())
    assert cli_main(["configs", "tiny", "llama"]) == 0  # every word must match
    listed = _listed(capsys.readouterr().out)
    assert {"llama_debug", "llama_lora_debug"} <= set(listed) and "llama_sft" not in listed
    assert all("tiny" in f"{n} {d}".lower() and "llama" in f"{n} {d}".lower() for n, d in listed.items())
    assert cli_main(["configs", "no-such-thing"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no packaged recipe has 'no-such-thing' in its name or description" in err


def test_configs_listing_never_cuts_a_word():
    recipes = describe_recipes()
    text = format_listing(recipes, width=60)
    assert _listed(text) == dict(recipes)


# ------------------------------------------------------------------ dufu generate


def _option_help(text: str, option: str) -> str:
    """The help of ``option`` in argparse's --help text (its lines up to the next option), whitespace joined."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {option}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -") or not lines[i].strip()),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_generate_help_shows_the_defaults():
    text = generate_parser().format_help()
    for option, default in (("--max-new-tokens", "64"), ("--temperature", "0.8"), ("--seed", "0"),
                            ("--num-beams", "1"), ("--repetition-penalty", "1.0"), ("--device", "cpu")):
        assert _option_help(text, option).endswith(f"(default: {default})"), _option_help(text, option)
    for option in ("--greedy", "--prompt", "--stop"):  # off, or nothing, by default: no "(default: False)"
        assert "(default" not in _option_help(text, option)


def test_context_notice_counts_the_positions():
    # 4 prompt tokens and 32 positions: the 29th new token is predicted from 32 tokens, the 30th from 33
    assert context_notice(4, 29, 32) is None and context_notice(4, 30, None) is None
    notice = context_notice(4, 30, 32)
    assert "(4 tokens) + --max-new-tokens 30" in notice and "32 positions" in notice
    assert "after 29 new tokens" in notice and "--max-new-tokens 29 stays within" in notice
    assert "more than the model's 32 positions" in context_notice(40, 1, 32)


def test_generate_past_the_positions_says_so_and_slides_the_window(debug_run, capsys):
    """gpt_debug has 32 positions; "The " is 4 bytes. 29 new tokens: one forward over the prompt, then one token
    at a time; 30: the 30th forward is a refill of the last 32 tokens, as the notice says."""
    from dufu.cli.generate import generate_texts, load_for_generation

    model, tokenizer, _ = load_for_generation(debug_run.output_dir)
    widths = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    for new, notice in ((29, False), (30, True)):
        widths.clear()
        args = generate_parser().parse_args([str(debug_run.output_dir), "--prompt", "The ", "--greedy",
                                             "--max-new-tokens", str(new)])
        capsys.readouterr()
        generate_texts(model, tokenizer, None, ["The "], args)  # eos None: all tokens are generated
        err = capsys.readouterr().err
        assert ("notice: the longest prompt (4 tokens) + --max-new-tokens 30" in err) == notice, err
        assert widths == [4] + [1] * 28 + ([32] if notice else []), widths
    assert cli_main(["generate", str(debug_run.output_dir), "--prompt", "The ", "--max-new-tokens", "40"]) == 0
    assert "after 29 new tokens the model sees only the last 32 tokens" in " ".join(capsys.readouterr().err.split())


# ------------------------------------------------------------------ the end summary


def _summary(**values) -> dict:
    return {"steps": 10, "seconds": 1.0, "final_step": 10, "final_loss": 3.0, **values}


def test_summary_words_the_perplexity_change(tmp_path):
    rose = summary_text(_summary(eval_ppl_start=40.0, eval_ppl_end=52.0, eval_steps=(5, 10)), tmp_path)
    assert "40.0 -> 52.00  (1.3x higher)" in rose and "lower" not in rose
    assert change(100.0, 97.0) == "3.0% lower" and change(100.0, 104.0) == "4.0% higher"
    assert change(400.0, 40.0) == "10.0x lower" and change(7.0, 7.0) == "unchanged"
    once = summary_text(_summary(eval_ppl_start=40.0, eval_ppl_end=40.0, eval_steps=(10, 10)), tmp_path)
    assert "validation ppl       40.00 (step 10, the only evaluation)" in once and "->" not in once


def test_summary_lists_only_what_the_run_wrote(tmp_path):
    (tmp_path / "config.yaml").write_text("")
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "fault_tolerance.jsonl").write_text("")
    assert written_files(tmp_path) == ["config.yaml", "metrics.jsonl", "checkpoints/", "fault_tolerance.jsonl"]
    text = summary_text(_summary(), tmp_path)
    assert f"written to           {tmp_path}/ (config.yaml, metrics.jsonl, checkpoints/, fault_tolerance.jsonl)" in text


def test_a_stopped_run_prints_a_resume_command_that_works(tmp_path, capsys):
    """A run without TensorBoard does not list tensorboard/; its "continue with" command, run as printed,
    continues it; a job of N processes per node is told --nproc N."""
    out = tmp_path / "run"
    run = train(out, ["train.train_iter=3", "train.stop_at_iter=1", "train.checkpointer.period=0"])
    said = "\n".join(run.log)
    written = next(line for line in said.splitlines() if "written to" in line)
    assert "tensorboard/" not in written and "checkpoints/" in written and "loss.png" in written
    hint = next(line for line in said.splitlines() if "continue with: " in line).split("continue with: ", 1)[1]
    assert hint == shlex.join(["dufu", "train", str(out / "config.yaml"), "--resume"])
    assert cli_main(shlex.split(hint)[1:]) == 0
    assert (out / "checkpoints" / "step_0000003").is_dir()
    two = resume_command_here(out, environ={"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"})
    assert shlex.split(two) == ["dufu", "train", str(out / "config.yaml"), "--nproc", "2", "--resume"]


# ------------------------------------------------------------------ weight files' mode


@pytest.fixture
def umask():
    def set_mask(mask: int) -> int:
        os.umask(mask)
        return 0o666 & ~mask

    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_converted_weights_have_the_mode_of_the_other_files(debug_run, tmp_path, umask, mask):
    expected = umask(mask)
    out = tmp_path / "hf"
    assert cli_main(["convert", str(debug_run.output_dir), "--to-hf", str(out)]) == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"model.safetensors": expected, "config.json": expected, "tokenizer.json": expected}


def test_save_pretrained_and_quantize_write_weights_like_the_other_files(debug_run, tmp_path, umask):
    expected = umask(0o022)
    from dufu.engine.weights.pretrained import pretrained_model

    saved = dufu.save_pretrained(pretrained_model(debug_run.output_dir), tmp_path / "saved")
    assert stat.S_IMODE((saved / "model.safetensors").stat().st_mode) == expected
    pytest.importorskip("torchao")
    from dufu.cli.quantize import quantize_to

    out = quantize_to(debug_run.output_dir, "int8-weight", tmp_path / "q8")
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {expected}
