"""Elastic membership: two local "nodes" (two launchers, 2 processes each, one c10d rendezvous on localhost,
``--nnodes 1:2``) train gpt_debug at dp 4; at step 12 one node is lost (``DUFU_FAULT=kill_node``: a worker
SIGKILLs its torchrun agent and itself). The other node's workers stop at the collective timeout, its agent
restarts the group at the new world size, 2 processes: the layout is derived again (dp -1 -> 2, the global
batch of 8 kept through 2 accumulation steps instead of 1) and the last checkpoint (step 10) is resharded.

Loss continuity: every logged step, before and after the shrink, equals one uninterrupted process within the
fp32 parity tolerance (1e-5), and the run ends at the last step; the restart is on the record.
"""

from __future__ import annotations

import pytest

from launch import assert_ok
from parity import assert_losses_match, collect, records

pytestmark = pytest.mark.multiprocess


@pytest.mark.checkpoint_jobs("elastic", "elastic_reference")
def test_a_lost_node_shrinks_the_job_from_4_to_2_processes_with_the_uninterrupted_losses(jobs):
    # the runs: checkpoint_runs.define_jobs ("elastic"), in the background from the session's start
    reference = jobs.result("elastic_reference")
    assert_ok(reference)
    out, procs = jobs.result("elastic")
    survivors = [p for p in procs if p.returncode == 0]
    assert len(survivors) == 1, "\n\n".join(p.describe() for p in procs)
    said = survivors[0].stdout + survivors[0].stderr
    assert "dp 4 x tp 1 x pp 1 = 4 processes" in said and "dp 2 x tp 1 x pp 1 = 2 processes" in said
    assert "accumulation 2" in said and "resumed from" in said and "step_0000010" in said
    assert_losses_match(out, collect(reference.output_dir, weights=False), range(1, 21))
    restarts = [r for r in records(out) if "restart" in r]
    assert len(restarts) == 1 and restarts[0]["step"] == 10 and restarts[0]["resumed_from"] == "step_0000010"
