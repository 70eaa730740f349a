"""Fixtures of the planner's tests (helpers are in plan_testing.py)."""

from __future__ import annotations

import pytest

from plan_testing import PROBE


@pytest.fixture(scope="session")
def test_cpu():
    """A CPU with fixed figures (PROBE), so that tests do not depend on this machine's measurement."""
    from dufu.plan.cpu import cpu_from_probe

    return cpu_from_probe(PROBE)
