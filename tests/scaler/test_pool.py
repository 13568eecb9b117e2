"""The pool step: free GPUs shared among jobs that all want to grow (pool.arbitrate)."""

from __future__ import annotations

import pytest

from tide.services.scaler.goodput import (
    Claim,
    PoolRule,
    allocate,
    efficiency,
    next_replica_efficiency,
)
from tide.services.scaler.policy import Decision, JobState, Reason
from tide.services.scaler.pool import arbitrate

pytestmark = pytest.mark.unit

# Three jobs at 4 replicas want 8 each. "fast" scales almost linearly, "flat" gains little
# per replica, "new" never ran bigger (no evidence: scaling assumed linear).
FAST = Claim("ns/fast", 4, 8, 1, ((4, 400.0), (8, 760.0)), since_s=30.0)
FLAT = Claim("ns/flat", 4, 8, 1, ((4, 400.0), (8, 480.0)), since_s=10.0)
NEW = Claim("ns/new", 4, 8, 1, ((4, 400.0),), since_s=20.0)


def grow(job: str, to: int = 8, free: int = 4) -> tuple[Decision, JobState]:
    d = Decision(job, Reason.SUSTAINED_HIGH_UTILIZATION, "grow", 4, to, wanted_replicas=8)
    return d, JobState(job, 4, free_gpus=free)


def test_efficiency_of_a_measured_step() -> None:
    curve = {4: 400.0, 8: 760.0, 12: 700.0}
    assert efficiency(curve, 4, 8) == pytest.approx(0.9)
    assert efficiency(curve, 8, 12) == pytest.approx(-60 / 4 / 95)
    assert efficiency(curve, 4, 6) is None
    assert next_replica_efficiency(curve, 4, 5) == pytest.approx(0.9)
    assert next_replica_efficiency({4: 400.0}, 4, 4) == 1.0
    assert next_replica_efficiency({}, 4, 4) == 1.0
    # Past the largest measured size, the last measured step's gain goes on.
    assert next_replica_efficiency({2: 200.0, 4: 300.0}, 4, 4) == pytest.approx(50 / 75)


@pytest.mark.parametrize(
    ("rule", "free", "expected"),
    [
        # Each next replica to the job whose next replica adds most: fast and new first.
        (PoolRule.MARGINAL, 4, {"ns/fast": 0, "ns/flat": 0, "ns/new": 4}),
        (PoolRule.MARGINAL, 8, {"ns/fast": 4, "ns/flat": 0, "ns/new": 4}),
        (PoolRule.MARGINAL, 10, {"ns/fast": 4, "ns/flat": 2, "ns/new": 4}),
        # First come, first served: flat asked first.
        (PoolRule.FCFS, 4, {"ns/fast": 0, "ns/flat": 4, "ns/new": 0}),
        (PoolRule.FCFS, 10, {"ns/fast": 2, "ns/flat": 4, "ns/new": 4}),
    ],
)
def test_allocate(rule: PoolRule, free: int, expected: dict[str, int]) -> None:
    assert allocate(free, [FAST, FLAT, NEW], rule) == expected


def test_a_replica_that_does_not_fit_leaves_room_for_smaller_ones() -> None:
    big = Claim("ns/big", 1, 2, 4, ((1, 100.0),), since_s=0.0)
    small = Claim("ns/small", 1, 3, 1, ((1, 100.0), (3, 150.0)), since_s=1.0)
    assert allocate(3, [big, small], PoolRule.MARGINAL) == {"ns/big": 0, "ns/small": 2}


def test_uncontended_grow_is_left_alone() -> None:
    d, job = grow("ns/fast", free=8)
    assert arbitrate(d, job, [FAST]) is d


def test_contended_grow_is_cut_to_its_share_with_evidence() -> None:
    d, job = grow("ns/fast", free=6)
    out = arbitrate(d, job, [FAST, FLAT, NEW])
    assert (out.reason, out.to_replicas) == (Reason.SUSTAINED_HIGH_UTILIZATION, 6)
    pool = out.inputs["pool"]
    assert pool["free_gpus"] == 6 and pool["rule"] == "marginal"
    assert {c["job_id"]: c["granted_gpus"] for c in pool["claims"]} == {
        "ns/fast": 2,
        "ns/flat": 0,
        "ns/new": 4,
    }
    assert "by the marginal rule" in out.message


def test_a_job_that_gets_nothing_is_pool_contended() -> None:
    d, job = grow("ns/flat", free=8)
    out = arbitrate(d, job, [FAST, FLAT, NEW])
    assert (out.reason, out.to_replicas, out.resize) == (Reason.POOL_CONTENDED, 4, False)
    assert "ns/fast 4" in out.message and "ns/new 4" in out.message


def test_fcfs_is_the_comparison_rule() -> None:
    d, job = grow("ns/flat", free=4)
    out = arbitrate(d, job, [FAST, FLAT, NEW], PoolRule.FCFS)
    assert out.to_replicas == 8
