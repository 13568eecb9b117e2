"""A job whose worker segfaults at every start, end to end: a real coordinator on the
wall clock and real launchers whose workers restore, then die in their first step. It
is FAILED within the restart budget, each re-form waits twice as long as the one before,
the failure names the signal and the log's end, and each pod keeps a bounded number of
worker logs. (bench/crashloop.py runs the same job and measures it.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import crashloop

pytestmark = pytest.mark.e2e


def test_a_worker_that_segfaults_at_every_start_fails_the_job_within_the_budget(
    tmp_path: Path,
) -> None:
    tuning = crashloop.QUICK
    with crashloop.worker_env():
        got = asyncio.run(crashloop.crash_loop(tuning, tmp_path, pods=2, limit_s=60.0))

    assert got["failed"] == 1
    assert got["re_forms"] == tuning.restart_budget
    # The backoff: none for the first generation, then doubling with each re-form.
    assert got["start_delays_s"] == [0.0, 0.25, 0.5, 1.0]
    assert all(gap >= delay for gap, delay in zip(got["gaps_s"][1:], [0.25, 0.5], strict=True))
    assert "restart budget spent" in got["failure"]
    assert "was killed by SIGSEGV" in got["failure"]
    assert "Fatal Python error: Segmentation fault" in got["failure"]
    for pod in tmp_path.iterdir():
        assert len(list(pod.glob("worker-*.log"))) <= crashloop.WORKER_LOGS_KEPT
