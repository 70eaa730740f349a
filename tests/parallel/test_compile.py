"""torch.compile per transformer block (dufu.parallel.compile).

* Compiled blocks give eager's loss and gradients, alone and under selective activation checkpointing; each graph
  compiles once and nothing recompiles over the following steps (``torch._dynamo.config.error_on_recompile``
  and :class:`CompileWatch` both armed); the compiled code lands in dufu's cache directory.
* A whole ``dufu train`` run with ``train.compile.enabled=True`` compiles exactly one forward and one backward
  graph for its blocks and never recompiles.
* A recompile after the warm-up is logged (as a hook of the loop) with the guard that failed and counted; on
  CUDA a missing C compiler or Python.h turns "auto" eager with a notice and refuses True; the cache directory
  follows ``DUFU_CACHE_DIR`` unless the user set ``TORCHINDUCTOR_CACHE_DIR``; ``decide_compile`` says what it
  decided and why.
* On 2 processes, compiled layouts with activation checkpointing (tensor parallel, ZeRO-3) match one process:
  through the trainer (tests/parity.py) and, for selective checkpointing, through this package's functions.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from test_activation_checkpoint import SIZES, batch, tiny_gpt


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """No compiled code from earlier tests in this process; the inductor cache variable restored afterwards."""
    import torch._dynamo

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sgd_steps(model, steps: int, on_step=None) -> list:
    """Losses and gradients of ``steps`` plain SGD steps on one fixed batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    out = []
    for step in range(steps):
        loss = model(x, shift_labels=y).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step:
            on_step(step)
    return out


@pytest.mark.parametrize("ac", [None, "selective"])
def test_compiled_blocks_match_eager_and_never_recompile(ac, fresh_dynamo):
    from dufu.parallel.activation_checkpoint import apply_activation_checkpointing
    from dufu.parallel.compile import CompileWatch, apply_compile, compile_cache_dir

    eager = tiny_gpt()
    compiled = copy.deepcopy(eager)
    if ac:
        apply_activation_checkpointing(compiled, ac)
    apply_compile(compiled)
    reference = sgd_steps(eager, 3)
    with CompileWatch(on_recompile="error") as watch, torch._dynamo.config.patch(error_on_recompile=True):
        got = sgd_steps(compiled, 3, on_step=lambda step: step == 0 and watch.steady())
    # One forward and one backward graph for both blocks (the backward comes with the forward from a warm cache)
    assert watch.warmup_compiles in (1, 2), f"expected one forward and one backward graph: {watch}"
    assert watch.compiles == watch.warmup_compiles and watch.recompiles == []
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, reference)):
        assert torch.allclose(loss, ref_loss, rtol=1e-5), (step, loss, ref_loss)
        for name, g in ref_grads.items():  # inductor may sum in another order: fp32 roundoff only
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), (step, name, (grads[name] - g).abs().max())
    assert any(p.is_file() for p in compile_cache_dir().rglob("*")), "nothing written to the compile cache"


def test_a_training_run_compiles_each_graph_once(fresh_dynamo, train_run):
    from dufu.parallel.compile import CompileWatch

    with CompileWatch(on_recompile=None) as watch, torch._dynamo.config.patch(error_on_recompile=True):
        run = train_run("train.train_iter=4", "train.checkpointer.period=0", "train.compile.enabled=True")
    assert len([r for r in run.records if "loss" in r]) == 4
    # one forward and one backward graph for both blocks (1: the backward came with the forward from the cache)
    assert watch.compiles in (1, 2), f"expected one forward and one backward graph: {watch}"


def test_a_recompile_is_reported_with_its_reason(fresh_dynamo):
    """As a hook of the loop (how a run installs it): the first step's compilations are the warm-up; a later one is
    logged as one line with the guard that failed and counted (the run record's ``recompiles``)."""
    import types

    from dufu.parallel.compile import CompileWatch, RecompileError, apply_compile

    model = apply_compile(tiny_gpt())
    x, y = batch()
    lines = []
    trainer = types.SimpleNamespace(step=0, log=lines.append)  # what the hook points read of a Trainer
    watch = CompileWatch(on_recompile="warn")
    watch.on_start(trainer)
    try:
        for rows in (4, 4, 2):  # the third step has another batch size: a guard fails
            model(x[:rows], shift_labels=y[:rows]).loss.backward()
            trainer.step += 1
            watch.after_optimizer(trainer, 0.0, 0.0)
    finally:
        watch.on_end(trainer, {})
    assert watch.recompiles and "size mismatch" in watch.recompiles[0], watch.recompiles
    assert watch.recompile_count == len(watch.recompiles) == len(lines)
    assert lines[0].startswith("step 3: torch.compile recompiled (") and "size mismatch" in lines[0]
    assert "\n" not in lines[0]
    error = CompileWatch(on_recompile="error", recompiles=watch.recompiles[:1])
    with pytest.raises(RecompileError, match="recompiled 1 time.*size mismatch"):
        error.check()
    error.check()  # reported once
    with pytest.warns(UserWarning, match="recompiled"):
        CompileWatch(on_recompile="warn", recompiles=["x"]).check()


def test_cache_directory_follows_dufu_unless_the_user_set_one(monkeypatch, tmp_path):
    from dufu.parallel.compile import compile_cache_dir, use_compile_cache

    monkeypatch.setenv("DUFU_CACHE_DIR", str(tmp_path / "dufu"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_cache_dir() == tmp_path / "dufu" / "inductor"
    assert use_compile_cache() == tmp_path / "dufu" / "inductor"
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "dufu" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == tmp_path / "mine" and (tmp_path / "mine").is_dir()


def test_bad_input_is_a_clear_error():
    from torch import nn

    from dufu.parallel.compile import CompileWatch, apply_compile

    with pytest.raises(ValueError, match="no transformer block.*train.compile.enabled=False"):
        apply_compile(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="on_recompile"):
        CompileWatch(on_recompile="loud")


def test_auto_decides_from_the_measurements_and_says_why(toolchain):
    from dufu.parallel.compile import CompileMeasurement, decide_compile

    cpu = torch.device("cpu")
    slower = {None: CompileMeasurement("m", speedup=0.9, warm_s=10, cold_s=60)}
    faster = {None: CompileMeasurement("m", speedup=1.5, warm_s=10, cold_s=60)}
    d = decide_compile("auto", cpu, train_iter=400, measured=slower)
    assert not d.enabled and d.reason.startswith("off (auto)") and "0.90x" in d.reason and "60 s" in d.reason
    assert decide_compile("auto", cpu, train_iter=400, measured=faster).enabled
    # a faster compiled step pays back the first compilation only in a long enough run: 1/3 of 0.1 s per step
    assert not decide_compile("auto", cpu, train_iter=1000, step_seconds=0.1, measured=faster).enabled
    assert decide_compile("auto", cpu, train_iter=3000, step_seconds=0.1, measured=faster).enabled
    off = decide_compile("auto", cpu, train_iter=400, measured={})  # nothing measured for this dtype
    assert not off.enabled and "have not measured faster" in off.reason
    toolchain(cc="/usr/bin/gcc", python_h=True, triton=True)
    assert decide_compile("auto", torch.device("cuda"), train_iter=10, measured=slower).enabled  # not a CPU
    # explicit settings are obeyed; compiling where it measured slower gets a notice
    forced = decide_compile(True, cpu, train_iter=400, measured=slower)
    assert forced.enabled and "slow choice" in forced.notice
    assert decide_compile(False, cpu, train_iter=400, measured=faster) == \
        decide_compile(False, cpu, train_iter=400, measured=slower)
    with pytest.raises(ValueError, match="true.*false.*auto"):
        decide_compile("yes", cpu, train_iter=400)
    with pytest.raises(ValueError):
        decide_compile(1, cpu, train_iter=400)


@pytest.fixture
def toolchain(monkeypatch, tmp_path):
    """Make the machine have, or lack, what Triton builds kernels with: a C compiler on PATH (shutil.which),
    Python.h in sysconfig's include directory, triton installed."""
    from dufu.parallel import compile as compile_module

    def make(cc=None, python_h=True, triton=True):
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr("shutil.which", lambda name, *a, **k: cc if name in ("gcc", "clang") else None)
        include = tmp_path / "include"
        include.mkdir(exist_ok=True)
        (include / "Python.h").unlink(missing_ok=True)
        if python_h:
            (include / "Python.h").write_text("")
        monkeypatch.setattr("sysconfig.get_paths", lambda *a, **k: {"include": str(include)})
        monkeypatch.setattr(compile_module, "_triton_installed", lambda: triton)
        return include

    return make


def test_a_missing_gpu_toolchain_turns_auto_off_and_refuses_true(toolchain):
    """On CUDA the start-up checks what Triton needs: without a C compiler or Python.h, "auto" runs eager with a
    notice saying what is missing and how to install it; True is refused with the same and the way out."""
    from dufu.errors import ConfigError
    from dufu.parallel.compile import CompileDecision, compile_toolchain_problem, decide_compile

    cuda = torch.device("cuda")
    toolchain(cc="/usr/bin/gcc")
    assert compile_toolchain_problem() is None and decide_compile("auto", cuda, train_iter=10).enabled

    toolchain(cc=None)  # no gcc, no clang, no CC
    problem = compile_toolchain_problem()
    assert "no C compiler" in problem and "install gcc" in problem and "Python.h" not in problem
    auto = decide_compile("auto", cuda, train_iter=10)
    assert not auto.enabled and auto.reason.startswith("off (auto)") and "no C compiler" in auto.reason
    assert "the run is eager" in auto.notice and "install gcc" in auto.notice
    with pytest.raises(ConfigError, match="train.compile.enabled=true.*no C compiler.*train.compile.enabled=false"):
        decide_compile(True, cuda, train_iter=10)
    assert decide_compile(False, cuda, train_iter=10) == CompileDecision(False, "off (train.compile.enabled=false)")

    include = toolchain(cc="/usr/bin/clang", python_h=False)
    auto = decide_compile("auto", cuda, train_iter=10)
    assert not auto.enabled and f"no Python.h in {include}" in auto.notice and "-dev" in auto.notice
    toolchain(cc="/usr/bin/gcc", triton=False)
    assert "pip install triton" in decide_compile("auto", cuda, train_iter=10).notice
    # the CPU is not checked: its decision stays the measured one
    assert decide_compile("auto", torch.device("cpu"), train_iter=10, measured={}).notice is None


# ------------------------------------------------------------------------------------------ two processes

COMPILE, AC = "train.compile.enabled=True", "train.activation_checkpoint.enabled=True"
DP2, TP2 = "train.dist.data_parallel_size=2", "train.dist.tensor_parallel_size=2"
ZERO3 = ("train.zero_optimization.enabled=True", "train.zero_optimization.stage=3")
COMPILED_LAYOUTS = {
    "tp2-ac": [TP2, AC],
    "dp2-zero3-ac": [DP2, *ZERO3, AC],
}


@pytest.fixture(scope="module")
def compiled_runs(shared_runs):
    """The compiled layouts' runs in one launch (tests/parity.py's SharedRuns)."""
    from parity import EVAL_ARGS, Spec

    return shared_runs({layout: Spec(2, ("model.num_layers=2", *EVAL_ARGS, COMPILE, *overrides))
                        for layout, overrides in COMPILED_LAYOUTS.items()})


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(COMPILED_LAYOUTS))
def test_compiled_layout_matches_single_process(layout, parity_reference, compiled_runs):
    from parity import EVAL_ARGS, assert_matches_reference

    reference = parity_reference(2, *EVAL_ARGS)  # eager, one process
    got = compiled_runs.result(layout)
    assert_matches_reference(got, reference, f"compiled {layout}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2", "dp2-zero3"])
def test_compiled_selective_checkpointing_matches_one_process(layout, selective_checkpointing_runs):
    out = selective_checkpointing_runs(f"{layout}:selective:compile")  # test_activation_checkpoint.py's worker
    for rank in (0, 1):
        err = json.loads((out / f"rank_{rank}.json").read_text())
        assert err["checkpointed_blocks"] == SIZES["num_layers"], err
        assert err["loss"] < 1e-5 and err["grad_mismatch"] == [], err
