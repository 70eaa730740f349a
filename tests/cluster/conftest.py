"""A real Slurm on this machine for the cluster tests: ``slurm_cluster`` (session-scoped) writes a minimal slurm.conf
(one node, this host, with its CPUs; a partition; linuxproc process tracking; requeue allowed), a munge key, and
starts munged, slurmctld and slurmd as root in the background, each with its own files under a temporary
directory and its own ports, so it neither touches nor needs a Slurm already installed here; the daemons stop
when the session ends.

Without Debian's ``slurm-wlm`` and ``munge`` packages, or without root, the tests that need it skip and say why;
with ``DUFU_REQUIRE_SLURM=1`` (set by .ci/run, which installs the packages) they fail instead.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _missing() -> str | None:
    """Why a Slurm cannot be started here, or None."""
    missing = [d for d in (*DAEMONS, "sbatch", "srun", "scontrol", "scancel", "squeue") if shutil.which(d) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install -y slurm-wlm munge "
                "(Debian), as .ci/run does")
    if os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged here needs root"
    return None


@dataclass
class SlurmCluster:
    """A running localhost Slurm: ``env`` holds what its clients need (``SLURM_CONF``)."""

    root: Path
    conf: Path
    node: str
    cpus: int
    env: dict

    def run(self, *cmd, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, squeue, scontrol ...) against this cluster."""
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})
        if check and proc.returncode != 0:
            raise AssertionError(f"$ {' '.join(map(str, cmd))}\nexit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        return proc

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (JobState, Reason, Restarts, ...), {} once the job is gone."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _write_conf(root: Path, node: str, cpus: int) -> Path:
    """slurm.conf: the smallest configuration that runs batch jobs and steps on this one node as root. The
    first job id is random, so that two test sessions on one machine derive different rendezvous ports."""
    munge_socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dufutest",
        f"SlurmctldHost={node}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={munge_socket}",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MpiDefault=none",
        "JobRequeue=1",
        "ReturnToService=2",
        f"FirstJobId={random.randint(1000, 900000)}",
        # a 2-task job needs 2 CPUs; on a 1-CPU machine Slurm takes the configured count (config_overrides)
        "SlurmdParameters=config_overrides",
        f"NodeName={node} CPUs={max(cpus, 2)} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    return conf


def _start(root: Path, env: dict) -> None:
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o600)
    for d in ("state", "spool", "log"):
        (root / d).mkdir()
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)  # noqa: E731
    steps = [("munged", ["munged", "--force", f"--socket={munge / 'munge.socket'}", f"--key-file={munge / 'munge.key'}",
                         f"--log-file={root / 'log' / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                         f"--seed-file={munge / 'munged.seed'}"]),
             ("slurmctld", ["slurmctld", "-i"]),
             ("slurmd", ["slurmd"])]
    for name, cmd in steps:
        proc = run(*cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} did not start (exit {proc.returncode}): {proc.stderr or proc.stdout}")


def _wait_idle(cluster: SlurmCluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = cluster.run("sinfo", "-h", "-o", "%t", check=False)
        if proc.returncode == 0 and proc.stdout.strip() == "idle":
            return
        time.sleep(0.2)
    raise RuntimeError(f"the Slurm node is not idle after {timeout} s: {proc.stdout}{proc.stderr}\n"
                       f"slurmctld: {cluster.log('slurmctld')}\nslurmd: {cluster.log('slurmd')}")


def _stop(root: Path, env: dict) -> None:
    """Cancel what is left, then stop the three daemons together (each writes its state and exits on SIGTERM)."""
    subprocess.run(["scancel", "--user=root"], capture_output=True, timeout=30, env=env)
    pids = []
    for pidfile in (root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "munged.pid"):
        try:
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    deadline = time.monotonic() + 10
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    why = _missing()
    if why:
        if os.environ.get("DUFU_REQUIRE_SLURM") == "1":
            pytest.fail(f"DUFU_REQUIRE_SLURM=1, but {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    node = socket.gethostname().split(".")[0]  # what `hostname -s` prints: slurmd's own name for the node
    cpus = os.cpu_count() or 1
    conf = _write_conf(root, node, cpus)
    env = {"SLURM_CONF": str(conf)}
    full_env = {**os.environ, **env}
    try:
        _start(root, full_env)
        cluster = SlurmCluster(root, conf, node, cpus, env)
        _wait_idle(cluster)
    except Exception:
        _stop(root, full_env)
        raise
    yield cluster
    _stop(root, full_env)
