"""dufu under Slurm (dufu.parallel.slurm, `dufu train` in an srun step, `dufu slurm`; docs/cluster.md).

Without Slurm: Slurm's environment read into a launch (host lists, tasks per node, the rendezvous port, the two
modes, what an explicit option changes, the errors), and the job script `dufu slurm` writes.

Against a real Slurm on this machine (tests/cluster/conftest.py starts slurmctld, slurmd and munged):

* ``srun -n2 dufu train gpt_debug ... dp2`` with no rendezvous option: two tasks, one process each, log the
  one-process run's losses and gradient norms at every step;
* a job `dufu slurm --submit` wrote, sent USR1 as ``--signal=B:USR1@...`` sends it before the time limit (to the
  batch shell: ``scancel --batch --signal=USR1``), saves mid-run, exits 75, requeues itself, and its second
  attempt resumes to the uninterrupted run's losses, step by step; ``slow:*:1`` (DUFU_FAULT) makes every step
  take 0.1 s longer, so the signal, sent once step 1 is logged, lands mid-run;
* the same job with one task per node (``--launcher-per-node``: dufu's launcher, torchrun, forked workers) saves on
  the signal too, with the one-process numbers up to the step it stopped at.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from dufu.cli import main
from dufu.cli.slurm import parse_time
from dufu.parallel.slurm import (SlurmError, expand_hostlist, expand_tasks_per_node, plan_launch, read_step,
                                 rendezvous_port)
from parity import PARITY_ARGS, PRECISIONS, assert_matches_reference, collect

DP2 = "train.dist.data_parallel_size=2"
LAYERS = "model.num_layers=2"  # the key of the session's shared gpt_debug reference (tests/parallel/conftest.py)
PREEMPT_STEPS = 8


def step_env(**over) -> dict:
    """A task's variables as srun 22.05 sets them (one node ``vm``, 2 tasks, this task rank 1), changed by ``over``."""
    env = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_NODELIST": "vm",
           "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1",
           "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1",
           "SLURM_DISTRIBUTION": "block"}
    env.update({k: v for k, v in over.items() if v is not None})
    for k, v in over.items():
        if v is None:
            env.pop(k, None)
    return env


# ------------------------------------------------------------------------------------------ Slurm's formats


@pytest.mark.parametrize("text,hosts", [
    ("vm", ["vm"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
    ("rack[1-2]-gpu[1,3]", ["rack1-gpu1", "rack1-gpu3", "rack2-gpu1", "rack2-gpu3"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text,what", [("node[1-3", "'[' without ']'"), ("node[3-1]", "runs backwards"),
                                       ("node[a-b]", "cannot read the range")])
def test_a_malformed_host_list_is_named(text, what):
    with pytest.raises(SlurmError, match=re.escape(what)):
        expand_hostlist(text)


def test_tasks_per_node_and_the_port_of_a_job():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    assert rendezvous_port(4321, {}) == 24321
    assert rendezvous_port(123456, {}) == 20000 + 123456 % 20000 == 23456
    assert rendezvous_port(4321, {"MASTER_PORT": "29555"}) == 29555


def test_only_a_step_is_read_as_slurm():
    # the batch script's shell and an salloc shell have the job's variables but no SLURM_STEP_ID
    assert read_step(step_env(SLURM_STEP_ID=None)) is None
    assert read_step({}) is None
    step = read_step(step_env(SLURM_STEP_NODELIST="gpu[01-02]", SLURM_STEP_NUM_NODES="2",
                              SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_STEP_NUM_TASKS="8", SLURM_RESTART_COUNT="2"))
    assert step.hosts == ("gpu01", "gpu02") and step.ntasks == 8 and step.tasks_per_node == (4, 4)
    assert step.restart_count == 2 and step.job_id == 4321
    # without the step's own variables, the job's: SLURM_NODELIST, SLURM_NTASKS, SLURM_NTASKS_PER_NODE
    step = read_step(step_env(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NODELIST="n[1-2]",
                              SLURM_STEP_NUM_NODES=None, SLURM_NNODES="2", SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS="4",
                              SLURM_STEP_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2"))
    assert step.hosts == ("n1", "n2") and step.ntasks == 4 and step.tasks_per_node == (2, 2)


# ------------------------------------------------------------------------------------------ the two modes


def test_one_task_per_gpu_is_one_process_of_the_run():
    env = step_env(SLURM_STEP_NODELIST="gpu[07-08]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="8",
                   SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_PROCID="6", SLURM_NODEID="1", SLURM_LOCALID="2",
                   SLURM_GPUS_ON_NODE="4")
    plan = plan_launch(read_step(env), environ=env)
    assert plan.mode == "process"
    assert plan.worker_env() == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                                 "GROUP_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "24321"}
    assert "one process per task" in plan.describe() and "rendezvous gpu07:24321" in plan.describe()
    # an explicit --master-addr, then MASTER_ADDR / MASTER_PORT in the environment, win over the derived values
    env.update(MASTER_ADDR="10.0.0.7", MASTER_PORT="29400")
    assert plan_launch(read_step(env), environ=env).worker_env()["MASTER_ADDR"] == "10.0.0.7"
    plan = plan_launch(read_step(env), master_addr="ib-gpu07", master_port=29999, environ=env)
    assert (plan.master_addr, plan.master_port) == ("ib-gpu07", 29999)
    assert "--master-addr given" in plan.describe()


def test_one_task_per_node_is_its_launcher():
    env = step_env(SLURM_STEP_NODELIST="gpu[07-09]", SLURM_STEP_NUM_NODES="3", SLURM_STEP_NUM_TASKS="3",
                   SLURM_STEP_TASKS_PER_NODE="1(x3)", SLURM_PROCID="2", SLURM_NODEID="2", SLURM_LOCALID="0",
                   SLURM_GPUS_ON_NODE="8")
    plan = plan_launch(read_step(env), environ=env)
    assert (plan.mode, plan.nnodes, plan.nproc_per_node, plan.node_rank) == ("node", 3, 8, 2)
    assert (plan.master_addr, plan.master_port, plan.world_size) == ("gpu07", 24321, 24)
    assert "one launcher per node: torchrun with --nnodes 3 --node-rank 2 --nproc 8" in plan.describe()
    # explicit options win over Slurm's values, and the start-up line says so
    plan = plan_launch(read_step(env), nproc=2, nnodes="2", node_rank=1, environ=env)
    assert (plan.nproc_per_node, plan.nnodes, plan.node_rank) == (2, 2, 1)
    assert "--nproc 2 given" in plan.describe() and "--nnodes 2 given" in plan.describe()
    # a CPU node: one process, unless --nproc asks for more
    cpu = step_env(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_PROCID="0", SLURM_LOCALID="0")
    assert plan_launch(read_step(cpu), environ=cpu).world_size == 1


def test_a_step_dufu_cannot_run_in_is_refused_with_what_to_ask_srun():
    uneven = step_env(SLURM_STEP_NODELIST="n[1-2]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="3",
                      SLURM_STEP_TASKS_PER_NODE="2,1")
    with pytest.raises(SlurmError, match="same number of tasks.*--ntasks-per-node"):
        plan_launch(read_step(uneven), environ=uneven)
    env = step_env()
    with pytest.raises(SlurmError, match="--nproc 4 with 2 tasks on 1 node.*--ntasks-per-node=1"):
        plan_launch(read_step(env), nproc=4, environ=env)


# ------------------------------------------------------------------------------------------ the job script


def test_dufu_slurm_writes_a_requeueing_job_script(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["slurm", "gpt_debug", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--time",
                 "1-00:00", "--account", "proj", "--output-dir", str(out), DP2.replace("2", "8")]) == 0
    printed = capsys.readouterr().out
    script = out / "slurm" / "job.sbatch"
    assert f"submit it with: sbatch {script}" in printed
    text = script.read_text()
    sbatch = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=dufu-gpt_debug", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4",
                      "--partition=gpu", "--time=1-00:00", "--account=proj", "--signal=B:USR1@120", "--requeue",
                      "--open-mode=append", f"--output={out}/slurm/%j.out", f"--chdir={Path.cwd()}"]
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun == (f"srun --kill-on-bad-exit=1 {sys.executable} -m dufu train gpt_debug "
                    f"train.dist.data_parallel_size=8 train.output_dir={out} --resume &")
    assert "kill -USR1 \"$step\"" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # a CPU job, one launcher per node: one task holding the node's processes
    assert main(["slurm", "gpt_debug", "--gpus-per-node", "0", "--tasks-per-node", "2", "--launcher-per-node",
                 "--output-dir", str(out), DP2]) == 0
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n" in text
    assert (f"srun --kill-on-bad-exit=1 --cpus-per-task=2 {sys.executable} -m dufu train --nproc 2 gpt_debug {DP2} "
            f"train.output_dir={out} --resume &") in text


def test_dufu_slurm_refuses_what_cannot_run(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["slurm", "gpt_debug", "--gpus-per-node", "1", "--time", "2", "--signal-seconds", "120",
                 "--output-dir", out]) == 2
    assert "the signal would come before the job starts" in " ".join(capsys.readouterr().err.split())
    # the layout must fit the job's processes: checked before anything waits in a queue
    assert main(["slurm", "gpt_debug", "--gpus-per-node", "2", "--output-dir", out,
                 "train.dist.tensor_parallel_size=4"]) == 2
    assert "tp 4" in capsys.readouterr().err
    assert [parse_time(t) for t in ("30", "30:15", "4:00:00", "1-00", "1-2:30", "1-2:30:05")] == \
        [1800, 1815, 14400, 86400, 95400, 95405]


# ------------------------------------------------------------------------------------------ a real Slurm


def _dufu() -> list[str]:
    """The `dufu` command of this Python (its console script), as a user types it."""
    script = Path(sys.executable).with_name("dufu")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dufu"]


def _startup_line(output: str, what: str) -> int:
    """The job id in dufu's start-up line about Slurm, after checking that it names ``what``."""
    m = re.search(r"dufu: Slurm job (\d+) step \d+: .*", output)
    assert m and what in m.group(0), output[-3000:]
    return int(m.group(1))


def test_host_lists_expand_as_scontrol_does(slurm_cluster):
    text = "node[01-03,7],gpu-a[1-2]-b[09-10],login"
    proc = slurm_cluster.run("scontrol", "show", "hostnames", text)
    assert proc.stdout.split() == expand_hostlist(text)


@pytest.mark.multiprocess
def test_srun_two_tasks_train_dp2_to_the_one_process_numbers(slurm_cluster, reference_run, tmp_path):
    out = tmp_path / "run"
    proc = launch.run(["srun", "-n2", "--kill-on-bad-exit=1", *_dufu(), "train", "gpt_debug", *PARITY_ARGS, LAYERS,
                       DP2, f"train.output_dir={out}"], output_dir=out, env=slurm_cluster.env, timeout=300)
    launch.assert_ok(proc)
    job = _startup_line(proc.output, f"2 tasks on 1 node ({slurm_cluster.node}) -> one process per task")
    assert f"rendezvous {slurm_cluster.node}:{20000 + job % 20000}" in proc.output
    assert_matches_reference(collect(out), reference_run("gpt_debug", LAYERS), "srun -n2, one process per task, dp2")


def _logged_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max([int(m.group(1)) for line in lines for m in [re.search(r'"step": (\d+), "loss"', line)] if m] or [0])


def _wait(cluster, job_id: str, log: Path, done, what: str, timeout: float = 240, interval: float = 0.2):
    """``done()``'s first true value, polled every ``interval`` seconds (a Slurm query starts a process: not too
    often, beside a job that needs the CPU)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = done()
        if got:
            return got
        time.sleep(interval)
    cluster.run("scancel", job_id, check=False)
    raise AssertionError(f"{what} did not happen within {timeout} s: job {cluster.job(job_id)}\n"
                         f"job log:\n{log.read_text()[-4000:] if log.exists() else '(none)'}\n"
                         f"slurmctld:\n{cluster.log('slurmctld')}")


def _submit_and_preempt(cluster, out: Path, monkeypatch, capsys, *flags: str) -> tuple[str, Path, str]:
    """Submit a 2-process dp2 job with ``dufu slurm --submit FLAGS``, send USR1 to its batch shell once a step is
    logged (what ``--signal=B:USR1@120`` does 120 s before the limit), and wait for the requeue; returns the job
    id, its log and the log's text."""
    run = (*PARITY_ARGS, LAYERS, f"train.train_iter={PREEMPT_STEPS}")
    # submitted from this process (torch is imported here already); sbatch passes its environment to the job
    for name, value in (*cluster.env.items(), ("DUFU_FAULT", "slow:*:1"), ("OMP_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)
    assert main(["slurm", "gpt_debug", "--gpus-per-node", "0", "--tasks-per-node", "2", *flags,
                 "--output-dir", str(out), "--submit", *run, DP2]) == 0
    printed = capsys.readouterr().out
    job_id = re.search(r"submitted job (\d+)", printed).group(1)
    log = out / "slurm" / f"{job_id}.out"
    assert f"squeue -j {job_id}" in printed and f"tail -f {log}" in printed and f"scancel {job_id}" in printed
    _wait(cluster, job_id, log, lambda: _logged_step(out) >= 1, "a logged step", interval=0.02)
    cluster.run("scancel", "--batch", "--signal=USR1", job_id)

    def requeued():
        job = cluster.job(job_id)
        assert job.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), f"{job}\n{log.read_text()[-4000:]}"
        return job.get("JobState") == "PENDING" and job.get("Restarts") == "1"

    _wait(cluster, job_id, log, requeued, "the requeue")
    text = log.read_text()
    for said in ("dufu: USR1: the run saves a checkpoint and stops",
                 f"dufu: the run saved a checkpoint and stopped (exit 75): requeueing job {job_id}"):
        assert said in text, f"{said!r} not in the job's log:\n{text[-4000:]}"
    return job_id, log, text


def _preempted_step(text: str) -> int:
    stopped = re.search(rf"stopped at step (\d+) of {PREEMPT_STEPS}: preempted by SIGUSR1", text)
    assert stopped and 1 <= int(stopped.group(1)) < PREEMPT_STEPS, text[-4000:]
    return int(stopped.group(1))


@pytest.mark.multiprocess
def test_a_job_signalled_before_its_limit_saves_requeues_and_resumes_exactly(slurm_cluster, reference_run, tmp_path,
                                                                              monkeypatch, capsys):
    out = tmp_path / "run"
    job_id, log, text = _submit_and_preempt(slurm_cluster, out, monkeypatch, capsys)
    step = _preempted_step(text)
    # Slurm holds a requeued job for 2 minutes (its BeginTime). It may start again once the node has revoked
    # the first attempt's credential, a time in whole seconds: a start within the same second is refused.
    time.sleep(2)
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    finished = _wait(slurm_cluster, job_id, log,
                     lambda: (lambda j: j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") else None)(
                         slurm_cluster.job(job_id)), "the second attempt's end")
    text = log.read_text()
    assert finished["JobState"] == "COMPLETED" and finished["Restarts"] == "1", f"{finished}\n{text[-4000:]}"
    for said in (f"dufu: job {job_id} attempt 2", "one process per task", "requeued 1 time",
                 f"resumed from {out / 'checkpoints' / f'step_{step:07d}'}"):
        assert said in text, f"{said!r} not in the job's log:\n{text[-4000:]}"
    assert_matches_reference(collect(out), reference_run("gpt_debug", LAYERS, f"train.train_iter={PREEMPT_STEPS}"),
                             f"a Slurm job preempted at step {step}, requeued and resumed", steps=PREEMPT_STEPS)


@pytest.mark.multiprocess
def test_a_launcher_per_node_job_saves_on_the_signal(slurm_cluster, reference_run, tmp_path, monkeypatch, capsys):
    # Slurm signals every process of the step: the launcher (torchrun's agent), its workers and the fork server
    # they were forked from, whose death would stop them with SIGINT before they saved (dufu/cli/train.py)
    out = tmp_path / "run"
    job_id, _, text = _submit_and_preempt(slurm_cluster, out, monkeypatch, capsys, "--launcher-per-node")
    slurm_cluster.run("scancel", job_id)  # the requeue was the script's; its resume is the test above's
    step = _preempted_step(text)
    assert "one launcher per node: torchrun with --nnodes 1 --node-rank 0 --nproc 2" in text, text[-4000:]
    assert "abandoned" not in text, text[-4000:]
    assert (out / "checkpoints" / f"step_{step:07d}").is_dir()
    reference = reference_run("gpt_debug", LAYERS, f"train.train_iter={PREEMPT_STEPS}")
    got = collect(out, weights=False)
    assert sorted(got.train) == list(range(1, step + 1))
    rel = PRECISIONS["fp32"]
    for s in got.train:
        for key, tol in (("loss", rel.loss_rel), ("grad_norm", rel.grad_norm_rel)):
            a, b = got.train[s][key], reference.train[s][key]
            assert abs(a - b) <= tol * abs(b), f"launcher per node, step {s}: {key} {a} != one process's {b}"
