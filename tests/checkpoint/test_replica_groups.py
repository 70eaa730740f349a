"""Training through failures without a restart (train.fault_tolerance on torchft), with real processes.

* Two replica groups (two ``dufu train`` jobs of one process each, gloo) and a ``dufu lighthouse`` on a free port:
  group 1 is SIGKILLed once both have stepped together, and started again with ``--resume``. Group 0 never
  stops (its steps go on, alone, while group 1 is down), group 1 heals from it (weights, optimizer state, step,
  sample position) and rejoins, and both end with bitwise identical weights.
* DiLoCo: two groups, sync_every 4: the weights are identical right after every outer synchronisation (and differ
  between them), and the bytes all-reduced per step are the model's bytes / sync_every, where gradient
  averaging all-reduces the model's bytes every step.
* Bad input, refused at start-up in this process: no Lighthouse at the address, sync_every < 1, pipeline
  parallelism, a group id outside the groups, the lighthouse's own options.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

import launch
from parity import consolidated_state, final_model_state, parity_run, train_records

FT = ("train.evaluation.enabled=False", "train.tensorboard=False", "train.generation.enabled=False",
      "train.compile.enabled=False", "train.peak_tflops=1.0", "train.fault_tolerance.enabled=True",
      "train.fault_tolerance.replica_parallel_size=2", "train.fault_tolerance.timeout_seconds=10")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture
def lighthouse():
    """``lighthouse(min_replicas)`` -> its address; a ``dufu lighthouse`` process that ends with the test (the
    groups notice a dead one within a second: 1 s join and heartbeat timeouts)."""
    servers = []

    def start(min_replicas: int = 1) -> str:
        bind = f"[::]:{free_port()}"
        server = launch.start(launch.dufu_command("lighthouse", "--bind", bind, "--min-replicas", min_replicas,
                                                  "--join-timeout", 1, "--heartbeat-timeout", 1), timeout=600)
        servers.append((bind, server))
        port = int(bind.rsplit(":", 1)[1])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                return f"http://localhost:{port}"
            except OSError:
                time.sleep(0.2)
        launch._kill_processes_with_argument(bind)
        raise AssertionError(f"dufu lighthouse did not listen within 60 s:\n{server.result().describe()}")

    yield start
    for bind, server in servers:
        launch._kill_processes_with_argument(bind)  # its unique --bind argument
        server.result()


def ft_records(output_dir) -> list[dict]:
    path = Path(output_dir) / "fault_tolerance.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def model_bytes() -> int:
    """fp32 bytes of gpt_debug's parameters (a tied weight once), what one all-reduce of them hands over."""
    from dufu.config import instantiate
    from dufu_testing import load_config

    model = instantiate(load_config("gpt_debug").model)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def group(out, gid: int, address: str, *overrides: str, resume: bool = False) -> list[str]:
    return launch.train_command("gpt_debug", out, 1, *FT, f"train.fault_tolerance.lighthouse={address}",
                                f"train.fault_tolerance.replica_group_id={gid}", *overrides, resume=resume)


@pytest.mark.multiprocess
def test_a_killed_replica_group_rejoins_from_a_live_peer_while_the_other_never_stops(tmp_path, lighthouse):
    address = lighthouse(1)
    a_out, b_out = tmp_path / "a", tmp_path / "b"
    run = ("train.train_iter=250", "train.checkpointer.period=0")
    # group 0 steps at most ~10 per second (slow: a straggler), so it is still training when group 1 is back
    a = launch.start(group(a_out, 0, address, *run), output_dir=a_out, fault="slow:0:1", retry=False, timeout=300)
    b = launch.start(group(b_out, 1, address, *run), output_dir=b_out, retry=False, timeout=300)
    deadline = time.monotonic() + 150
    while not any(r["participants"] == 2 and r["step"] >= 5 for r in ft_records(b_out)):
        assert time.monotonic() < deadline, "the two groups never stepped together"
        time.sleep(0.2)
    launch._kill_processes_with_argument(f"train.output_dir={b_out}")  # kill -9: a lost replica group
    killed_at = time.time()
    assert b.result().returncode == -9
    killed_step = max(r["step"] for r in ft_records(b_out))
    # a new interpreter, as a restarted group is (its start-up lets group 0 step on alone, so that the rejoin skips
    # steps; a fork of the tests' warm server would be back within a step)
    b2 = launch.run(group(b_out, 1, address, *run, resume=True), output_dir=b_out, retry=False, timeout=300,
                    new_interpreter=True)
    a = a.result()
    launch.assert_ok(a)
    launch.assert_ok(b2)

    # (the group that starts second heals at its first step from the one that is already training)
    a_recs = [r for r in ft_records(a_out) if r["committed"]]
    assert [r["step"] for r in a_recs] == list(range(a_recs[0]["step"], 251)), "group 0 skipped or repeated a step"
    healed = [r for r in ft_records(b_out) if "healed_from_step" in r and r["time"] > killed_at]
    assert len(healed) == 1, ft_records(b_out)
    rejoined_at = healed[0]["time"]
    assert healed[0]["step"] > killed_step + 1  # it jumped to group 0's step instead of redoing the steps
    # group 0 stepped alone, step after step, from the kill until the rejoin; then with group 1 again
    alone = [r["step"] for r in a_recs if r["participants"] == 1 and r["time"] > killed_at]
    assert len(alone) >= 2 and alone == list(range(alone[0], alone[-1] + 1)), alone
    assert killed_step <= alone[0] and alone[-1] < healed[0]["step"]
    assert all(r["participants"] == 2 for r in a_recs if r["step"] >= healed[0]["step"])
    # the gradients, every committed step
    assert {r["bytes_allreduced"] for r in a_recs} == {model_bytes()}
    a_state, b_state = final_model_state(a_out), final_model_state(b_out)
    assert a_state.keys() == b_state.keys()
    for name in a_state:
        assert torch.equal(a_state[name], b_state[name]), name


@pytest.mark.multiprocess
def test_two_live_replica_groups_step_as_one_job_with_both_groups_batches(tmp_path, lighthouse):
    """The loss continuity while all groups live: group g reads part g of each global batch of 2 x 4 samples, and a
    step averages the groups' gradients, which is one process with a global batch of 8 (two micro-batches)."""
    address = lighthouse(2)
    run = ("train.train_iter=6", "train.fault_tolerance.min_replica_size=2")
    outs = [tmp_path / "a", tmp_path / "b"]
    jobs = [launch.start(group(out, gid, address, *run), output_dir=out, timeout=300) for gid, out in enumerate(outs)]
    reference = parity_run(tmp_path / "one", 1, "train.train_iter=6", "train.train_micro_batch_size=4",
                           "train.checkpointer.period=6")
    for job in jobs:
        launch.assert_ok(job.result())
    a, b = (train_records(out) for out in outs)
    assert sorted(a) == sorted(b) == sorted(reference.train) == list(range(1, 7))
    for step, ref in reference.train.items():
        assert (a[step]["loss"] + b[step]["loss"]) / 2 == pytest.approx(ref["loss"], rel=1e-6)
    for out in outs:
        state = final_model_state(out)
        assert all(torch.allclose(state[k], reference.state[k], rtol=0, atol=1e-6) for k in state)


@pytest.mark.multiprocess
def test_diloco_groups_hold_the_same_weights_after_each_outer_sync_and_send_a_quarter_of_the_bytes(
        tmp_path, lighthouse):
    address = lighthouse(2)  # every synchronisation waits for both groups
    run = ("train.train_iter=12", "train.checkpointer.period=2", "train.checkpointer.max_to_keep=0",
           "train.fault_tolerance.mode=diloco", "train.fault_tolerance.sync_every=4",
           "train.fault_tolerance.min_replica_size=2")
    outs = [tmp_path / "a", tmp_path / "b"]
    jobs = [launch.start(group(out, gid, address, *run), output_dir=out, timeout=300) for gid, out in enumerate(outs)]
    for job in jobs:
        launch.assert_ok(job.result())
    for step in range(2, 13, 2):
        a, b = (consolidated_state(out / "checkpoints" / f"step_{step:07d}") for out in outs)
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == (step % 4 == 0), f"step {step}: weights {'differ' if not same else 'equal'} between groups"
    per_step = {r["step"]: r["bytes_allreduced"] for r in ft_records(outs[0])}
    assert sorted(per_step) == list(range(1, 13))
    assert {s for s, n in per_step.items() if n} == {4, 8, 12}
    assert {per_step[s] for s in (4, 8, 12)} == {model_bytes()}  # one pseudo-gradient per outer step
    assert sum(per_step.values()) / 12 == model_bytes() / 4  # gradient averaging: model_bytes() every step


# ------------------------------------------------------------------------------------------ bad input


def train_error(capsys, *args: str) -> str:
    from dufu.cli import main

    assert main(["train", "gpt_debug", *args]) == 2
    return " ".join(capsys.readouterr().err.split())


def test_no_lighthouse_at_the_address_is_a_fast_error_that_names_it(capsys, tmp_path):
    port = free_port()
    start = time.monotonic()
    err = train_error(capsys, f"train.output_dir={tmp_path}/run", *FT,
                      f"train.fault_tolerance.lighthouse=http://localhost:{port}")
    assert f"no Lighthouse answers at localhost:{port}" in err and "dufu lighthouse --bind" in err
    assert time.monotonic() - start < 30
    assert "train.fault_tolerance.lighthouse=http://HOST:PORT" in train_error(
        capsys, f"train.output_dir={tmp_path}/run2", *FT)


@pytest.mark.parametrize("overrides, expected", [
    (("train.fault_tolerance.mode=diloco", "train.fault_tolerance.sync_every=0"),
     "train.fault_tolerance.sync_every=0"),
    (("train.fault_tolerance.replica_group_id=2",), "replica_group_id=2 is outside [0, 2)"),
    (("train.fault_tolerance.mode=local_sgd", "train.nan_policy=skip"), "Use train.nan_policy='stop'"),
    (("train.fault_tolerance.mode=gossip",), "train.fault_tolerance.mode='gossip'"),
])
def test_invalid_fault_tolerance_configs_are_refused_with_what_to_change(capsys, tmp_path, overrides, expected):
    err = train_error(capsys, f"train.output_dir={tmp_path}/run", *FT, "train.fault_tolerance.lighthouse=http://x:1",
                      *overrides)
    assert expected in err


def test_fault_tolerance_with_pipeline_parallelism_is_refused_before_any_worker_starts(capsys, tmp_path):
    err = train_error(capsys, "--nproc", "2", f"train.output_dir={tmp_path}/run", *FT,
                      "train.fault_tolerance.lighthouse=http://x:1", "train.dist.pipeline_parallel_size=2",
                      "train.global_batch_size=8")
    assert "with pipeline parallelism (pipeline_parallel_size=2) is not supported" in err
    assert "train.dist.pipeline_parallel_size=1" in err


def test_lighthouse_options_are_checked(capsys):
    from dufu.cli import main

    assert main(["lighthouse", "--min-replicas", "0"]) == 2
    assert "--min-replicas 0" in capsys.readouterr().err
