"""Memory on the record (dufu.engine.reporting.memory): the peak readings and their reset on a CPU, the gathering
over ranks, the planner's peak beside a measured run of gpt_debug, and the out-of-memory error with its snapshot."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dufu.engine.reporting.memory import (
    CPU_ALLOCATION_FAILURE, RSS_KEY, RSS_RUN_KEY, PlannedMemory, RunPeaks, gather_memory_records, memory_record,
    on_out_of_memory, planned_memory, process_rss_bytes, start_memory_history,
)
from dufu.errors import ConfigError
from dufu_testing import FAST, load_config, train_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))  # the planner tests' fixed CPU figures
from plan_testing import PROBE  # noqa: E402

MiB = 1024**2
CPU = torch.device("cpu")


def _rss_key(record: dict) -> str:
    assert len(record) == 1 and next(iter(record)) in (RSS_KEY, RSS_RUN_KEY), record
    return next(iter(record))


def test_the_cpu_record_is_the_resident_set_high_water_and_resets():
    key = _rss_key(memory_record(CPU))
    before = process_rss_bytes() / MiB
    assert 20 < before < 64 * 1024  # a Python process with torch loaded
    x = torch.ones(100 * MiB // 4)  # 100 MiB, every page written
    with_x = memory_record(CPU)
    assert _rss_key(with_x) == key
    assert with_x[key] >= before + 90, (before, with_x)
    del x
    memory_record(CPU)  # the window in which x was freed: its high water still holds x
    after = memory_record(CPU)
    if key == RSS_KEY:  # the high water was reset: a window without x peaks 100 MiB lower
        assert after[key] <= with_x[key] - 90, (with_x, after)
    else:  # this system refuses the reset: the whole run's high water, which never falls
        assert after[key] >= with_x[key]
    assert start_memory_history(CPU) is False  # the allocator's history is CUDA's


def test_records_are_gathered_over_the_ranks_of_a_group(tmp_path):
    record = {"mem_rss_peak_mib": 12.5, "other_mib": 3.25}
    assert gather_memory_records(record) == (record, [record])  # no process group: this rank's own
    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        top, per_rank = gather_memory_records(record)
    finally:
        dist.destroy_process_group()
    assert top == record and per_rank == [record]


def test_the_run_peaks_keep_each_ranks_largest_and_say_which_rank():
    peaks = RunPeaks()
    peaks.add([{RSS_KEY: 300.0}, {RSS_KEY: 420.0}])
    peaks.add([{RSS_KEY: 350.0}, {RSS_KEY: 400.0}])
    assert peaks.per_rank == [{RSS_KEY: 350.0}, {RSS_KEY: 420.0}]
    text = peaks.text(PlannedMemory(100 * MiB, "tensors"), start_rss_bytes=220 * MiB)
    assert "420.0 MiB resident set on rank 1 (ranks 350.0-420.0 MiB)" in text
    assert "200.0 MiB above the resident set" in text and "planned 100.0 MiB" in text and "(0.50x" in text


# ---------------------------------------------------------------------------------------- the planned peak


def test_the_planned_peak_of_gpt_debug_is_near_the_measured_growth(tmp_path):
    from dufu.plan import estimate
    from dufu.plan.cpu import cpu_from_probe

    cfg = load_config("gpt_debug", [*FAST, "train.train_iter=2", "train.checkpointer.period=0"])
    plan_estimate = functools.partial(estimate, hardware=cpu_from_probe(PROBE))
    t0 = time.perf_counter()
    planned = planned_memory(cfg, 1, plan_estimate, dtype="fp32")
    seconds = time.perf_counter() - t0
    assert planned.peak_bytes is not None, planned.covers
    assert len(planned.by_pipeline_rank) == 1 and abs(planned.by_pipeline_rank[0] - planned.peak_bytes) < 1024
    assert "parameters, gradients, optimizer states" in planned.covers
    assert planned.record() == {"mem_planned_peak_mib": planned.peak_bytes / MiB}

    key = _rss_key(memory_record(CPU))  # the high water from here
    start = process_rss_bytes()
    run = train_config(cfg, tmp_path / "run")
    peak = memory_record(CPU)[key] * MiB
    if key == RSS_RUN_KEY and peak <= start:
        pytest.skip("the resident set high water cannot be reset here and was reached before this run")
    growth = peak - start
    states = sum(16 * p.numel() for p in run.trainer.model.parameters())  # fp32 weights, gradients, AdamW's two
    print(f"planned {planned.peak_bytes / MiB:.2f} MiB in {seconds:.2f} s; measured growth {growth / MiB:.2f} MiB; "
          f"ratio {planned.peak_bytes / growth:.3f}")
    # The planner counts the step's tensors: at least the model states. The run adds those to the process and its
    # own (the data, the autograd engine's and the libraries' memory: about 100 MiB in a fresh process, where
    # planned / growth measured 0.03 for gpt_debug and 0.78 for a 29M-parameter GPT). In the test session's
    # process, memory earlier tests freed is reused without growing the resident set: no lower bound on growth.
    assert states <= planned.peak_bytes <= 4 * states
    assert growth <= planned.peak_bytes + 400 * MiB


def test_the_planned_peak_is_none_with_the_reason_when_the_planner_cannot_say():
    def refuse(cfg, world_size):
        raise ConfigError("dufu plan reads a model's transformer blocks; Foo has none.")

    planned = planned_memory(load_config("gpt_debug"), 1, refuse)
    assert planned.peak_bytes is None and planned.record() == {}
    assert "Foo has none" in planned.covers and "no planned peak" in planned.line()


# ---------------------------------------------------------------------------------------- out of memory


def _trained_linear() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 256)).sum().backward()
    opt.step()
    return model, opt


def test_an_allocation_failure_becomes_an_error_that_names_what_held_memory(tmp_path):
    model, opt = _trained_linear()
    held = torch.ones(2 * MiB)  # 8 MiB that belong to neither the model nor the optimizer
    with pytest.raises(RuntimeError) as info:
        with on_out_of_memory(tmp_path, CPU, 3, [model], [opt], activity=lambda: "at step 7"):
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: a real failure of the CPU allocator
    message = str(info.value)
    assert "can't allocate memory" in str(info.value.__cause__)
    snapshot = tmp_path / "memory_snapshot_rank3.json"
    data = json.loads(snapshot.read_text())
    weights = 4 * (256 * 256 + 256)
    cats = data["categories_bytes"]
    assert cats["parameters"] == weights and cats["gradients"] == weights
    assert 2 * weights <= cats["optimizer states"] <= 2 * weights + 64  # exp_avg, exp_avg_sq and the step counts
    assert cats["other tensors"] >= held.nbytes
    biggest_other = next(t for t in data["largest"] if t["category"] == "other tensors")
    assert biggest_other["bytes"] >= held.nbytes
    assert any(t["shape"] == [2 * MiB] and t["mib"] == 8.0 for t in data["largest"])
    named = {t["name"] for t in data["largest"] if t["category"] == "optimizer states"}
    assert {"exp_avg of weight", "exp_avg_sq of weight"} <= named
    assert message.startswith("rank 3 ran out of memory on cpu at step 7: ") and "can't allocate memory" in message
    assert f"parameters {weights / MiB:,.1f} MiB" in message and "optimizer states" in message
    assert str(snapshot) in message
    for advice in ("train.train_micro_batch_size", "train.activation_checkpoint.enabled=True",
                   "train.zero_optimization.enabled=True"):
        assert advice in message


def test_a_cuda_out_of_memory_error_keeps_its_type_and_other_errors_pass(tmp_path):
    model, opt = _trained_linear()
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        with on_out_of_memory(tmp_path / "outer", CPU, 0, [model], [opt]):
            with on_out_of_memory(tmp_path, CPU, 0, [model], [opt]):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert "rank 0 ran out of memory on cpu: CUDA out of memory. Tried to allocate 20.00 GiB" in str(info.value)
    assert (tmp_path / "memory_snapshot_rank0.json").exists()
    assert not (tmp_path / "outer").exists()  # the outer guard passed the reported error on as it was
    other = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as passed:
        with on_out_of_memory(tmp_path / "other", CPU, 0):
            raise other
    assert passed.value is other and not (tmp_path / "other").exists()
    (tmp_path / "a_file").write_text("")
    failure = RuntimeError(CPU_ALLOCATION_FAILURE + ": you tried to allocate 1 bytes.")
    with pytest.raises(RuntimeError) as unreported:  # no snapshot can be written there: the original, with a note
        with on_out_of_memory(tmp_path / "a_file", CPU, 0):
            raise failure
    assert unreported.value is failure and "no memory snapshot" in unreported.value.__notes__[0]


def test_a_run_shows_its_planned_and_measured_peaks(tmp_path, capsys):
    """`dufu train` (in this process): the start-up summary's planned peak, each record's high-water mark, and the
    end summary's measured peak beside the planned one."""
    from dufu.cli import main

    out = tmp_path / "run"
    assert main(["train", "gpt_debug", *FAST, "train.plan_memory=True", "train.train_iter=2",
                 "train.checkpointer.period=0", f"train.output_dir={out}"]) == 0
    said = capsys.readouterr().out
    planned = float(said.split("planned peak ")[1].split(" MiB")[0])
    assert 1.0 < planned < 50.0, said  # gpt_debug: 0.13M parameters with gradients, AdamW moments, activations
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == [1, 2] and all(r[RSS_KEY] > 50 for r in records)
    end = said.split("peak memory")[-1].splitlines()[0]
    assert "MiB resident set" in end and f"planned {planned:,.1f} MiB of tensors" in end, end
