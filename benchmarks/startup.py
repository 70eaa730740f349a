"""Time to first step: ``dufu train`` (the default recipe) from launch to the end of its first training step,
split into phases, in fresh processes, with a cold and a warm dufu cache, one process and ``--nproc 4``.

    python benchmarks/startup.py                        # the working tree; 3 repeats of each case
    python benchmarks/startup.py --base /tmp/base       # also a second checkout (e.g. `git worktree add`), side by side
    python benchmarks/startup.py --quick                # 1 repeat, one process only, nothing written
    python benchmarks/startup.py --quick --cases nproc4 # 1 repeat of the --nproc 4 case only

Each case is started the way a user starts it (``python -m dufu train [--nproc 4 train.dist.data_parallel_size=4]``),
except that the first process runs this file in ``--worker`` mode: it records when it reached its first line and
how long its imports took, then calls ``dufu.cli.main`` exactly like ``python -m dufu``. The config gets one more
line, ``train.hooks=[StartupTrace]`` (``benchmarks/startup_probe.py``): a hook that reads the runtime's own start-up
profile (``trainer.runtime.startup``) when the loop starts, times the first steps, and ends the job once every rank
has finished its first step. Times are wall clock (``time.time()``), so that the phases of the launcher, the worker
server and the workers line up. ``--base DIR`` runs the same cases on the code in DIR (``PYTHONPATH``; it needs
``train.hooks``), alternating with the working tree, so both see the same machine load.

How ``--nproc 4`` starts its workers depends on the code, and the launcher finds out which (``dufu.cli.workers``
present or not); every worker reports how it was started, and a run whose workers disagree with the launcher fails:

* fork server (dufu since ff13f52): the launcher starts a ``multiprocessing`` fork server before it loads the config
  (``dufu.cli.workers.start_worker_server``), which imports torch and dufu (``PRELOAD``) beside the launcher's
  checks; torchrun's agent, run in the launcher (``dufu.cli.torchrun``), has it fork the workers. A forked worker
  runs no new interpreter and imports nothing: it has no python start or imports of its own (``-`` in the table),
  its clock starts at the fork. The benchmark appends its probe module to ``PRELOAD`` (the one change it makes to
  what dufu runs): imported last, in the server, it notes when the server's imports ended, and the forked workers
  inherit that note. The launcher's ``__main__`` (this file) is made to look like ``python -m dufu``'s to
  ``multiprocessing``, which would otherwise run it again in every worker.
* new interpreters (dufu before ff13f52): torchrun's agent (``torch.distributed.run.main``, called in the launcher)
  starts ``python -u -m dufu train ...`` per worker. The launcher wraps that function to start this file in
  ``--worker`` mode instead of ``-m dufu``, so each worker records its first line and its imports too.

The moment the launcher calls torchrun's agent is read without patching dufu or torch: an audit hook
(``sys.addaudithook``, which only observes) in the launcher notes when torchrun makes its log directory
(``torchelastic_*``, made by ``config_from_args`` a few milliseconds into the call, in both launches).

Phases (rank 0's for ``--nproc 4``; the launcher's and the worker server's come first):

* launcher before torchrun -- launch (the parent's ``time.time()`` before ``Popen``) to the call of torchrun's agent:
  python start (to this file's first line: interpreter and site start-up), imports (``import dufu.cli``, what
  ``python -m dufu`` imports before it runs the command), config load, checks (the config loaded and checked for
  the world size by ``preflight``, with the torch these import; the worker server started);
* worker server (fork server only; runs beside the launcher, not part of the sum) -- when it started after launch
  (the kernel's start time of its process, ``/proc/PID/stat``) and its start-up and imports (from then to the end
  of its preload);
* torchrun start (to worker process) -- the call of torchrun's agent to the kernel's start time of rank 0's
  process (its fork, or its new interpreter): the rendezvous, the agent's set-up, the fork request or the
  ``exec``; "of which the worker server was still importing" is the part before the server's preload ended (no
  worker is forked before);
* python start, imports -- a new interpreter's (the one process, or a worker of the old launch): from the process
  start to this file's first line, then ``import dufu.cli`` and the modules ``dufu train`` imports (the trainer);
  ``python -X importtime`` of a separate one-process run breaks it down by package (heaviest listed);
* the runtime's start-up profile (:mod:`dufu.engine.runtime`): plan (the config and layout checked, the tokenizer
  trained (cold) or loaded, the corpus tokenized into the dufu cache (cold) or opened, the model on the meta
  device), model build (the parts materialised and parallelized), process group (``init_distributed``, the device
  mesh, the health-check group), precision (the measured matmul peaks: MFU basis, "auto" precision), teacher,
  optimizer;
* config load, run start (other) -- the rest up to the training loop (from the end of the imports, or from a
  forked worker's start): loading the config, the Trainer's set-up around the runtime, ``config.yaml``,
  ``tokenizer.json`` and the start-up summary;
* evaluation at step 0 -- the default recipe evaluates before training (and the metrics writer starts);
* first step -- ``Trainer.train_step`` for step 1 (with ``--compile``: and the compile warm-up, step 1 - step 2).

launch -> first step is the slowest rank's. CPU seconds count every process of the launch: this process adopts
the orphans a launch leaves (``PR_SET_CHILD_SUBREAPER``: the fork server outlives its launcher by a moment and is
reaped by nobody else) and reaps them before it reads its children's CPU time.

Results: ``benchmarks/results/startup-<date>.json`` and ``.md`` with the machine (not for ``--quick``).
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from harness import launch, machine, proc, results as results_files  # noqa: E402

TRACE_ENV, LAUNCH_ENV, STEPS_ENV = "DUFU_STARTUP_TRACE", "DUFU_STARTUP_LAUNCHED", "DUFU_STARTUP_STEPS"
HOOK = launch.hooks_override(("startup_probe.StartupTrace", {}))
SCRIPT = Path(__file__).resolve()
FORK_SERVER, INTERPRETERS = "fork server", "new interpreters"  # the two ways --nproc starts its workers


# ============================================================================ worker mode: the processes of a launch
def worker(argv: list[str]) -> int:
    if sys.path and Path(sys.path[0]).resolve() == SCRIPT.parent:
        sys.path[0] = os.getcwd()  # as under `python -m dufu`: benchmarks/ comes from PYTHONPATH only
    rank = os.environ.get("RANK")
    if "--nproc" in argv and rank is None:
        return launcher(argv)
    t0 = time.time()
    import startup_probe as probe
    import dufu.cli as cli
    import dufu.engine.trainer  # noqa: F401 (the import is what is timed)

    probe.event("imports", t0, time.time())
    probe.STATE.update(role="single" if rank is None else f"rank{rank}", first_line=T_FIRST_LINE,
                       launched=float(os.environ[LAUNCH_ENV]) if "LOCAL_RANK" not in os.environ
                       else proc.process_start_time())
    import dufu

    probe.STATE["extra"].update(start="interpreter", dufu=str(Path(dufu.__file__).parent))  # which checkout ran
    return cli.main(argv)


def launcher(argv: list[str]) -> int:
    """``dufu train --nproc N``'s own process: times its imports, finds out how the code starts its workers, notes
    when it calls torchrun's agent, and writes its trace after the job. It imports nothing before ``dufu.cli.main``
    that ``python -m dufu`` would not: the fork server starts before the launcher imports torch."""
    t0 = time.time()
    import dufu.cli as cli  # what `python -m dufu` imports before it runs the command

    imports = (t0, time.time())
    import importlib.util

    forked = importlib.util.find_spec("dufu.cli.workers") is not None
    torchrun = {}
    sys.addaudithook(_torchrun_clock(torchrun))
    if forked:
        _probe_in_worker_server()
    else:
        _interpreter_workers()
    code = cli.main(argv)
    end = time.time()
    import dufu
    import startup_probe as probe  # only now: it imports torch, which must not delay the worker server's start

    if "at" not in torchrun:
        if code:  # the launcher stopped before torchrun: the driver reports the job's failure and its output
            return code
        raise RuntimeError("torchrun's agent made no torchelastic_* log directory in the launcher: the benchmark "
                           "cannot tell when it was called (see _torchrun_clock)")
    probe.STATE.update(role="launcher", first_line=T_FIRST_LINE, launched=float(os.environ[LAUNCH_ENV]))
    probe.event("imports", *imports)
    probe.event("torchrun (whole job)", torchrun["at"], end)
    probe.STATE["extra"].update(launch=FORK_SERVER if forked else INTERPRETERS, dufu=str(Path(dufu.__file__).parent))
    probe.write_trace()
    return code


def _torchrun_clock(clock: dict):
    """An audit hook that notes (``clock["at"]``) when torchrun's agent, called in this process, makes its log
    directory: ``tempfile.mkdtemp(prefix="torchelastic_")`` in ``DefaultLogsSpecs``, made by ``config_from_args``
    right after the arguments are parsed, in dufu's ``_run`` as in ``torch.distributed.run.main`` (dufu passes no
    ``--log-dir``). An audit hook only observes: the launch runs as it would, with no function of dufu or torch
    wrapped to read the clock (a wrap of ``dufu.cli.torchrun._run`` would have to be installed after that module
    is imported, which imports torch, and before the call). The hook is a comparison per audited event (imports,
    opens, ...): microseconds in all."""

    def hook(event: str, args: tuple) -> None:
        if event == "os.mkdir" and "at" not in clock:
            try:
                made = os.path.basename(os.fsdecode(args[0]))
            except (TypeError, IndexError):
                return
            if made.startswith("torchelastic_"):
                clock["at"] = time.time()

    return hook


def _probe_in_worker_server() -> None:
    """The fork-server launch: list the probe module last in what the worker server imports, so that it notes, in
    the server, when the server's imports ended (the workers forked from it inherit the note: startup_probe's
    IMPORTED_AT and IMPORTED_PID). Nothing outside the server can tell when its imports end; the probe imports
    only what the server has imported by then, so its own import there takes about a millisecond.

    And make this file, the launcher's ``__main__``, look like ``python -m dufu``'s to ``multiprocessing``: a
    worker started with the forkserver method runs the parent's main script again as ``__mp_main__`` when the
    parent was started as a script (``python startup.py``), which would import this file's harness in every worker;
    for ``-m dufu`` (a ``__main__`` module of a package) it does not."""
    import dufu.cli.workers as workers  # no torch: the launcher imports it first thing in `dufu train`

    workers.PRELOAD = (*workers.PRELOAD, "startup_probe")
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None and hasattr(main, "__file__"):
        del main.__file__  # multiprocessing.spawn.get_preparation_data then names no main script to run again


def _interpreter_workers() -> None:
    """The old launch: torchrun's agent (``torch.distributed.run.main``, which that code's ``dufu.cli.torchrun``
    imports by name and calls in the launcher) starts every worker as ``python -u -m dufu ...``. It is wrapped to
    start this file's worker mode instead, the only way to see a new interpreter's first line and its imports.
    Wrapping it imports torch now instead of in the checks: that launcher does everything one after the other,
    so the sum of its phases is the same."""
    import torch.distributed.run as torchrun

    agent = torchrun.main

    def main(args=None):
        args = list(args)
        i = next(i for i in range(len(args) - 1) if args[i] == "-m" and args[i + 1] == "dufu")
        args[i:i + 2] = [str(SCRIPT), "--worker"]
        return agent(args)

    torchrun.main = main


# ============================================================================ driver
PHASES = ["python start", "imports", "config load, run start (other)", "plan", "process group", "precision",
          "model build", "teacher", "optimizer", "evaluation at step 0", "first step", "compile warm-up", "other"]
RUNTIME_PHASES = ("plan", "process group", "precision", "model build", "teacher", "optimizer")
LAUNCHER_PHASES = ("python start", "imports", "config load, checks")
SERVER_ROWS = {"server_start_s": "worker server: started, after launch (beside the launcher)",
               "server_import_s": "worker server: start-up and imports (beside the launcher)"}


def _total(ev: list, label: str) -> float:
    """The union of the label's intervals (events of one label may nest)."""
    spans, seconds, reach = sorted((a, b) for name, a, b in ev if name == label), 0.0, float("-inf")
    for a, b in spans:
        seconds += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return seconds


def _at(ev: list, label: str) -> float:
    return next(a for name, a, b in ev if name == label)


def phases_of(trace: dict, compile_on: bool) -> dict:
    """Seconds per phase of one process's trace. A forked worker has no python start or imports of its own (its
    server did them): its phases count from its fork."""
    ev = trace["events"]
    if trace["role"] == "launcher":
        imports_end = next(b for name, a, b in ev if name == "imports")
        return {"python start": trace["first_line"] - trace["launched"], "imports": _total(ev, "imports"),
                "config load, checks": _at(ev, "torchrun (whole job)") - imports_end}
    if trace.get("start") == "fork":
        out, begun = {}, trace["launched"]
    else:
        out = {"python start": trace["first_line"] - trace["launched"], "imports": _total(ev, "imports")}
        begun = next(b for name, a, b in ev if name == "imports")
    runtime = trace.get("runtime_startup", {})
    out.update(runtime)
    loop = _at(ev, "loop start")
    out["config load, run start (other)"] = loop - begun - sum(runtime.values())
    out["evaluation at step 0"] = _at(ev, "step 1") - loop
    out["first step"] = _total(ev, "step 1")
    if compile_on:
        out["compile warm-up"] = _total(ev, "step 1") - _total(ev, "step 2")
        out["first step"] = _total(ev, "step 2")
    end = max(b for name, a, b in ev if name.startswith("step "))
    out["end"] = end
    out["other"] = end - trace["launched"] - sum(v for k, v in out.items() if k != "end") - (
        _total(ev, "step 2") if compile_on else 0.0)
    return out


def launch_of(traces: dict) -> dict:
    """What the launcher's and the workers' traces of one ``--nproc`` launch say about how it started: the launch,
    the launcher's seconds before torchrun, torchrun start, and for a fork server its start and imports; checks
    that every worker was started the way the launcher's code starts them."""
    lt, main = traces["launcher"], traces["rank0"]
    ranks = {k: t for k, t in traces.items() if k.startswith("rank")}
    want = "fork" if lt["launch"] == FORK_SERVER else "interpreter"
    if {t.get("start") for t in ranks.values()} != {want}:
        raise RuntimeError(f"the launcher's code starts workers from a {lt['launch']}, but the workers say "
                           f"{ {k: t.get('start') for k, t in sorted(ranks.items())} }")
    torchrun_at = _at(lt["events"], "torchrun (whole job)")
    out = {"launch": lt["launch"], "launcher": phases_of(lt, False), "launcher_s": torchrun_at - lt["launched"],
           "torchrun_start_s": main["launched"] - torchrun_at}
    if want == "fork":
        servers = {(t["worker_server"]["pid"], t["worker_server"]["preloaded"]) if t.get("worker_server") else None
                   for t in ranks.values()}
        server = main.get("worker_server")
        if None in servers or len(servers) != 1 or not server["parent"]:
            raise RuntimeError(f"the workers do not name one worker server that imported the probe: {servers}")
        out["server_start_s"] = server["started"] - lt["launched"]
        out["server_import_s"] = server["preloaded"] - server["started"]
        out["server_wait_s"] = max(0.0, min(server["preloaded"], main["launched"]) - torchrun_at)
    return out


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux): the
    fork server of a ``--nproc`` launch is not reaped by its launcher, which exits first, so its CPU time (and its
    workers', which it reaps) would count for nobody. False where the call fails."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans(timeout: float = 120.0) -> None:
    """Wait for the descendants of the finished launch that were left to this process (the worker server exits
    once its launcher has), so that their CPU time is in :func:`proc.children_cpu_seconds`."""
    deadline = time.time() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no children left
        if pid == 0:
            if time.time() > deadline:
                raise RuntimeError(f"processes of the launch still run {timeout:.0f} s after it ended")
            time.sleep(0.02)


def run_case(case: dict, code: Path | None, cache: Path, work: Path, compile_on: bool) -> dict:
    """One fresh launch of a case; returns the phases of rank 0 (or the one process), the launcher's, and the
    launch -> first step seconds (the slowest rank's)."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    out = work / f"run-{trace.name}"
    cmd = [sys.executable, str(SCRIPT), "--worker", "train", *case["args"],
           f"train.output_dir={out}", HOOK] + (["train.compile.enabled=True"] if compile_on else [])
    env = launch.job_env(cache, threads=None, code=code,
                         extra={TRACE_ENV: str(trace), STEPS_ENV: "2" if compile_on else "1"})
    before = proc.children_cpu_seconds()
    env[LAUNCH_ENV] = repr(time.time())
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    wall = time.time() - float(env[LAUNCH_ENV])
    reap_orphans()
    cpu = proc.children_cpu_seconds() - before  # every process of the launch, once reaped
    traces = {p.stem: json.loads(p.read_text()) for p in trace.glob("*.json")}
    shutil.rmtree(trace, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    main_role = "rank0" if "rank0" in traces else "single"
    if job.returncode != 0 or main_role not in traces:
        raise RuntimeError(f"{' '.join(cmd)} failed ({job.returncode}):\n{job.stdout[-2000:]}\n{job.stderr[-4000:]}")
    launched = float(env[LAUNCH_ENV])
    main = traces[main_role]
    result = {"phases": phases_of(main, compile_on), "wall_s": wall, "cpu_s": cpu, "dufu": main["dufu"],
              "launch": "one process"}
    ranks = [t for k, t in traces.items() if k.startswith("rank")]
    result["first_step_end_s"] = max(phases_of(t, compile_on)["end"] for t in (ranks or [main])) - launched
    if "launcher" in traces:
        result.update(launch_of(traces))
    return result


def importtime_breakdown(code: Path | None, cache: Path, work: Path, case: dict) -> dict:
    """``python -X importtime`` of one warm single-process run up to its first step: total import time and the
    heaviest packages (cumulative, as imported from the train path), plus whether optional heavy packages load."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    cmd = [sys.executable, "-X", "importtime", str(SCRIPT), "--worker", "train", *case["args"],
           f"train.output_dir={work / ('imp-' + trace.name)}", HOOK]
    env = launch.job_env(cache, threads=None, code=code, extra={TRACE_ENV: str(trace), LAUNCH_ENV: repr(time.time())})
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    reap_orphans()
    shutil.rmtree(trace, ignore_errors=True)
    rows = []  # (depth, name, self_us, cumulative_us)
    for line in job.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((len(m.group(3)) // 2, m.group(4), int(m.group(1)), int(m.group(2))))
    top = [r for r in rows if r[0] == 0]
    watch = ["torch", "torch.distributed.tensor", "torch._dynamo", "torch.distributed.pipelining",
             "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.utils.tensorboard", "tensorboard",
             "matplotlib", "transformers", "sklearn", "scipy", "tokenizers", "numpy", "sympy", "tqdm", "yaml",
             "safetensors", "PIL"]
    first = {}
    for depth, name, _, cum in rows:  # each package's own cumulative time, where it was first imported
        if name in watch and name not in first:
            first[name] = cum / 1e6
    return {"total_s": sum(r[3] for r in top) / 1e6, "packages_s": first,
            "heaviest_top_level": sorted(((n, c / 1e6) for _, n, _, c in top), key=lambda x: -x[1])[:8]}


CASES = [
    {"key": "1proc", "title": "1 process", "args": []},
    {"key": "nproc4", "title": "--nproc 4 (dp4)", "args": ["--nproc", "4", "train.dist.data_parallel_size=4"]},
]


def main() -> int:
    keys = [c["key"] for c in CASES]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, default=None, help="a second checkout to compare (its dufu/ on PYTHONPATH)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 repeat, one process only (unless --cases); nothing written")
    ap.add_argument("--cases", default=None, help=f"comma-separated cases to run, of {','.join(keys)} (default: all; "
                                                  "--quick: 1proc)")
    ap.add_argument("--compile", action="store_true", help="also a warm one-process case with torch.compile")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    chosen = args.cases.split(",") if args.cases else (keys[:1] if args.quick else keys)
    if set(chosen) - set(keys):
        ap.error(f"--cases: unknown {', '.join(sorted(set(chosen) - set(keys)))}; the cases are {', '.join(keys)}")
    cases = [c for c in CASES if c["key"] in chosen]
    trees = {"now": launch.REPO} | ({"base": args.base.resolve()} if args.base else {})
    info = machine.describe()  # before anything runs: the peaks of a machine this benchmark does not load yet
    if not adopt_orphans():
        print("warning: cannot adopt orphaned processes (PR_SET_CHILD_SUBREAPER): the CPU seconds of a --nproc "
              "launch miss its worker server and workers", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="dufu-startup-"))
    load0 = os.getloadavg()
    subprocess.run([sys.executable, "-c", "import torch.distributed.tensor"], check=True)  # page cache warm for all
    rows = {}
    for case in cases:
        for rep in range(repeats):
            for tree, code in trees.items():  # alternate the trees: both see the same machine load
                cache = work / f"cache-{tree}-{case['key']}-{rep}"  # cold: a new empty dufu cache
                for temp in ("cold", "warm"):
                    r = run_case(case, code, cache, work, compile_on=False)
                    rows.setdefault((case["key"], temp, tree), []).append(r)
                    print(f"[{case['key']} {temp} {tree} #{rep + 1}] launch -> first step "
                          f"{r['first_step_end_s']:.2f} s, {r['cpu_s']:.1f} CPU s, workers: {r['launch']} (dufu "
                          f"from {r['dufu']}; load {os.getloadavg()[0]:.1f})", flush=True)
    if args.compile:
        for tree, code in trees.items():
            cache = work / f"cache-{tree}-1proc-0"
            r = run_case(CASES[0], code, cache, work, compile_on=True)
            rows.setdefault(("1proc+compile", "warm", tree), []).append(r)
            print(f"[compile {tree}] launch -> step 2 {r['first_step_end_s']:.2f} s", flush=True)
    imports = {tree: importtime_breakdown(code, work / f"cache-{tree}-{cases[0]['key']}-0", work, CASES[0])
               for tree, code in trees.items()}  # a warm cache, whichever case made it
    results = {"date": results_files.today(), "machine": info, "repeats": repeats,
               "load_average_start": [round(x, 2) for x in load0],
               "load_average_end": [round(x, 2) for x in os.getloadavg()], "trees": {k: str(v) for k, v in trees.items()},
               "cases": [summarize(k, v) for k, v in rows.items()], "importtime": imports}
    shutil.rmtree(work, ignore_errors=True)
    text = markdown(results)
    print(text)
    if not args.quick:
        stem = results_files.write(results_files.stem(results_files.RESULTS, "startup", results["date"]), results,
                                   text)
        print(f"wrote {stem}.json and .md")
    return 0


def summarize(key, runs: list[dict]) -> dict:
    case, temp, tree = key

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    names = PHASES + list(dict.fromkeys(k for r in runs for k in r["phases"] if k not in PHASES and k != "end"))
    phases = {p: med([r["phases"].get(p) for r in runs]) for p in names}
    # a phase a run has not got is None ("-"): a forked worker's python start and imports; an absent runtime
    # phase (no teacher) is 0 in the runtime's profile already
    launches = {r["launch"] for r in runs}
    if len(launches) != 1:
        raise RuntimeError(f"{key}: the runs started their workers differently: {launches}")
    out = {"case": case, "cache": temp, "tree": tree, "runs": len(runs), "launch": launches.pop(),
           "phases_s": phases, "first_step_end_s": med([r["first_step_end_s"] for r in runs]),
           "cpu_s": med([r["cpu_s"] for r in runs]),
           "all_first_step_end_s": [round(r["first_step_end_s"], 3) for r in runs]}
    for k in ("launcher_s", "torchrun_start_s", *SERVER_ROWS, "server_wait_s"):
        if k in runs[0]:
            out[k] = med([r[k] for r in runs])
    if "launcher" in runs[0]:
        out["launcher_phases_s"] = {p: med([r["launcher"].get(p) for r in runs]) for p in LAUNCHER_PHASES}
    return out


def markdown(res: dict) -> str:
    m = res["machine"]
    order = {"1proc": 0, "nproc4": 1, "1proc+compile": 2, "cold": 0, "warm": 1, "base": 0, "now": 1}
    cols = sorted(res["cases"], key=lambda c: (order[c["case"]], order[c["cache"]], order[c["tree"]]))
    head = [f"{c['case']} {c['cache']}" + (f" ({c['tree']})" if len(res["trees"]) > 1 else "") for c in cols]
    lines = [f"# Time to first step - {res['date']}", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; dufu {m['dufu_commit']}; {machine.peaks_text(m)}. Load average "
             f"{res['load_average_start'][0]} "
             f"at the start, {res['load_average_end'][0]} at the end. Code: "
             + ", ".join(f"{k} = {v}" for k, v in res["trees"].items()) + ".", "",
             f"`dufu train` (default recipe) from launch to the end of step 1, median of {res['repeats']} fresh "
             "launches per column, seconds. cold = a new empty dufu cache (BPE training, tokenizing the corpus, "
             "measuring the matmul peaks), warm = the same cache again. plan ... optimizer: the runtime's own "
             "start-up profile (`trainer.runtime.startup`). For `--nproc 4` the phases are rank 0's, after the "
             "launcher's own work before torchrun; workers come from a fork server (started by the launcher "
             "before its checks, importing torch and dufu beside them: its two lines are not part of the sum, and "
             "a forked worker has no python start or imports of its own) or are new interpreters. The total is "
             "the slowest rank's first step (`benchmarks/startup.py` says how each phase is measured).", ""]
    lines.append("| phase | " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * len(cols))

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |")

    if any("launcher_s" in c for c in cols):
        lines.append("| workers | " + " | ".join(c["launch"] for c in cols) + " |")
        row("launcher before torchrun", [c.get("launcher_s") for c in cols])
        for p in LAUNCHER_PHASES:
            row(f"&nbsp;&nbsp;launcher: {p}", [c.get("launcher_phases_s", {}).get(p) for c in cols])
        if any("server_start_s" in c for c in cols):
            for k, label in SERVER_ROWS.items():
                row(label, [c.get(k) for c in cols])
        row("torchrun start (to worker process)", [c.get("torchrun_start_s") for c in cols])
        if any("server_wait_s" in c for c in cols):
            row("&nbsp;&nbsp;of which the worker server was still importing", [c.get("server_wait_s") for c in cols])
    for p in dict.fromkeys(p for c in cols for p in c["phases_s"]):
        values = [c["phases_s"].get(p) for c in cols]
        if p in ("compile warm-up", "teacher") and not any(values):
            continue
        row(p, values)
    row("**launch -> first step**", [c["first_step_end_s"] for c in cols])
    row("CPU seconds, all processes of the launch", [c["cpu_s"] for c in cols])
    lines += ["", "## Imports (`python -X importtime`, one warm single-process run up to step 1)", ""]
    for tree, imp in res["importtime"].items():
        pk = ", ".join(f"{k} {v:.2f}" for k, v in sorted(imp["packages_s"].items(), key=lambda x: -x[1]) if v >= 0.01)
        absent = [k for k in ("transformers", "matplotlib", "sklearn", "scipy", "tensorboard") if k not in imp["packages_s"]]
        lines.append(f"* {tree}: {imp['total_s']:.2f} s of imports in all; by package (cumulative s, where first "
                     f"imported): {pk}. Not imported before step 1: {', '.join(absent) or 'none of them'}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        raise SystemExit(worker(sys.argv[2:]))
    raise SystemExit(main())
