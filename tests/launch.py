"""The one way tests start processes: ``dufu train`` (one process or dufu's own torchrun launcher), torchrun
workers, and ``python -m dufu ...``.

Every process started through :func:`run` or :func:`start`

* runs with one OpenMP thread and dufu importable (``PYTHONPATH``), without a parent torchrun's or a test's
  ``RANK``/``WORLD_SIZE``/``MASTER_*``/``DUFU_FAULT`` (a fault is passed explicitly: ``fault=``);
* runs in a session of its own; when it ends or times out, the whole session is killed, and so are its
  descendants (dufu's workers, forked in sessions of their own) and workers that torchrun started in sessions
  of their own (found by the run's unique ``output_dir`` on their command line); nothing outlives the test
  session (:func:`stop_all`);
* on a timeout, returns what it printed so far plus a line saying it was killed, instead of raising;
* is retried once when a process died by SIGSEGV/SIGABRT without an injected fault. dufu's workers never tear a
  gloo process group down in the interpreter's finalization (``dufu.parallel.launch.exit_process``), the known
  cause of such aborts; a retry that still happens is recorded in :data:`RETRIES` and listed, with the dead
  process's output, at the end of the test session (tests/conftest.py), so none passes unseen. A failure that
  repeats is reported as it is. Directories the run writes (``output_dir``, ``scratch``) are emptied before the
  retry; a run into an ``output_dir`` that existed before it (a resume) is not retried, since its starting state
  is gone.

:func:`run_in_turn` runs several items (training runs, a worker's cases) one after another in one job, so that
they share one start-up, while each still passes or fails on its own; :func:`in_turn` is the workers' side.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import warm

REPO = Path(__file__).resolve().parent.parent

# Every retry of this test session: (command, what the process that died printed last).
RETRIES: list[tuple[str, str]] = []

# Variables a test process may have that must not leak into a job: a job is its own (torchrun) world.
_PRIVATE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "DUFU_FAULT")


# ------------------------------------------------------------------------------------------ commands


def dufu_command(*args) -> list[str]:
    """``python -m dufu ARGS``."""
    return [sys.executable, "-m", "dufu", *map(str, args)]


def train_command(config, output_dir, nproc: int = 1, *overrides: str, resume: bool = False,
                  flags: Sequence[str] = ()) -> list[str]:
    """``python -m dufu train CONFIG [--nproc N] [--resume] [flags] train.output_dir=... overrides``."""
    cmd = dufu_command("train", config)
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    if resume:
        cmd.append("--resume")
    return cmd + [*flags, f"train.output_dir={output_dir}", *overrides]


def torchrun_command(script, nproc: int, *args) -> list[str]:
    """``python tests/launch.py --nproc N SCRIPT ARGS``: what ``torchrun --standalone --nproc-per-node=N SCRIPT ARGS``
    does, with the workers forked from dufu's worker server as those of ``dufu train --nproc N`` are (each runs
    SCRIPT as ``__main__``: :func:`forked_script`)."""
    return [sys.executable, str(Path(__file__).resolve()), "--nproc", str(nproc), str(script), *map(str, args)]


def forked_script(script: str, args: list, launcher_env: dict, cwd: str, agent_pid: int) -> None:
    """A worker of :func:`torchrun_command`: a forked process made a torchrun worker, running ``script``."""
    import runpy

    from dufu.cli.workers import become_worker

    become_worker(launcher_env, cwd, agent_pid)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as python SCRIPT has it
    runpy.run_path(script, run_name="__main__")


def _launch_script(nproc: int, script: str, args: list) -> int:
    """The launcher side of :func:`torchrun_command` (this file's ``__main__``); the exit code."""
    import traceback

    from torch.distributed.run import parse_args

    import launch  # this file as a module: the entrypoint the forked workers import by name
    from dufu.cli.torchrun import launch_forked
    from dufu.cli.workers import launch_state, start_worker_server

    start_worker_server(nproc)
    try:
        launch_forked(parse_args(["--standalone", f"--nproc-per-node={nproc}", script]), launch.forked_script,
                      script, args, *launch_state())
    except Exception:  # noqa: BLE001 - a failed worker: torchrun's report, then the job's exit code
        traceback.print_exc()
        return 1
    return 0


# ------------------------------------------------------------------------------------------ results


@dataclass
class Proc:
    """A finished process: exit code, output, wall time and when it ended (``time.time()``)."""

    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    ended: float
    output_dir: Optional[Path] = None
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def describe(self) -> str:
        return (f"$ {' '.join(map(str, self.cmd))}\nexit {self.returncode} after {self.seconds:.0f} s"
                f"{' (timed out)' if self.timed_out else ''}\n"
                f"STDOUT (end):\n{self.stdout[-3000:]}\nSTDERR (end):\n{self.stderr[-6000:]}")


def assert_ok(proc: Proc) -> None:
    assert proc.returncode == 0, proc.describe()


# ------------------------------------------------------------------------------------------ running


def run(cmd: Sequence, *, timeout: float = 600, output_dir=None, scratch: Sequence = (), cwd=None,
        env: Optional[dict] = None, fault: Optional[str] = None, retry: Optional[bool] = None,
        on_start=None, new_interpreter: bool = False) -> Proc:
    """Run ``cmd`` to the end (see the module docstring). ``env`` adds variables; ``fault`` sets ``DUFU_FAULT``;
    ``retry`` (default: when no fault is injected) allows the one retry after a death by signal; ``on_start(pid)``
    is called when the process has started (its pid leads its session); ``new_interpreter``: never forked
    from the warm server (tests/warm.py)."""
    cmd = [str(c) for c in cmd]
    fresh = output_dir is None or not Path(output_dir).exists()
    proc = _run_once(cmd, timeout, output_dir, cwd, env, fault, on_start, new_interpreter)
    if (fault is None if retry is None else retry) and fresh and _died_by_signal(proc):
        warnings.warn(f"a process died by a signal; retrying once: {' '.join(cmd[:8])} ...\n{proc.stderr[-1500:]}")
        RETRIES.append((" ".join(cmd[:8]) + " ...", proc.stderr[-1500:]))
        for d in (output_dir, *scratch):
            if d is not None and Path(d).exists():
                shutil.rmtree(d, ignore_errors=True)
                if d in scratch:
                    Path(d).mkdir(parents=True)
        proc = _run_once(cmd, timeout, output_dir, cwd, env, fault, on_start, new_interpreter)
    return proc


class Started:
    """A process running in the background (:func:`start`); ``result()`` waits for its :class:`Proc`."""

    def __init__(self, cmd, **kwargs):
        self._proc: Optional[Proc] = None
        self._error: Optional[BaseException] = None
        self._pid: Optional[int] = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(cmd, {**kwargs, "on_start": self._on_start}),
                                        daemon=True)
        self._thread.start()

    def _on_start(self, pid: int) -> None:
        self._pid = pid
        self._started.set()

    def pid(self, timeout: float = 60) -> int:
        """The pid of the process (the latest, after a retry), which leads a session of its own."""
        assert self._started.wait(timeout), f"the process did not start within {timeout:.0f} s"
        return self._pid

    def _main(self, cmd, kwargs):
        try:
            self._proc = run(cmd, **kwargs)
        except BaseException as e:  # reported to whoever waits
            self._error = e

    def result(self) -> Proc:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._proc


def start(cmd: Sequence, **kwargs) -> Started:
    """:func:`run` in a background thread: for independent jobs that mostly wait (imports, rendezvous)."""
    return Started(cmd, **kwargs)


def _child_env(extra: Optional[dict], fault: Optional[str]) -> dict:
    env = dict(os.environ)
    for key in _PRIVATE_ENV:
        env.pop(key, None)
    # a suite run inside an srun step: its children are not that step's tasks (dufu.parallel.slurm reads these)
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if fault:
        env["DUFU_FAULT"] = fault
    env.update(extra or {})
    return env


# How this session's processes started: forked from the warm server, or as new processes (conftest reports it).
STARTS = {"forked": 0, "new": 0}
STARTED_NEW: dict[str, int] = {}  # why a process started new while the warm server ran -> how many times

_WARM: Optional[warm.Server] = None  # the session's warm process server (tests/warm.py), if started


def start_warm_server(directory) -> None:
    """Fork this session's ``python -m dufu ...`` and ``python SCRIPT.py ...`` processes from a warm server from
    now on (tests/warm.py), unless ``DUFU_TEST_FRESH_PROCESSES=1``."""
    global _WARM
    if _WARM is None and os.environ.get("DUFU_TEST_FRESH_PROCESSES") != "1":
        _WARM = warm.Server(_child_env(None, None), Path(directory))


def stop_warm_server() -> None:
    global _WARM
    if _WARM is not None:
        _WARM.stop()
        _WARM = None


def _popen(cmd: list[str], env: dict, cwd, new_interpreter: bool = False):
    """``cmd`` started in a session of its own, its output piped: forked from the warm server when it can be."""
    if _WARM is not None:
        why = "asked for" if new_interpreter else warm.why_new(cmd, env, _WARM.env)
        if why is None:
            STARTS["forked"] += 1
            return _WARM.popen(cmd, env, cwd)
        STARTED_NEW[why] = STARTED_NEW.get(why, 0) + 1
    STARTS["new"] += 1
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)


def _run_once(cmd: list[str], timeout: float, output_dir, cwd, env, fault, on_start=None,
              new_interpreter: bool = False) -> Proc:
    start_time = time.monotonic()
    proc = _popen(cmd, _child_env(env, fault), cwd, new_interpreter)
    if on_start is not None:
        on_start(proc.pid)
    live = (proc, str(output_dir) if output_dir is not None else None)
    with _LIVE_LOCK:
        _LIVE.add(live)
    timed_out = False
    seen: dict[int, str] = {}  # every descendant seen while the run lived: pid -> its start time
    try:
        while True:  # a retried communicate loses no output
            try:
                out, err = proc.communicate(timeout=min(1.0, max(0.01, start_time + timeout - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                seen.update((pid, _start_time(pid)) for pid in _descendants(proc.pid))
                if time.monotonic() >= start_time + timeout:
                    raise
    except subprocess.TimeoutExpired:
        timed_out = True
        _end(*live, seen)
        out, err = proc.communicate()
        err += f"\n[test harness: killed after {timeout:.0f} s]"
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(live)
        seconds, ended = time.monotonic() - start_time, time.time()
        _end(*live, seen)
    return Proc(cmd, proc.returncode, out, err, seconds, ended, Path(output_dir) if output_dir is not None else None,
                timed_out)


def _died_by_signal(proc: Proc) -> bool:
    """A rank (or the process itself) ended by SIGSEGV or SIGABRT, not by the harness."""
    if proc.timed_out or proc.returncode == 0:
        return False
    if proc.returncode in (-signal.SIGSEGV, -signal.SIGABRT):
        return True
    return any(f"exitcode: -{int(sig)}" in proc.stderr for sig in (signal.SIGSEGV, signal.SIGABRT)) \
        or "terminate called" in proc.stderr


def run_in_turn(names: Sequence[str], command, root, *, timeout: float, timeout_each: float = 300,
                needs: Optional[dict] = None, **kwargs) -> dict:
    """Run the items ``names`` one after another in one job: ``command(job, names)`` is the job's command line,
    a worker that runs the items in order, marks each one done in ``job/.done/NAME`` (rank 0, after every rank
    finished it) and ends at the first failure. A failed item is reported with the job's output (and what the
    worker wrote to ``job/.failed/NAME.*``); the items after it run again, in a new job, so each passes or fails
    on its own, except those that ``needs`` ({name: an earlier item}) says start from a failed one.
    ``root``: where the jobs go (``root/job1``, ``root/job2`` ...); ``timeout``: for a job of one item, plus
    ``timeout_each`` for every other; ``kwargs``: :func:`run`'s.

    Returns {name: (its job's directory, None) if done, (None, failure text) if not}."""
    root, names, needs = Path(root), list(names), needs or {}
    outcomes: dict = {}
    while names:
        k = 1
        while (root / f"job{k}").exists() or (root / f"job{k}.json").exists():
            k += 1
        job = root / f"job{k}"
        proc = run(command(job, names), output_dir=job, timeout=timeout + timeout_each * (len(names) - 1), **kwargs)
        done = [n for n in names if (job / ".done" / n).exists()]
        outcomes.update((n, (job, None)) for n in done)
        left = [n for n in names if n not in done]
        if not left and proc.returncode != 0:  # every item finished, the job did not end cleanly
            left = [done[-1]]
        if not left:
            break
        failed, names = left[0], left[1:]
        written = "".join(f"\n{f.name}:\n{f.read_text()}" for f in sorted((job / ".failed").glob(f"{failed}.*")))
        outcomes[failed] = (None, f"{failed} failed in a job running {', '.join([*done, *left])} in turn:\n"
                                  f"{proc.describe()}{written}")
        for n in list(names):
            if needs.get(n) in outcomes and outcomes[needs[n]][1] is not None:
                outcomes[n] = (None, f"{n} starts from {needs[n]}, which failed:\n{outcomes[needs[n]][1]}")
                names.remove(n)
    return outcomes


def in_turn(job, items: Sequence[str], run_one) -> None:
    """A worker's side of :func:`run_in_turn`, in every process of a job (a process group started or not):
    ``run_one(item)`` for each item in order; when every rank has finished one, rank 0 marks it done in
    ``job/.done/ITEM``. At the first failure the rank writes its traceback to ``job/.failed/ITEM.rank<R>`` and
    ends its process with exit code 1 (its peers may wait in a collective: torchrun stops them)."""
    import traceback

    import torch.distributed as dist

    job = Path(job)
    for item in items:
        try:
            run_one(item)
        except BaseException:  # noqa: BLE001 - reported as the item's failure, then this process ends
            failed = job / ".failed"
            failed.mkdir(parents=True, exist_ok=True)
            (failed / f"{item}.rank{os.environ.get('RANK', '0')}").write_text(traceback.format_exc())
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if os.environ.get("RANK", "0") == "0":
            (job / ".done").mkdir(parents=True, exist_ok=True)
            (job / ".done" / item).touch()


_LIVE: set = set()  # (Popen, output_dir) of the processes in progress
_LIVE_LOCK = threading.Lock()


def _end(proc: subprocess.Popen, output_dir: Optional[str], seen: Optional[dict] = None) -> None:
    """Nothing of a run outlives it: its session, its descendants (dufu's forked workers run in sessions of their
    own), those seen while it ran (``seen``: pid -> start time; orphaned when a launcher was killed, and still the
    same process), and torchrun workers in sessions of their own, orphaned or not."""
    descendants = set(_descendants(proc.pid))
    descendants.update(pid for pid, started in (seen or {}).items() if started and _start_time(pid) == started)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if output_dir is not None:
        _kill_processes_with_argument(f"train.output_dir={output_dir}")


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat), "" if there is none: with the pid, it
    names one process (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split()[19]


def _descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, their children, and so on (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def stop_all() -> None:
    """End every process still in progress (at the end of the test session)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for entry in live:
        _end(*entry)


def _kill_processes_with_argument(argument: str) -> None:
    """SIGKILL processes running with this exact command-line argument (a run's unique output_dir), e.g. a
    worker orphaned when its torchrun agent was killed, and the processes of this session forked from the warm
    server with it on the command line they were started with (/proc shows them as the server's)."""
    with _LIVE_LOCK:
        pids = {proc.pid for proc, _ in _LIVE if isinstance(proc, warm.WarmPopen) and argument in proc.args}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in args:
            pids.add(int(entry.name))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":  # python tests/launch.py --nproc N SCRIPT ARGS (torchrun_command)
    sys.exit(_launch_script(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
