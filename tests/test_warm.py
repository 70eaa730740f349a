"""The test session's warm process server (tests/warm.py): a process forked from it is what a new interpreter
started by ``subprocess.Popen(cmd, start_new_session=True)`` would be, seen from inside (argv, sys.path, the
environment, the working directory, its session, its standard streams, signal handlers) and from outside (exit
code, output, death by a signal), and only commands a new interpreter would run identically are forked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import launch
import warm

PROBE = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
                  "sid": os.getsid(0), "pgid": os.getpgid(0), "probe": os.environ.get("DUFU_PROBE"),
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "mp_spawn": __import__("multiprocessing.util").util.spawnv_passfds.__module__}))
print("to stderr", file=sys.stderr)
code = sys.argv[1]
if code == "raise":
    raise ValueError("a failure")
if code == "message":
    sys.exit("a message")
if code == "sleep":
    import time
    time.sleep(60)
import atexit
atexit.register(lambda: print("atexit ran", flush=True))
sys.exit(int(code))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = warm.Server(launch._child_env(None, None), tmp_path_factory.mktemp("warm_test"))
    yield srv
    srv.stop()


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return script


def _run(server, cmd, tmp_path, env=(), timeout=60):
    env = {**launch._child_env(None, None), **dict(env)}
    proc = server.popen([str(c) for c in cmd], env, tmp_path)
    out, err = proc.communicate(timeout=timeout)
    return proc, out, err


def test_a_forked_script_sees_what_a_new_interpreter_sees(server, probe, tmp_path):
    proc, out, err = _run(server, [sys.executable, probe, "0"], tmp_path, env={"DUFU_PROBE": "yes"})
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[0])
    assert seen["argv"] == [str(probe), "0"]
    assert seen["path0"] == str(probe.parent)
    assert seen["cwd"] == str(tmp_path)
    assert seen["probe"] == "yes"
    assert seen["pid"] == proc.pid == seen["sid"] == seen["pgid"]  # a session of its own, which it leads
    assert seen["sigint"] and seen["sigterm"]
    assert "atexit ran" in out and err == "to stderr\n"
    new = subprocess.run([sys.executable, probe, "0"], capture_output=True, text=True, cwd=tmp_path,
                         env={**launch._child_env(None, None), "DUFU_PROBE": "yes"})
    fresh = json.loads(new.stdout.splitlines()[0])
    for key in ("argv", "path0", "cwd", "probe", "sigint", "sigterm"):
        assert seen[key] == fresh[key], key
    assert fresh["mp_spawn"] == "multiprocessing.util" and seen["mp_spawn"] != fresh["mp_spawn"]


@pytest.mark.parametrize("code", ["0", "3", "raise", "message"])
def test_exit_codes_and_errors_are_a_new_interpreters(server, probe, tmp_path, code):
    proc, out, err = _run(server, [sys.executable, probe, code], tmp_path)
    new = subprocess.run([sys.executable, probe, code], capture_output=True, text=True, cwd=tmp_path,
                         env=launch._child_env(None, None))
    assert proc.returncode == new.returncode
    assert err.splitlines()[-1] == new.stderr.splitlines()[-1]  # "ValueError: a failure", "a message", ...
    assert ("atexit ran" in out) == ("atexit ran" in new.stdout)


def test_a_process_killed_by_a_signal_reports_it(server, probe, tmp_path):
    env = launch._child_env(None, None)
    proc = server.popen([sys.executable, str(probe), "sleep"], env, tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads(out.splitlines()[0])["pid"] == proc.pid  # the output before the timeout is kept


def test_python_m_dufu_runs_dufus_command_line(server, tmp_path):
    proc, out, err = _run(server, [sys.executable, "-m", "dufu", "--help"], tmp_path)
    new = subprocess.run([sys.executable, "-m", "dufu", "--help"], capture_output=True, text=True, cwd=tmp_path,
                         env=launch._child_env(None, None))
    assert proc.returncode == new.returncode == 0
    assert out == new.stdout


def test_a_worker_server_started_inside_is_forked_and_its_workers_run(server, tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(
        "import multiprocessing as mp, os\n"
        "def square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('forkserver')\n"
        "    with ctx.Pool(2) as pool:\n        print(pool.map(square, range(4)))\n"
        "    from multiprocessing import forkserver\n"
        "    server = forkserver._forkserver._forkserver_pid\n"
        "    print(open(f'/proc/{server}/cmdline', 'rb').read().split(b'\\0')[1].decode())\n")
    proc, out, err = _run(server, [sys.executable, script], tmp_path)
    assert proc.returncode == 0, err
    squares, server_program = out.splitlines()[:2]
    assert squares == "[0, 1, 4, 9]"
    assert server_program.endswith("warm.py")  # a fork of this server, not `python -c ...` importing again


@pytest.mark.parametrize("cmd, env, expected", [
    (["-m", "dufu", "train"], {}, True),
    (["tests/parity_worker.py", "plan.json"], {"DUFU_FAULT": "exit:1:2"}, True),
    (["-m", "pytest"], {}, False),  # it would find this server's imports made
    (["-c", "print(1)"], {}, False),
    (["-u", "-m", "dufu"], {}, False),  # interpreter options
    (["-m", "dufu", "train"], {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, True),  # read when a graph compiles
    (["-m", "dufu", "train"], {"KMP_INIT_AT_FORK": "FALSE"}, True),  # Intel OpenMP's: never loaded there
    (["-m", "dufu", "train"], {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "1234"}, True),  # set before each use
    (["-m", "dufu", "train"], {"OMP_NUM_THREADS": "2"}, False),  # read when torch is imported
    (["-m", "dufu", "train"], {"PYTHONPATH": "/elsewhere"}, False),
])
def test_only_what_a_new_interpreter_would_run_identically_is_forked(cmd, env, expected):
    server_env = launch._child_env(None, None)
    assert warm.eligible([sys.executable, *cmd], {**server_env, **env}, server_env) is expected
    assert not warm.eligible(["bash", "-c", "true"], server_env, server_env)
    if not expected:
        assert warm.why_new([sys.executable, *cmd], {**server_env, **env}, server_env)  # says why
