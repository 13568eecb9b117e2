"""Reliability catalog T16-T18 at CI length: steady ingest, stream churn and a
burst past the stream bound against a real scaler process (bench/soak.py runs
the same at 2 minutes with --quick, 10 at full length)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_short_soak_leaks_nothing_and_sheds_exactly_the_excess() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--seconds", "30", "--agents", "60", "--churn", "400"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["errors"] == 0, result["first_errors"]
    assert result["churned_streams"] == 400
    assert result["shed_correctly"] == 1, result
    # 400 streams opened and cancelled leave no descriptor behind.
    assert result["fd_growth"] <= 2, result
    assert result["acks"] > 0
