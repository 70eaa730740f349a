"""Time to first step: ``dufu train`` (the default recipe) from launch to the end of its first training step,
split into phases, in fresh processes, with a cold and a warm dufu cache, one process and ``--nproc 4``.

    python benchmarks/startup.py                        # the working tree; 3 repeats of each case
    python benchmarks/startup.py --base /tmp/base       # also a second checkout (e.g. `git worktree add`), side by side
    python benchmarks/startup.py --quick                # 1 repeat, one process only

Each case is started the way a user starts it (``python -m dufu train [--nproc 4 train.dist.data_parallel_size=4]``),
except that the processes run this file in ``--worker`` mode: it imports ``dufu.cli`` and calls its ``main``
exactly like ``python -m dufu``, after wrapping the functions of the start-up path with timers (wall clock,
``time.time()``, so that the phases of the launcher, the torchrun agent and the workers line up), and ends the
job once every rank has finished its first step (a barrier, then ``os._exit``). Under ``--nproc`` the launcher's
torchrun command runs this file instead of ``-m dufu`` in every worker. ``--base DIR`` runs the same cases on the
code in DIR (``PYTHONPATH``), alternating with the working tree, so both see the same machine load.

Phases (rank 0's for ``--nproc 4``; its launcher's come first):

* python start -- from launch (the parent's ``time.time()`` before ``Popen``; for a worker, the kernel's process start
  time) to the first line of this file: interpreter and site start-up;
* imports -- ``import dufu.cli`` and the modules ``dufu train`` imports (the trainer, or the launcher's preflight);
  ``python -X importtime`` of a separate one-process run breaks it down by package (heaviest listed);
* config load -- ``LazyConfig.load`` + overrides (``dufu.cli.load_train_config``);
* tokenizer / data / meta model -- the ``instantiate`` calls of ``plan_run``: building (cold: training) the BPE
  tokenizer, tokenizing the corpus into the dufu cache (cold) or opening it (warm), the model on the meta device;
* torchrun -- the launcher's ``torchrun`` call to the moment the worker process exists;
* process group -- ``init_distributed``, the device mesh and the health-check group;
* precision / peak -- the measured matmul peaks (MFU basis; "auto" precision);
* model build -- materialising the parts (``_model_to_split``, ``_build_parts``) and the optimizers;
* run start -- ``_begin`` (config.yaml, tokenizer.json, start-up summary) and the metrics writer (TensorBoard);
* evaluation at step 0 -- the default recipe evaluates before training;
* first step -- ``Trainer.train_step`` for step 1 (with ``--compile``: and the compile warm-up, step 1 - step 2).

Results: ``benchmarks/results/startup-<date>.json`` and ``.md`` with the CPU model (not for ``--quick``).
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
import _machine  # the benchmarks' shared machine description (benchmarks/_machine.py)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
TRACE_ENV, LAUNCH_ENV, STEPS_ENV = "DUFU_STARTUP_TRACE", "DUFU_STARTUP_LAUNCHED", "DUFU_STARTUP_STEPS"

# ============================================================================ worker: timers around the start-up path
_events: list[tuple[str, float, float]] = []


def _timed(owner, name: str, label, only_first: bool = False):
    """Replace ``owner.name`` by a wrapper that records (label, start, end); ``label`` may be a function of the
    call's arguments. A missing attribute is skipped (the other checkout may not have it)."""
    original = getattr(owner, name, None)
    if original is None:
        return
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        t0 = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            if not only_first or calls[0] == 1:
                _events.append((label(*args, **kwargs) if callable(label) else label, t0, time.time()))

    setattr(owner, name, wrapper)


def _instantiate_label(node, *args, **kwargs) -> str:
    from dufu.config.lazy import target_name

    target = target_name(node.get("_target_")) if hasattr(node, "get") else ""
    if "tokenizer" in target:
        return "tokenizer"
    if "dataset" in target:
        return "data"
    return "meta model"


def _process_start_time() -> float:
    """When the kernel started this process (wall clock): its start in clock ticks since boot (/proc, 10 ms
    resolution), placed on the wall clock through CLOCK_BOOTTIME (the boot time in /proc/stat is whole seconds)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    start_since_boot = int(stat.rsplit(")", 1)[1].split()[19]) / ticks
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - start_since_boot)


def _write_trace(role: str, extra: dict) -> None:
    trace = Path(os.environ[TRACE_ENV])
    data = {"role": role, "pid": os.getpid(), "first_line": T_FIRST_LINE, "events": _events, **extra}
    (trace / f"{role}.json").write_text(json.dumps(data))


def worker(argv: list[str]) -> int:
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path[0] = os.getcwd()  # as under `python -m dufu`: benchmarks/ is not importable
    launched = float(os.environ[LAUNCH_ENV]) if "LOCAL_RANK" not in os.environ else _process_start_time()
    rank = os.environ.get("RANK")
    launcher = "--nproc" in argv and rank is None
    role = "launcher" if launcher else ("single" if rank is None else f"rank{rank}")
    t0 = time.time()
    import dufu.cli as cli

    if launcher:
        import dufu.engine.preflight  # noqa: F401
        import dufu.parallel.launch as launch_mod
    else:
        import dufu.engine.trainer as trainer_mod
    _events.append(("imports", t0, time.time()))
    _timed(cli, "load_train_config", "config load")
    import dufu.engine.preflight as preflight

    _timed(preflight, "instantiate", _instantiate_label)
    if launcher:
        _timed(preflight, "preflight", "preflight")
        original_cmd = launch_mod.torchrun_command

        def torchrun_command(*args, **kwargs):  # the workers run this file in --worker mode
            cmd = original_cmd(*args, **kwargs)
            i = cmd.index("-m", 3)
            return cmd[:i] + [str(Path(__file__).resolve()), "--worker"] + cmd[i + 2:]

        launch_mod.torchrun_command = torchrun_command
        import subprocess as sp

        _timed(sp, "call", "torchrun (whole job)")  # torchrun as a subprocess, or in the launcher's process:
        _timed(cli, "run_torchrun", "torchrun (whole job)")
        code = cli.main(argv)
        _write_trace(role, {"launched": launched, "dufu": str(Path(cli.__file__).parent)})
        return code
    _worker_timers(trainer_mod, role, launched, cli)
    return cli.main(argv)


def _worker_timers(trainer_mod, role: str, launched: float, cli) -> None:
    import torch.distributed as dist

    from dufu.engine import report
    from dufu.parallel.parallel_dims import ParallelDims

    T = trainer_mod.Trainer
    _timed(trainer_mod, "plan_run", "plan_run")
    _timed(trainer_mod, "init_distributed", "process group")
    _timed(ParallelDims, "build_mesh", "process group")
    _timed(dist, "new_group", "process group")
    for name in ("choose_precision", "device_peak_flops", "agree"):
        _timed(trainer_mod, name, "precision / peak")
    _timed(T, "_model_to_split", "model build")
    _timed(T, "_build_parts", "model build")
    _timed(T, "_build_optimizer", "model build")
    _timed(T, "__init__", "Trainer.__init__")
    _timed(T, "_begin", "run start")
    _timed(report.RunLog, "__init__", "run start")
    _timed(T, "evaluate", "evaluation at step 0", only_first=True)
    original_step, stop_after = T.train_step, int(os.environ.get(STEPS_ENV, "1"))

    def train_step(self, micro_batches):
        t0 = time.time()
        out = original_step(self, micro_batches)
        _events.append((f"step {self.step + 1}", t0, time.time()))
        if self.step + 1 == stop_after:  # every rank gets here: end the job without the rest of the run
            _write_trace(role, {"launched": launched, "dufu": str(Path(cli.__file__).parent)})
            if dist.is_initialized():
                dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return out

    T.train_step = train_step


# ============================================================================ driver
PHASES = ["python start", "imports", "config load", "tokenizer", "data", "meta model", "plan_run (other)",
          "torchrun start", "process group", "precision / peak", "model build", "Trainer.__init__ (other)",
          "run start", "evaluation at step 0", "first step", "compile warm-up", "other"]


def phases_of(trace: dict, compile_on: bool) -> dict:
    """Seconds per phase of one process's trace (events of the same label are summed; nested ones are
    taken out of their parent)."""
    ev = trace["events"]

    def total(label: str) -> float:  # the union of the label's intervals (a wrapped call may nest in another)
        spans, seconds, reach = sorted((a, b) for name, a, b in ev if name == label), 0.0, float("-inf")
        for a, b in spans:
            seconds += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        return seconds
    out = {"python start": trace["first_line"] - trace["launched"], "imports": total("imports"),
           "config load": total("config load")}
    for name in ("tokenizer", "data", "meta model"):
        out[name] = total(name)
    if trace["role"] == "launcher":
        out["preflight (other)"] = total("preflight") - out["tokenizer"] - out["data"] - out["meta model"]
        return out
    out["plan_run (other)"] = total("plan_run") - out["tokenizer"] - out["data"] - out["meta model"]
    for name in ("process group", "precision / peak", "model build", "run start", "evaluation at step 0"):
        out[name] = total(name)
    out["Trainer.__init__ (other)"] = (total("Trainer.__init__") - total("plan_run") - out["process group"]
                                       - out["precision / peak"] - out["model build"])
    out["first step"] = total("step 1")
    if compile_on:
        out["compile warm-up"] = total("step 1") - total("step 2")
        out["first step"] = total("step 2")
    end = max(b for name, a, b in ev if name.startswith("step "))
    out["end"] = end
    out["other"] = end - trace["launched"] - sum(v for k, v in out.items() if k != "end") - (
        total("step 2") if compile_on else 0.0)
    return out


def run_case(case: dict, code: Path | None, cache: Path, work: Path, compile_on: bool) -> dict:
    """One fresh launch of a case; returns the phases of rank 0 (or the one process), the launcher's, and the
    launch -> first step seconds (the slowest rank's)."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    out = work / f"run-{trace.name}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "train", *case["args"],
           f"train.output_dir={out}"] + (["train.compile.enabled=True"] if compile_on else [])
    env = dict(os.environ, DUFU_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1", **{TRACE_ENV: str(trace)})
    env[STEPS_ENV] = "2" if compile_on else "1"
    env.pop("PYTHONPATH", None)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env[LAUNCH_ENV] = repr(time.time())
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    wall = time.time() - float(env[LAUNCH_ENV])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the launch, once reaped
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    traces = {p.stem: json.loads(p.read_text()) for p in trace.glob("*.json")}
    shutil.rmtree(trace, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    main_role = "rank0" if "rank0" in traces else "single"
    if proc.returncode != 0 or main_role not in traces:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    launched = float(env[LAUNCH_ENV])
    main = traces[main_role]
    result = {"phases": phases_of(main, compile_on), "wall_s": wall, "cpu_s": cpu, "dufu": main["dufu"]}
    ranks = [t for k, t in traces.items() if k.startswith("rank")]
    result["first_step_end_s"] = max(phases_of(t, compile_on)["end"] for t in (ranks or [main])) - launched
    if "launcher" in traces:
        lt = traces["launcher"]
        result["launcher"] = phases_of(lt, compile_on)
        torchrun_at = next(a for name, a, b in lt["events"] if name == "torchrun (whole job)")
        result["torchrun_start_s"] = main["launched"] - torchrun_at
        result["launcher_s"] = torchrun_at - launched
    return result


def importtime_breakdown(code: Path | None, cache: Path, work: Path, case: dict) -> dict:
    """``python -X importtime`` of one warm single-process run up to its first step: total import time and the
    heaviest packages (cumulative, as imported from the train path), plus whether optional heavy packages load."""
    trace = Path(tempfile.mkdtemp(prefix="trace-", dir=work))
    cmd = [sys.executable, "-X", "importtime", str(Path(__file__).resolve()), "--worker", "train", *case["args"],
           f"train.output_dir={work / ('imp-' + trace.name)}"]
    env = dict(os.environ, DUFU_CACHE_DIR=str(cache), **{TRACE_ENV: str(trace), LAUNCH_ENV: repr(time.time())})
    env.pop("PYTHONPATH", None)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=900)
    shutil.rmtree(trace, ignore_errors=True)
    rows = []  # (depth, name, self_us, cumulative_us)
    for line in proc.stderr.splitlines():
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


def machine_info() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") + (" (+ uncommitted changes in dufu/)"
                                                      if git("status", "--porcelain", "--", "dufu") else "")
    return _machine.machine_info(dufu_commit=commit)


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
    trees = {"now": REPO} | ({"base": args.base.resolve()} if args.base else {})
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
    results = {"date": _dt.date.today().isoformat(), "machine": machine_info(), "repeats": repeats,
               "load_average_start": [round(x, 2) for x in load0],
               "load_average_end": [round(x, 2) for x in os.getloadavg()], "trees": {k: str(v) for k, v in trees.items()},
               "cases": [summarize(k, v) for k, v in rows.items()], "importtime": imports}
    shutil.rmtree(work, ignore_errors=True)
    text = markdown(results)
    print(text)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = RESULTS / f"startup-{results['date']}"
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem}.json and .md")
    return 0


def summarize(key, runs: list[dict]) -> dict:
    case, temp, tree = key
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    phases = {p: med([r["phases"].get(p, 0.0) for r in runs]) for p in PHASES}
    out = {"case": case, "cache": temp, "tree": tree, "runs": len(runs), "phases_s": phases,
           "first_step_end_s": med([r["first_step_end_s"] for r in runs]),
           "cpu_s": med([r["cpu_s"] for r in runs]),
           "all_first_step_end_s": [round(r["first_step_end_s"], 3) for r in runs]}
    if "launcher" in runs[0]:
        out["launcher_s"] = med([r["launcher_s"] for r in runs])
        out["torchrun_start_s"] = med([r["torchrun_start_s"] for r in runs])
        out["launcher_phases_s"] = {p: med([r["launcher"].get(p, 0.0) for r in runs])
                                    for p in ("python start", "imports", "config load", "tokenizer", "data",
                                              "meta model", "preflight (other)")}
    return out


def markdown(res: dict) -> str:
    m = res["machine"]
    order = {"1proc": 0, "nproc4": 1, "1proc+compile": 2, "cold": 0, "warm": 1, "base": 0, "now": 1}
    cols = sorted(res["cases"], key=lambda c: (order[c["case"]], order[c["cache"]], order[c["tree"]]))
    head = [f"{c['case']} {c['cache']}" + (f" ({c['tree']})" if len(res["trees"]) > 1 else "") for c in cols]
    lines = [f"# Time to first step - {res['date']}", "",
             f"Machine: {m['cpu']} ({', '.join(m['cpu_features'])}), {m['logical_cpus']} logical CPUs; torch "
             f"{m['torch']}, Python {m['python']}; dufu {m['dufu_commit']}. Load average {res['load_average_start'][0]} "
             f"at the start, {res['load_average_end'][0]} at the end. Code: "
             + ", ".join(f"{k} = {v}" for k, v in res["trees"].items()) + ".", "",
             f"`dufu train` (default recipe) from launch to the end of step 1, median of {res['repeats']} fresh "
             "launches per column, seconds. cold = a new empty dufu cache (BPE training, tokenizing the corpus, "
             "measuring the matmul peaks), warm = the same cache again. For `--nproc 4` the phases are rank 0's; the "
             "launcher's own work before torchrun is the line 'launcher before torchrun', and the total is the "
             "slowest rank's first step.", ""]
    lines.append("| phase | " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * len(cols))

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in values) + " |")

    if any("launcher_s" in c for c in cols):
        row("launcher before torchrun", [c.get("launcher_s") for c in cols])
        for p in ("imports", "config load", "tokenizer", "data", "meta model", "preflight (other)"):
            row(f"&nbsp;&nbsp;launcher: {p}", [c.get("launcher_phases_s", {}).get(p) for c in cols])
        row("torchrun start (to worker process)", [c.get("torchrun_start_s") for c in cols])
    for p in PHASES:
        if p == "torchrun start":
            continue
        values = [c["phases_s"].get(p) for c in cols]
        if p == "compile warm-up" and not any(values):
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
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
