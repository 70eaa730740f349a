"""Elastic membership: two local "nodes" (two launchers, 2 processes each, one c10d rendezvous on localhost,
``--nnodes 1:2``) train gpt_debug at dp 4; at step 12 one node is lost (``DUFU_FAULT=kill_node``: a worker
SIGKILLs its torchrun agent and itself). The other node's workers stop at the collective timeout, its agent
restarts the group at the new world size, 2 processes: the layout is derived again (dp -1 -> 2, the global
batch of 8 kept through 2 accumulation steps instead of 1) and the last checkpoint (step 10) is resharded.

Loss continuity: every logged step, before and after the shrink, equals one uninterrupted process within the
fp32 parity tolerance (1e-5), and the run ends at the last step; the restart is on the record.
"""

from __future__ import annotations

import socket

import pytest
import torch

import launch
from parity import PARITY_ARGS, assert_losses_match, parity_run, records

pytestmark = pytest.mark.multiprocess

RUN = (*PARITY_ARGS, "train.train_iter=20", "train.checkpointer.period=10", "train.log_period=1",
       "train.dist.timeout_minutes=0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_lost_node_shrinks_the_job_from_4_to_2_processes_with_the_uninterrupted_losses(tmp_path):
    reference = parity_run(tmp_path / "reference", 1, *RUN[len(PARITY_ARGS):], weights=False)
    out = tmp_path / "elastic"
    port = free_port()
    flags = ("--nnodes", "1:2", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "elastic-test",
             "--max-restarts", "2")
    cmd = launch.train_command("gpt_debug", out, 2, *RUN, "train.dist.data_parallel_size=-1", flags=flags)
    # No output_dir for launch's clean-up: the lost node's launcher ends first, and its clean-up (every process
    # with this output_dir on its command line) would take the surviving node's workers with it.
    # The rendezvous store lives in this process, as on a cluster where it runs on a machine of its own: whichever
    # node's agent would host it (the first to bind the port; c10d rendezvous gives ranks 2-3 to either node) may
    # be the lost one, which took the store with it and the survivor could not rendezvous again. The agents find
    # the port taken and join as clients (torch's c10d rendezvous backend).
    store = torch.distributed.TCPStore("localhost", port, is_master=True, wait_for_workers=False)
    try:
        nodes = [launch.start(cmd, fault="kill_node:3:12", retry=False, timeout=400) for _ in range(2)]
        procs = [n.result() for n in nodes]
    finally:
        launch._kill_processes_with_argument(f"train.output_dir={out}")
        del store
    survivors = [p for p in procs if p.returncode == 0]
    assert len(survivors) == 1, "\n\n".join(p.describe() for p in procs)
    said = survivors[0].stdout + survivors[0].stderr
    assert "dp 4 x tp 1 x pp 1 = 4 processes" in said and "dp 2 x tp 1 x pp 1 = 2 processes" in said
    assert "accumulation 2" in said and "resumed from" in said and "step_0000010" in said
    assert_losses_match(out, reference, range(1, 21))
    restarts = [r for r in records(out) if "restart" in r]
    assert len(restarts) == 1 and restarts[0]["step"] == 10 and restarts[0]["resumed_from"] == "step_0000010"
