"""Time to first step: ``dufu train`` (the default recipe) from launch to the end of its first training step,
split into phases, in fresh processes, with a cold and a warm dufu cache, one process and ``--nproc 4``.

    python benchmarks/startup.py                        # the working tree; 3 repeats of each case
    python benchmarks/startup.py --base /tmp/base       # also a second checkout (e.g. `git worktree add`), side by side
    python benchmarks/startup.py --quick                # 1 repeat, one process only

Each case is started the way a user starts it (``python -m dufu train [--nproc 4 train.dist.data_parallel_size=4]``),
except that the processes run this file in ``--worker`` mode: it records when the process reached its first line
and how long its imports took, then calls ``dufu.cli.main`` exactly like ``python -m dufu``. The config gets one
more line, ``train.hooks=[StartupTrace]`` (``benchmarks/startup_probe.py``): a hook that reads the runtime's own
start-up profile (``trainer.runtime.startup``) when the loop starts, times the first steps, and ends the job once
every rank has finished its first step (a barrier, then ``os._exit``). Under ``--nproc`` the launcher's torchrun
agent (``torch.distributed.run.main``, wrapped in the launcher with a clock) starts this file instead of
``-m dufu`` in every worker. Times are wall clock (``time.time()``), so that the phases of the launcher, the
torchrun agent and the workers line up. ``--base DIR`` runs the same cases on the code in DIR (``PYTHONPATH``;
it needs ``train.hooks``), alternating with the working tree, so both see the same machine load.

Phases (rank 0's for ``--nproc 4``; its launcher's come first):

* python start -- from launch (the parent's ``time.time()`` before ``Popen``; for a worker, the kernel's process start
  time) to the first line of this file: interpreter and site start-up;
* imports -- ``import dufu.cli`` and the modules ``dufu train`` imports (the trainer, or the launcher's checks);
  ``python -X importtime`` of a separate one-process run breaks it down by package (heaviest listed);
* the runtime's start-up profile (:mod:`dufu.engine.runtime`): plan (the config and layout checked, the tokenizer
  trained (cold) or loaded, the corpus tokenized into the dufu cache (cold) or opened, the model on the meta
  device), model build (the parts materialised and parallelized), process group (``init_distributed``, the device
  mesh, the health-check group), precision (the measured matmul peaks: MFU basis, "auto" precision), teacher,
  optimizer;
* torchrun start -- the launcher's call of torchrun's agent to the moment the worker process exists;
* config load, run start (other) -- the rest up to the training loop: loading the config, the Trainer's set-up
  around the runtime, ``config.yaml``, ``tokenizer.json`` and the start-up summary;
* evaluation at step 0 -- the default recipe evaluates before training (and the metrics writer starts);
* first step -- ``Trainer.train_step`` for step 1 (with ``--compile``: and the compile warm-up, step 1 - step 2).

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


# ============================================================================ worker: the process's own start
def _launcher_clock(probe) -> None:
    """Wrap torchrun's agent (torch.distributed.run.main, which dufu's launcher calls in its own process) with a
    clock, and have it start this file's worker mode instead of ``-m dufu`` in every worker."""
    import torch.distributed.run as torchrun

    agent = torchrun.main

    def main(args=None):
        args = list(args)
        i = next(i for i in range(len(args) - 1) if args[i] == "-m" and args[i + 1] == "dufu")
        args[i:i + 2] = [str(Path(__file__).resolve()), "--worker"]
        t0 = time.time()
        try:
            return agent(args)
        finally:
            probe.event("torchrun (whole job)", t0, time.time())

    torchrun.main = main


def worker(argv: list[str]) -> int:
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = os.getcwd()  # as under `python -m dufu`: benchmarks/ comes from PYTHONPATH only
    rank = os.environ.get("RANK")
    launcher = "--nproc" in argv and rank is None
    t0 = time.time()
    import startup_probe as probe

    if launcher:
        _launcher_clock(probe)  # before dufu imports torchrun's agent
    import dufu.cli as cli

    if launcher:
        import dufu.engine.preflight  # noqa: F401
        import dufu.parallel.launch  # noqa: F401
    else:
        import dufu.engine.trainer  # noqa: F401 (the import is what is timed)
    probe.event("imports", t0, time.time())
    probe.STATE.update(role="launcher" if launcher else ("single" if rank is None else f"rank{rank}"),
                       first_line=T_FIRST_LINE,
                       launched=float(os.environ[LAUNCH_ENV]) if "LOCAL_RANK" not in os.environ
                       else proc.process_start_time())
    import dufu

    probe.STATE["extra"]["dufu"] = str(Path(dufu.__file__).parent)  # which checkout's dufu ran
    code = cli.main(argv)
    if launcher:
        probe.write_trace()
    return code


# ============================================================================ driver
PHASES = ["python start", "imports", "config load, run start (other)", "plan", "torchrun start", "process group",
          "precision", "model build", "teacher", "optimizer", "evaluation at step 0", "first step",
          "compile warm-up", "other"]
RUNTIME_PHASES = ("plan", "process group", "precision", "model build", "teacher", "optimizer")
LAUNCHER_PHASES = ("python start", "imports", "config load, checks (other)")


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
    """Seconds per phase of one process's trace."""
    ev = trace["events"]
    imports_end = next(b for name, a, b in ev if name == "imports")
    out = {"python start": trace["first_line"] - trace["launched"], "imports": _total(ev, "imports")}
    if trace["role"] == "launcher":
        out["config load, checks (other)"] = _at(ev, "torchrun (whole job)") - imports_end
        return out
    runtime = trace.get("runtime_startup", {})
    out.update(runtime)
    loop = _at(ev, "loop start")
    out["config load, run start (other)"] = loop - imports_end - sum(runtime.values())
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


def run_case(case: dict, code: Path | None, cache: Path, work: Path, compile_on: bool) -> dict:
    """One fresh launch of a case; returns the phases of rank 0 (or the one process), the launcher's, and the
    launch -> first step seconds (the slowest rank's)."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    out = work / f"run-{trace.name}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "train", *case["args"],
           f"train.output_dir={out}", HOOK] + (["train.compile.enabled=True"] if compile_on else [])
    env = launch.job_env(cache, threads=None, code=code,
                         extra={TRACE_ENV: str(trace), STEPS_ENV: "2" if compile_on else "1"})
    before = proc.children_cpu_seconds()
    env[LAUNCH_ENV] = repr(time.time())
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    wall = time.time() - float(env[LAUNCH_ENV])
    cpu = proc.children_cpu_seconds() - before  # every process of the launch, once reaped
    traces = {p.stem: json.loads(p.read_text()) for p in trace.glob("*.json")}
    shutil.rmtree(trace, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    main_role = "rank0" if "rank0" in traces else "single"
    if job.returncode != 0 or main_role not in traces:
        raise RuntimeError(f"{' '.join(cmd)} failed ({job.returncode}):\n{job.stdout[-2000:]}\n{job.stderr[-4000:]}")
    launched = float(env[LAUNCH_ENV])
    main = traces[main_role]
    result = {"phases": phases_of(main, compile_on), "wall_s": wall, "cpu_s": cpu, "dufu": main["dufu"]}
    ranks = [t for k, t in traces.items() if k.startswith("rank")]
    result["first_step_end_s"] = max(phases_of(t, compile_on)["end"] for t in (ranks or [main])) - launched
    if "launcher" in traces:
        lt = traces["launcher"]
        result["launcher"] = phases_of(lt, compile_on)
        torchrun_at = _at(lt["events"], "torchrun (whole job)")
        result["torchrun_start_s"] = main["launched"] - torchrun_at
        result["launcher_s"] = torchrun_at - launched
    return result


def importtime_breakdown(code: Path | None, cache: Path, work: Path, case: dict) -> dict:
    """``python -X importtime`` of one warm single-process run up to its first step: total import time and the
    heaviest packages (cumulative, as imported from the train path), plus whether optional heavy packages load."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    cmd = [sys.executable, "-X", "importtime", str(Path(__file__).resolve()), "--worker", "train", *case["args"],
           f"train.output_dir={work / ('imp-' + trace.name)}", HOOK]
    env = launch.job_env(cache, threads=None, code=code, extra={TRACE_ENV: str(trace), LAUNCH_ENV: repr(time.time())})
    job = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, default=None, help="a second checkout to compare (its dufu/ on PYTHONPATH)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 repeat, one process only; nothing written")
    ap.add_argument("--compile", action="store_true", help="also a warm one-process case with torch.compile")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    cases = CASES[:1] if args.quick else CASES
    trees = {"now": launch.REPO} | ({"base": args.base.resolve()} if args.base else {})
    info = machine.describe()  # before anything runs: the peaks of a machine this benchmark does not load yet
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
                          f"{r['first_step_end_s']:.2f} s, {r['cpu_s']:.1f} CPU s (dufu from {r['dufu']}; load "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
    if args.compile:
        for tree, code in trees.items():
            cache = work / f"cache-{tree}-1proc-0"
            r = run_case(CASES[0], code, cache, work, compile_on=True)
            rows.setdefault(("1proc+compile", "warm", tree), []).append(r)
            print(f"[compile {tree}] launch -> step 2 {r['first_step_end_s']:.2f} s", flush=True)
    imports = {tree: importtime_breakdown(code, work / f"cache-{tree}-1proc-0", work, CASES[0])
               for tree, code in trees.items()}
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
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    names = PHASES + list(dict.fromkeys(k for r in runs for k in r["phases"] if k not in PHASES and k != "end"))
    phases = {p: med([r["phases"].get(p, 0.0) for r in runs]) for p in names}
    out = {"case": case, "cache": temp, "tree": tree, "runs": len(runs), "phases_s": phases,
           "first_step_end_s": med([r["first_step_end_s"] for r in runs]),
           "cpu_s": med([r["cpu_s"] for r in runs]),
           "all_first_step_end_s": [round(r["first_step_end_s"], 3) for r in runs]}
    if "launcher" in runs[0]:
        out["launcher_s"] = med([r["launcher_s"] for r in runs])
        out["torchrun_start_s"] = med([r["torchrun_start_s"] for r in runs])
        out["launcher_phases_s"] = {p: med([r["launcher"].get(p, 0.0) for r in runs]) for p in LAUNCHER_PHASES}
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
             "start-up profile (`trainer.runtime.startup`). For `--nproc 4` the phases are rank 0's; the "
             "launcher's own work before torchrun is the line 'launcher before torchrun', and the total is the "
             "slowest rank's first step.", ""]
    lines.append("| phase | " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * len(cols))

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |")

    if any("launcher_s" in c for c in cols):
        row("launcher before torchrun", [c.get("launcher_s") for c in cols])
        for p in LAUNCHER_PHASES[1:]:
            row(f"&nbsp;&nbsp;launcher: {p}", [c.get("launcher_phases_s", {}).get(p) for c in cols])
        row("torchrun start (to worker process)", [c.get("torchrun_start_s") for c in cols])
    for p in dict.fromkeys(p for c in cols for p in c["phases_s"]):
        if p == "torchrun start":
            continue
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
