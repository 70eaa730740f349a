"""`dufu eval`: a run's, a checkpoint's or a Hugging Face directory's validation numbers, by default the batches and
the eval_loss the run logged, and the same in every layout."""

from __future__ import annotations

import json

import pytest

import launch
from dufu.cli import main as cli_main
from dufu.cli.eval import evaluate_source
from dufu.errors import ConfigError, DataError
from dufu_testing import read_records


def _logged_eval(run_dir, step: int) -> dict:
    return next(r for r in read_records(run_dir) if r.get("step") == step and "eval_loss" in r)


def test_eval_equals_the_runs_own_evaluation(debug_run):
    """The session's run evaluates train.evaluation.eval_iter=2 global batches at steps 5 and 10: `dufu eval`
    evaluates the same batches by default and gives the same loss, read from the newest checkpoint; the step-5
    checkpoint gives that step's. --whole-split evaluates every whole batch of the split instead."""
    logged = _logged_eval(debug_run.output_dir, 10)
    got = evaluate_source(str(debug_run.output_dir))
    assert got["step"] == 10 and got["batches"] == 2 and got["eval_samples"] == logged["eval_samples"]
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], abs=1e-6)
    assert got["eval_ppl"] == pytest.approx(logged["eval_ppl"], rel=1e-5)
    early = evaluate_source(str(debug_run.output_dir / "checkpoints" / "step_0000005"))
    assert early["step"] == 5
    assert early["eval_loss"] == pytest.approx(_logged_eval(debug_run.output_dir, 5)["eval_loss"], abs=1e-6)
    assert evaluate_source(str(debug_run.output_dir), eval_iter=2)["eval_loss"] == got["eval_loss"]
    whole = evaluate_source(str(debug_run.output_dir), whole_split=True)
    assert whole["batches"] * whole["global_batch_size"] == whole["eval_samples"] > got["eval_samples"]
    assert whole["batches_chosen_by"] == "all of it"


@pytest.mark.parametrize("checkpoint, step", [("", 10), ("checkpoints/step_0000005", 5)])
def test_dufu_eval_prints_the_logged_eval_loss_of_the_checkpoints_step(debug_run, capsys, checkpoint, step):
    """`dufu eval RUN` with no option prints, to its 4 decimals, the eval_loss the run logged at the step of the
    checkpoint it reads, and says which batches it took."""
    logged = _logged_eval(debug_run.output_dir, step)
    capsys.readouterr()
    assert cli_main(["eval", str(debug_run.output_dir / checkpoint)]) == 0
    out = capsys.readouterr().out
    assert f"(dufu checkpoint, step {step})" in out
    printed = float(next(line for line in out.splitlines() if line.strip().startswith("eval_loss")).split()[1])
    assert printed == pytest.approx(logged["eval_loss"], abs=5.1e-5)  # printed with 4 decimals
    assert "train.evaluation.eval_iter=2, as training evaluates; --whole-split:" in out


def test_eval_of_the_exported_hf_directory_and_of_a_file(debug_run, tmp_path, capsys):
    """The run as a Hugging Face directory evaluates to the same loss on the recipe's data; --data evaluates all of
    a text file; --json prints one object."""
    hf = tmp_path / "hf"
    assert cli_main(["convert", str(debug_run.output_dir), "--to-hf", str(hf)]) == 0
    ours = evaluate_source(str(debug_run.output_dir), eval_iter=4)
    capsys.readouterr()
    assert cli_main(["eval", str(hf), "--config", "gpt_debug", "--eval-iter", "4", "--json"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert theirs["kind"] == "Hugging Face directory"
    assert theirs["eval_loss"] == pytest.approx(ours["eval_loss"], abs=1e-5)
    text = tmp_path / "notes.txt"
    text.write_text("A small file of English text, evaluated from its first token to its last. " * 40)
    got = evaluate_source(str(debug_run.output_dir), data=str(text))
    tokens = len(text.read_text().encode()) + 1  # gpt_debug's tokenizer: bytes, and an end-of-document token
    samples = (tokens - 1) // got["seq_length"]  # every sample holds seq_length + 1 tokens, overlapping by one
    assert got["data"] == str(text)
    assert got["eval_samples"] == samples // got["global_batch_size"] * got["global_batch_size"] > 0


def test_eval_errors_say_what_to_do(debug_run, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        evaluate_source(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="--config applies to a Hugging Face directory"):
        evaluate_source(str(debug_run.output_dir), config="gpt_debug")
    with pytest.raises(ConfigError, match="--eval-iter 0"):
        evaluate_source(str(debug_run.output_dir), eval_iter=0)
    with pytest.raises(ConfigError, match="--eval-iter 3 and --whole-split ask for two different amounts"):
        evaluate_source(str(debug_run.output_dir), eval_iter=3, whole_split=True)
    with pytest.raises(ConfigError, match="--data FILE evaluates all of the file already"):
        evaluate_source(str(debug_run.output_dir), data=str(tmp_path / "notes.txt"), whole_split=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="config.yaml"):
        evaluate_source(str(tmp_path / "empty"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [
    ("train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"),
    ("train.dist.pipeline_parallel_size=2", "train.train_micro_batch_size=1"),
], ids=["tp2-sp", "pp2"])
def test_eval_in_any_layout_equals_one_process(debug_run, layout):
    """The checkpoint, written by one process, read into two: the same loss as one process evaluating it."""
    one = evaluate_source(str(debug_run.output_dir), eval_iter=4)
    proc = launch.run(launch.dufu_command("eval", str(debug_run.output_dir), "--nproc", "2", "--eval-iter", "4",
                                          "--json", *layout), timeout=300)
    launch.assert_ok(proc)
    got = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert got["world_size"] == 2
    assert got["eval_samples"] == one["eval_samples"]
    assert got["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)


def test_eval_and_generate_read_a_quantized_directory(debug_run, tmp_path, capsys):
    """`dufu quantize`'s output evaluates on the recipe's data (int8 weights: within 1% of the fp32 loss) and
    generates."""
    pytest.importorskip("torchao")
    from dufu.cli.quantize import quantize_to

    out = quantize_to(debug_run.output_dir, "int8-weight", tmp_path / "q8")
    fp32 = evaluate_source(str(debug_run.output_dir), eval_iter=2)
    int8 = evaluate_source(str(out), config="gpt_debug", eval_iter=2)
    assert int8["kind"] == "quantized directory" and int8["eval_samples"] == fp32["eval_samples"]
    assert int8["eval_loss"] == pytest.approx(fp32["eval_loss"], rel=0.01)
    capsys.readouterr()
    assert cli_main(["generate", str(out), "--prompt", "The ", "--greedy", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_eval_builds_the_runtime_only(debug_run, monkeypatch):
    """`dufu eval` needs the model as training builds and splits it, not the training loop: no optimizer and no
    sampler is built (its numbers are still the run's own, test above)."""
    import torch

    from dufu.data import ResumableBatchSampler

    built = []
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", lambda *a, **k: built.append("optimizer"))
    monkeypatch.setattr(ResumableBatchSampler, "__init__", lambda *a, **k: built.append("sampler"))
    got = evaluate_source(str(debug_run.output_dir), eval_iter=1)
    assert built == [] and got["eval_loss"] > 0
