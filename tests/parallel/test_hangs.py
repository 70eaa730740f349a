"""Hangs explained (docs/faults.md#hangs-timeouts-and-the-flight-recorder): NCCL's error handling and flight
recorder set for NCCL runs only and only where unset, the start-up timeout replaced by the steady one on every
process group, and the verdict read from flight-recorder dumps that torch itself wrote (two gloo ranks, one of
which does not join the third all-reduce)."""

from __future__ import annotations

import datetime
import pickle
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

import launch
from dufu.engine import diagnose
from dufu.engine.schema import Dist
from dufu.errors import DistributedFailure, DufuError
from dufu.parallel import env
from dufu.parallel.launch import enter_steady_state, startup_timeout

# ------------------------------------------------------------------------------------------ NCCL's settings

ALL_NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def test_nccl_runs_get_error_handling_and_the_flight_recorder_where_the_user_set_nothing(tmp_path):
    environ = {"PATH": "/bin"}
    assert env.nccl_debug_environment("gloo", tmp_path / "fr", environ) == {}  # gloo ignores them: none set
    assert environ == {"PATH": "/bin"} and not (tmp_path / "fr").exists()

    done = env.nccl_debug_environment("nccl", tmp_path / "fr", environ)
    prefix = str(tmp_path / "fr" / "rank_")
    assert done == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "2000",
                    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                    "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    assert {k: environ[k] for k in ALL_NAMES} == done and (tmp_path / "fr").is_dir()  # torch makes no directory
    assert env.flight_recorder_prefix(environ) == prefix


def test_a_setting_the_user_made_under_any_of_its_names_is_kept(tmp_path):
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    environ = dict(user)
    done = env.nccl_debug_environment("nccl", tmp_path / "fr", environ)
    assert done == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # the newer names of the user's settings are not added
    assert environ == {**user, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"} and not (tmp_path / "fr").exists()
    assert env.flight_recorder_prefix(environ) == "/scratch/fr_"
    assert env.nccl_debug_environment("nccl", None, {}) == {}  # no output directory: nothing decided for the user


# ------------------------------------------------------------------------------------------------ timeouts


def test_the_start_up_timeout_is_the_larger_and_the_default_leaves_room_for_a_first_compile():
    assert (Dist().timeout_minutes, Dist().startup_timeout_minutes) == (10.0, 30.0)
    assert startup_timeout(10.0, 30.0) == 30.0
    assert startup_timeout(45.0, 30.0) == 45.0  # never shorter than the steady one
    assert startup_timeout(0.25, None) == 0.25


def _gloo_timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_after_the_first_step_every_group_waits_the_steady_timeout(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group of another test is still up")
    assert enter_steady_state(0.5) is None  # no process group: nothing to do
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=20))
    try:
        later = dist.new_group(backend="gloo")  # as the mesh's and the health group: torch's default, not 20
        before = [_gloo_timeout(g) for g in (dist.group.WORLD, later)]
        notice = enter_steady_state(0.25)
        after = [_gloo_timeout(g) for g in (dist.group.WORLD, later)]
        t = torch.ones(3)
        dist.all_reduce(t, group=later)  # the groups still work
    finally:
        dist.destroy_process_group()
    assert notice is None
    assert before == [datetime.timedelta(minutes=20), datetime.timedelta(minutes=30)]
    assert after == [datetime.timedelta(seconds=15)] * 2 and t.tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------- the flight recorder


WRITE_DUMPS = r'''
import datetime, multiprocessing, os, pickle, sys, tempfile, time
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "100")  # before torch makes its flight recorder
import torch
import torch.distributed as dist

def dump():  # the bytes NCCL's watchdog writes on a timeout: collectives, no stacks, every entry
    return torch._C._distributed_c10d._dump_fr_trace(True, False, False)

def rank_main(rank, out, store_path):
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    t = torch.ones(4, 8)
    for _ in range(2):
        dist.all_reduce(t)
    for _ in range(500):  # gloo retires finished work on a thread of its own: wait until the buffer shows it
        if all(e["retired"] for e in pickle.loads(dump())["entries"]):
            break
        time.sleep(0.01)
    if rank == 0:
        dist.all_reduce(torch.zeros(1024), async_op=True)  # rank 1 never joins this one
    with open(os.path.join(out, f"rank_{rank}"), "wb") as f:
        f.write(dump())
    store.set(f"dumped_{rank}", "1")
    store.wait([f"dumped_{r}" for r in range(2)])  # rank 1 leaving first would fail rank 0's pending all-reduce
    os._exit(0)  # a collective is pending: no process-group teardown

with tempfile.TemporaryDirectory() as scratch:
    store = os.path.join(scratch, "store")
    procs = [multiprocessing.get_context("fork").Process(target=rank_main, args=(r, sys.argv[1], store))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
sys.exit(0 if all(p.exitcode == 0 for p in procs) else 1)
'''


@pytest.fixture(scope="module")
def torch_dumps(tmp_path_factory):
    """A run's output_dir whose flight_recorder/ holds the dumps torch wrote for two gloo ranks (rank 1 did not
    join the third all-reduce): one small process that forks the two ranks."""
    out = tmp_path_factory.mktemp("hung_run")
    (out / "flight_recorder").mkdir()
    proc = launch.run([sys.executable, "-c", WRITE_DUMPS, out / "flight_recorder"], timeout=180)
    launch.assert_ok(proc)
    return out


def test_the_reader_names_the_rank_that_did_not_join_and_the_collective(torch_dumps):
    directory, files = diagnose.find_dumps(torch_dumps)
    assert directory == torch_dumps / "flight_recorder" and sorted(files) == [0, 1]
    dumps = {r: diagnose.read_dump(f) for r, f in files.items()}
    [hang] = diagnose.unjoined_collectives(dumps)
    assert (hang.seq, hang.op, hang.input_sizes, hang.output_sizes) == (3, "gloo:all_reduce", [[1024]], [[1024]])
    assert (hang.joined, hang.missing, hang.no_dump, hang.group_ranks) == ([0], [1], [], [0, 1])
    assert hang.group_desc == "default_pg"
    text = diagnose.explain_flight_recorder(torch_dumps)
    assert (f"rank(s) 1 did not join collective #3 of process group {hang.group} (default_pg, ranks 0, 1): "
            "gloo:all_reduce (input sizes [[1024]], output sizes [[1024]]), which rank(s) 0 entered") in text


def test_a_restart_s_dumps_and_a_rank_without_one(torch_dumps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(torch_dumps, out)
    attempt = out / "flight_recorder" / "attempt_1"
    attempt.mkdir()
    shutil.copy(out / "flight_recorder" / "rank_0", attempt / "rank_0")  # rank 1 was killed before it wrote one
    assert diagnose.find_dumps(out)[0] == attempt  # the last attempt
    text = diagnose.explain_flight_recorder(out)
    assert "no dump from rank(s) 1" in text and "did not join" not in text
    assert "rank 0: gloo:all_reduce (#3 of process group" in text  # the one it started, not completed
    (attempt / "rank_0").write_bytes(b"cut short")
    with pytest.raises(DufuError, match="rank_0 is not a readable flight-recorder dump"):
        diagnose.explain_flight_recorder(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DufuError, match="no flight-recorder dumps"):
        diagnose.find_dumps(tmp_path / "empty")


def test_a_dump_s_fields_are_torch_s_documented_ones(torch_dumps):
    with open(torch_dumps / "flight_recorder" / "rank_0", "rb") as f:
        raw = pickle.load(f)
    assert {"version", "pg_config", "entries"} <= set(raw)
    entry = raw["entries"][-1]
    assert {"process_group", "collective_seq_id", "profiling_name", "input_sizes", "output_sizes", "state",
            "is_p2p"} <= set(entry)


def test_the_failure_message_carries_the_verdict(torch_dumps, monkeypatch):
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(torch_dumps / "flight_recorder" / "rank_"))
    with pytest.raises(DistributedFailure) as e:
        with diagnose.collective_failures(0, lambda: "at step 3", 0.25, None):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 15000ms")
    message = str(e.value)
    assert "rank 0 stopped at step 3" in message and "train.dist.timeout_minutes=0.25" in message
    assert "rank(s) 1 did not join collective #3" in message and "gloo:all_reduce" in message


def test_the_failure_message_says_where_dumps_will_be(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "flight_recorder" / "rank_"))
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    note = diagnose.flight_recorder_note(2)
    assert f"dufu diagnose {tmp_path / 'flight_recorder'}" in note
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    assert diagnose.flight_recorder_note(2) == ""  # gloo runs: no dump path, nothing to point to
