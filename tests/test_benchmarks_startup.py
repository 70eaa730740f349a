"""``benchmarks/startup.py``'s reading of a launch's traces, on made-up traces (no job runs here): a fork-server
launch (dufu since ff13f52) and a launch of new interpreters (before it) give phases that add up to rank 0's first
step, the worker server's lines beside the launcher, and a launch whose workers contradict the launcher fails."""

from __future__ import annotations


import pytest

from dufu_testing import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("startup")


RUNTIME = {"plan": 0.5, "process group": 0.2, "precision": 1.0, "model build": 0.3, "teacher": 0.0, "optimizer": 0.1}


def launcher(kind: str) -> dict:
    return {"role": "launcher", "launched": 100.0, "first_line": 100.1, "launch": kind,
            "events": [["imports", 100.1, 100.2], ["torchrun (whole job)", 103.0, 120.0]]}


def rank(r: int, start: str, launched: float, server: dict | None = None) -> dict:
    begun = launched if start == "fork" else launched + 2.5  # a new interpreter: first line, then 2 s of imports
    loop = begun + 0.4 + sum(RUNTIME.values())
    trace = {"role": f"rank{r}", "launched": launched, "start": start, "runtime_startup": dict(RUNTIME),
             "first_line": None if start == "fork" else launched + 0.5,
             "events": [["loop start", loop, loop], ["step 1", loop + 1.0, loop + 2.0]]}
    if start == "interpreter":
        trace["events"].insert(0, ["imports", launched + 0.5, begun])
    if server:
        trace["worker_server"] = server
    return trace


def test_fork_server_launch(bench):
    server = {"pid": 7, "parent": True, "started": 100.3, "preloaded": 103.5}
    traces = {"launcher": launcher(bench.FORK_SERVER),
              **{f"rank{r}": rank(r, "fork", 103.6 + r / 100, server) for r in range(4)}}
    out = bench.launch_of(traces)
    assert out["launch"] == bench.FORK_SERVER
    assert out["launcher_s"] == pytest.approx(3.0) and out["torchrun_start_s"] == pytest.approx(0.6)
    assert out["server_start_s"] == pytest.approx(0.3) and out["server_import_s"] == pytest.approx(3.2)
    assert out["server_wait_s"] == pytest.approx(0.5)  # torchrun called at 103.0, the server ready at 103.5
    assert out["launcher"]["config load, checks"] == pytest.approx(2.8)
    phases = bench.phases_of(traces["rank0"], compile_on=False)
    assert "python start" not in phases and "imports" not in phases  # done in the server
    assert phases["config load, run start (other)"] == pytest.approx(0.4)
    assert phases["other"] == pytest.approx(0.0)
    # launcher + torchrun start + rank 0's phases = rank 0's first step after launch
    assert out["launcher_s"] + out["torchrun_start_s"] + sum(v for k, v in phases.items() if k != "end") \
        == pytest.approx(phases["end"] - 100.0)


def test_interpreter_launch(bench):
    traces = {"launcher": launcher(bench.INTERPRETERS), **{f"rank{r}": rank(r, "interpreter", 103.1) for r in range(4)}}
    out = bench.launch_of(traces)
    assert out["launch"] == bench.INTERPRETERS and "server_start_s" not in out
    phases = bench.phases_of(traces["rank0"], compile_on=False)
    assert phases["python start"] == pytest.approx(0.5) and phases["imports"] == pytest.approx(2.0)
    assert phases["other"] == pytest.approx(0.0)


def test_workers_that_contradict_the_launcher_fail(bench):
    traces = {"launcher": launcher(bench.FORK_SERVER), "rank0": rank(0, "interpreter", 103.1)}
    with pytest.raises(RuntimeError, match="workers say"):
        bench.launch_of(traces)
    server = {"pid": 7, "parent": True, "started": 100.3, "preloaded": 103.5}
    traces = {"launcher": launcher(bench.FORK_SERVER), "rank0": rank(0, "fork", 103.6, server),
              "rank1": rank(1, "fork", 103.6)}  # one worker without the server's note
    with pytest.raises(RuntimeError, match="one worker server"):
        bench.launch_of(traces)


def test_table_marks_what_a_forked_worker_has_not(bench, monkeypatch):
    server = {"pid": 7, "parent": True, "started": 100.3, "preloaded": 103.5}
    fork = {"launcher": launcher(bench.FORK_SERVER), "rank0": rank(0, "fork", 103.6, server)}
    new = {"launcher": launcher(bench.INTERPRETERS), "rank0": rank(0, "interpreter", 103.1)}
    cases = []
    for tree, traces in (("now", fork), ("base", new)):
        main = traces["rank0"]
        r = {"phases": bench.phases_of(main, False), "cpu_s": 1.0, "launch": "one process",
             "first_step_end_s": bench.phases_of(main, False)["end"] - 100.0, **bench.launch_of(traces)}
        cases.append(bench.summarize(("nproc4", "warm", tree), [r]))
    machine = {"cpu": "cpu", "cpu_features": [], "logical_cpus": 2, "torch": "t", "python": "p", "dufu_commit": "c",
               "peak_gflops": {}}
    monkeypatch.setattr(bench.machine, "peaks_text", lambda m: "peaks")
    text = bench.markdown({"date": "d", "machine": machine, "repeats": 1, "load_average_start": [0.0],
                           "load_average_end": [0.0], "trees": {"now": "a", "base": "b"}, "cases": cases,
                           "importtime": {}})
    cells = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    assert rows["workers"] == [bench.INTERPRETERS, bench.FORK_SERVER]  # base first
    assert rows["python start"][1] == "-" and rows["python start"][0] == "0.50"
    assert rows["worker server: start-up and imports (beside the launcher)"][0] == "-"
    assert rows["worker server: start-up and imports (beside the launcher)"][1].startswith("3.20")
