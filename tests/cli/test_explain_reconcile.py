"""`tide explain` of a RECONCILE shows what the scaler compared, not a policy's empty
window and "bounds 0..0" (issue 32)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tide.services.cli.render import print_explain
from tide.v1 import common_pb2, scaler_pb2

pytestmark = pytest.mark.unit


def explain(reason: int, message: str) -> str:
    detail = scaler_pb2.DecisionDetail(
        decision=scaler_pb2.Decision(
            id=7, job_id="ml/a", reason=reason, from_replicas=3, to_replicas=2, message=message
        )
    )
    out = io.StringIO()
    print_explain(Console(file=out, width=200), detail)
    return out.getvalue()


def test_a_reconcile_names_what_was_compared() -> None:
    why = "the actuator runs 3 replica(s), but the last decision left 2 (generation 4)"
    text = explain(common_pb2.DECISION_REASON_RECONCILE, why)
    assert f"compared the last decision's size with what runs: {why}" in text
    assert "bounds" not in text and "window" not in text
    assert "States" in text
    # A policy decision still shows its thresholds.
    assert "bounds" in explain(common_pb2.DECISION_REASON_SUSTAINED_HIGH_UTILIZATION, "busy")
