"""Reliability catalog T08: two scaler replicas on PostgreSQL, electing their leader
on a lease row in the store or on a Kubernetes Lease (the API server emulator), the
leader SIGSTOPped under resize load; the follower leads within lease + renew + 1 s, the
old leader exits on waking and nothing it writes lands (bench/failover.py runs
the scenario; this asserts its pass figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow, pytest.mark.serial]


@pytest.mark.parametrize("election", ["sql", "kubernetes"])
def test_leader_paused_follower_takes_over_and_old_leader_writes_nothing(
    pg_url: str, election: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.failover", "--pg-url", pg_url, "--leader-election", election],
        cwd=ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["failover_over_bound"] <= 1.0, result
    assert result["stale_writes_accepted"] == 0, result
    assert result["double_actuations"] == 0, result
    assert result["decisions_lost"] == 0, result
    assert result["old_leader_exit_code"] == 3, result
    assert result["decisions_acked"] >= 8
    # The coordinator's hot standby, in the same run (tests/coordinator/test_standby.py
    # checks its member and fencing; this, the bench's figures).
    assert result["coordinator_takeover_over_bound"] <= 1.0, result
    assert result["coordinator_old_leader_exit_code"] == 3, result
