"""A warm process server for the test session: the processes the tests start as ``python -m dufu ...`` or
``python SCRIPT ...`` are forked from one process that imported torch and dufu once, instead of being new
interpreters that each import them again.

Why: the suite starts about a hundred launchers and fork servers (``dufu train --nproc N``, tests/launch.py's
torchrun launcher, one-process runs), and each spent 2-5 s of CPU importing torch, dufu, TorchDynamo and DTensor
before doing anything, and each launcher's worker server (dufu.cli.workers) as much again: about a fifth of the
suite's CPU time on a 2-core machine. The standard library's fork server (multiprocessing.forkserver) forks
functions with pickled arguments; a program with its own command line, environment, working directory, session
and standard streams, whose exit code is waited for by another process, is what this module adds.

A process forked here is what ``python ARGV`` started by ``subprocess.Popen(..., start_new_session=True)`` would
be (:func:`_become`): a session of its own, the client's standard streams (passed over the socket), environment and
working directory, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, numpy's global generator seeded
afresh (the standard library's is reseeded at every fork), and the interpreter's exit: non-daemon threads joined,
``atexit`` handlers run, streams flushed, the exit code of ``SystemExit`` or 1 after an uncaught exception's
traceback. When it starts a program of its own the standard library's way (multiprocessing's fork server and
resource tracker: ``python -c CODE`` through ``multiprocessing.util.spawnv_passfds``), that program is forked
from it too, with only the descriptors it is given (:func:`_spawnv_passfds`); dufu's worker server then records
its own environment and pid as a new interpreter importing dufu.cli.workers would.

Only what a new interpreter would do identically is forked: the command is ``sys.executable -m dufu`` or
``sys.executable SCRIPT.py`` (no interpreter options), and the environment equals the server's except for
``DUFU_*`` variables, which dufu reads when it runs, not when it is imported, and a few others read only at run
time (:data:`RUN_TIME_PREFIXES`, :func:`eligible`). Anything else
(``-c``, other programs, another ``OMP_NUM_THREADS`` or ``PYTHONPATH``) starts as a new process, as before.
``DUFU_TEST_FRESH_PROCESSES=1`` starts every process new (tests/launch.py).

    python tests/warm.py SOCKET      # the server: prints "ready" when its imports are done
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

_ORIGINAL_SPAWNV = multiprocessing.util.spawnv_passfds  # before _become replaces it in a forked process

# What the server imports before it forks anything: dufu's workers' own preload, torchrun's agent and dufu's
# launcher of it, and the test helpers that the suite's worker scripts import.
PRELOAD = ("dufu.cli.workers", "dufu.cli.train", "dufu.cli.eval", "dufu.engine.trainer", "torch._dynamo",
           "torch.distributed.tensor", "torch.distributed.run", "dufu.cli.torchrun", "dufu.cli", "launch",
           "dufu_testing", "parity")

# The modules run with ``-m`` that are forked (pytest, say, is not: it would find this server's imports made).
WARM_MODULES = ("dufu",)

# Variables that may differ between the server and a process forked from it: read by dufu at run time only;
# inductor's and Triton's cache directories (read when a graph is compiled; dufu.parallel.compile sets the first in
# the test process when a test compiles there, and the processes started after it inherit it); the name of the
# test pytest is running; Intel OpenMP's ``KMP_*``, read when that runtime loads, which the server never does
# (:func:`_serve` checks: torch's wheel brings GNU OpenMP; scikit-learn sets two of them when the test process
# imports it).
RUN_TIME_PREFIXES = ("DUFU_", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTEST_CURRENT_TEST", "KMP_",
                     # an address in the process that set it: inductor sets it again before each compiled library
                     # it loads reads it (torch/_inductor/codecache.py), and the test process's compiles set it
                     "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def eligible(cmd: list[str], env: dict, server_env: dict) -> bool:
    """Whether ``cmd`` run with ``env`` may be forked from a server started with ``server_env``."""
    return why_new(cmd, env, server_env) is None


def why_new(cmd: list[str], env: dict, server_env: dict) -> Optional[str]:
    """Why ``cmd`` run with ``env`` must start as a new process (None: it may be forked)."""
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return "not Python"
    if cmd[1] == "-m":
        if len(cmd) < 3 or cmd[2] not in WARM_MODULES:
            return f"python -m {cmd[2] if len(cmd) > 2 else ''}".strip()
    elif cmd[1].startswith("-") or not cmd[1].endswith(".py"):
        return f"python {cmd[1]}"
    differ = sorted(n for n in set(env) | set(server_env)
                    if env.get(n) != server_env.get(n) and not n.startswith(RUN_TIME_PREFIXES))
    return f"environment differs in {', '.join(differ)}" if differ else None


# ------------------------------------------------------------------------------------------ client


class Server:
    """The client's handle on a running server (``start`` -> ``popen`` ... -> ``stop``)."""

    def __init__(self, env: dict, directory: Path):
        self.env = dict(env)
        self.address = str(directory / "warm.sock")
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.address],
                                      env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
        self._ready = threading.Event()
        self._failure: Optional[str] = None
        threading.Thread(target=self._wait_ready, daemon=True).start()

    def _wait_ready(self) -> None:
        line = self._proc.stdout.readline()
        if line.strip() != "ready":
            self._failure = f"the warm process server did not start (exit {self._proc.wait()}): {line}"
        self._ready.set()

    def popen(self, cmd: list[str], env: dict, cwd) -> "WarmPopen":
        self._ready.wait()
        if self._failure is None and self._proc.poll() is not None:
            self._failure = f"the warm process server ended (exit {self._proc.returncode})"
        if self._failure:
            raise RuntimeError(f"{self._failure}; DUFU_TEST_FRESH_PROCESSES=1 starts every process new")
        return WarmPopen(self.address, cmd, env, cwd)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # the server ends when its stdin does
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


class WarmPopen:
    """What tests/launch.py uses of ``subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, env=env, cwd=cwd,
    start_new_session=True)``: ``pid`` (also the process group's), ``communicate(timeout=)`` (output is kept across
    a ``TimeoutExpired``), ``returncode`` (negative: killed by that signal)."""

    def __init__(self, address: str, cmd: list[str], env: dict, cwd):
        self.args, self.returncode = cmd, None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX)
        try:
            self._conn.connect(address)
            request = json.dumps({"argv": [str(c) for c in cmd[1:]], "env": env,
                                  "cwd": str(cwd) if cwd is not None else os.getcwd()}).encode()
            socket.send_fds(self._conn, [len(request).to_bytes(8, "little") + request], [0, out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        reply = self._conn.makefile("r")
        self.pid = int(reply.readline())
        self._chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self._threads = [threading.Thread(target=self._read, args=(fd,), daemon=True) for fd in (out_r, err_r)]
        self._threads.append(threading.Thread(target=self._wait, args=(reply,), daemon=True))
        for t in self._threads:
            t.start()

    def _read(self, fd: int) -> None:
        with open(fd, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                self._chunks[fd].append(chunk)

    def _wait(self, reply) -> None:
        line = reply.readline()
        self._status = int(line) if line.strip() else None
        self._conn.close()

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        out, err = (b"".join(c).decode(errors="replace").replace("\r\n", "\n") for c in self._chunks.values())
        if self._status is None:  # the server ended before this process did
            self.returncode = -signal.SIGKILL
            err += "\n[test harness: the warm process server ended before this process reported its exit]"
        else:
            self.returncode = self._status
        return out, err


# ------------------------------------------------------------------------------------------ server


def _serve(address: str) -> None:
    for name in PRELOAD:
        __import__(name)
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the warm process server must not fork with threads running: {threads}"
    iomp = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libiomp" in line}
    assert not iomp, f"Intel OpenMP is loaded, so KMP_* variables are not run-time ones (RUN_TIME_PREFIXES): {iomp}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(64)
    clients: dict[int, socket.socket] = {}  # pid -> its client's connection
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    print("ready", flush=True)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sig_r, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is sys.stdin:  # the test session ended
                    return
                if key.fileobj == sig_r:
                    _reap(sig_r, clients)
                else:
                    conn, _ = listener.accept()
                    clients[_fork(conn)] = conn


def _reap(sig_r: int, clients: dict) -> None:
    try:
        os.read(sig_r, 65536)
    except BlockingIOError:
        pass
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the client is gone
                pass
            conn.close()


def _fork(conn: socket.socket) -> int:
    """Fork the process ``conn``'s client asks for; its pid, sent to the client too."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size = int.from_bytes(head, "little")
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    request = json.loads(body)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        return pid
    try:  # the child: never returns into the server's loop
        signal.set_wakeup_fd(-1)
        code = _run(request, fds)
    except BaseException:  # noqa: BLE001 - the harness's own failure, reported as the process's
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def _become(request: dict, fds: list[int]) -> None:
    """This forked process becomes ``python ARGV`` started by ``subprocess.Popen(start_new_session=True)``."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    _close_fds(keep=(0, 1, 2))  # as Popen's close_fds: the server's sockets and the other clients' are not this one's
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    import io

    def stream(fd: int, line_buffering: bool):
        raw = open(fd, "wb", buffering=0, closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), line_buffering=line_buffering,
                                write_through=unbuffered, errors="backslashreplace" if fd == 2 else None)

    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout, sys.stderr = stream(1, False), stream(2, True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if "numpy" in sys.modules:  # a new interpreter seeds numpy's global generator from the OS
        sys.modules["numpy"].random.seed()
    multiprocessing.util.spawnv_passfds = _spawnv_passfds


def _run(request: dict, fds: list[int]) -> int:
    import runpy

    _become(request, fds)
    argv = request["argv"]
    try:
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path[0] = str(Path(argv[0]).resolve().parent)
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit code 1
            sys.excepthook(*sys.exc_info())
            code = 1
        _finalize()
    except SystemExit as e:  # from a thread's join or an atexit handler
        code = _exit_code(e.code)
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finalize() -> None:
    """The interpreter's exit, up to the finalization of its modules: non-daemon threads joined, atexit handlers,
    streams flushed."""
    import atexit

    threading._shutdown()  # what the interpreter calls first at exit
    atexit._run_exitfuncs()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass


def _close_fds(keep) -> None:
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the directory's own descriptor, closed by now
                pass


def _spawnv_passfds(path, args, passfds):
    """``multiprocessing.util.spawnv_passfds`` for ``python -c CODE`` (how multiprocessing starts its fork server
    and resource tracker): forked from this process, with descriptors 0-2 and ``passfds`` only, running CODE as a
    new interpreter's ``__main__``. Any other program is started as before."""
    args = [os.fsdecode(a) for a in args]  # multiprocessing passes the executable as bytes
    if os.fsdecode(path) != sys.executable or "-c" not in args:
        return _ORIGINAL_SPAWNV(path, args, passfds)
    code = args[args.index("-c") + 1]
    for stream in (sys.stdout, sys.stderr):  # what this process printed is not the new program's to print again
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        _close_fds(keep=(0, 1, 2, *map(int, passfds)))
        import atexit

        atexit._clear()  # the launcher's handlers are not the new program's
        workers = sys.modules.get("dufu.cli.workers")
        if workers is not None:  # what a new interpreter importing it first records (dufu.cli.workers)
            workers._SERVER_ENV, workers._SERVER_PID = dict(os.environ), os.getpid()
        sys.argv = ["-c"]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        status = _exit_code(e.code)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        status = 1
    _finalize()
    os._exit(status)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _serve(sys.argv[1])
