"""Table-driven tests of the policy: one case per reason, HPA style."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from tide.base.errors import ConfigError, FailedPrecondition, InvalidArgument
from tide.services.scaler.policy import (
    Decision,
    History,
    JobState,
    PolicySettings,
    Reason,
    Trigger,
    WindowView,
    decide,
    manual,
    proportional,
)

pytestmark = pytest.mark.unit

P = PolicySettings()  # 80/40, sustain 300 s of 30 s buckets, cooldown 300, 2..8, target 60
NOW = 100_000.0  # a bucket boundary (100_000 / 30 is not whole, but the view sets end_s)


def window(
    means: list[float],
    fresh: int = 4,
    expected: int = 4,
    sm: list[float] | None = None,
    gpm: float = 1.0,
) -> WindowView:
    """A utilization window; ``sm``: the SM (and tensor) activity of its buckets, carried
    by a ``gpm`` fraction of the samples (none: the GPUs have no GPM)."""
    act = tuple(sm) if sm is not None else ()
    return WindowView(
        bucket_s=30.0,
        end_s=NOW,
        bucket_means=tuple(means),
        gpus_expected=expected,
        gpus_fresh=fresh,
        sm_active_means=act,
        tensor_active_means=act,
        gpm_fractions=(gpm,) * len(means) if sm is not None else (),
    )


SM = PolicySettings(signal="sm_active")  # 80/50, target 65
TENSOR = PolicySettings(signal="tensor_active")  # 60/25, target 40
TPUT = PolicySettings(signal="throughput")


def flat(v: float, n: int = 10) -> list[float]:
    return [v] * n


@dataclass
class Case:
    name: str
    means: list[float]
    reason: Reason
    to: int
    current: int = 4
    fresh: int = 4
    expected: int = 4
    job: dict[str, object] = field(default_factory=dict)
    history: History = field(default_factory=History)
    policy: PolicySettings = P
    sm: list[float] | None = None
    gpm: float = 1.0


CASES = [
    Case("sustained high grows proportionally", flat(90), Reason.SUSTAINED_HIGH_UTILIZATION, 6),
    Case("brief spike is a no-op", [*flat(50, 9), 99], Reason.NOT_SUSTAINED, 4),
    Case("one low bucket in a high window", [*flat(90, 9), 70], Reason.WITHIN_BAND, 4),
    Case("high but one bucket empty", [*flat(90, 9), math.nan], Reason.NOT_SUSTAINED, 4),
    Case("window shorter than sustain", flat(90, 5), Reason.NOT_SUSTAINED, 4),
    Case("within band", flat(60), Reason.WITHIN_BAND, 4),
    Case("sustained low shrinks proportionally", flat(20), Reason.SUSTAINED_LOW_UTILIZATION, 2),
    Case(
        "low shrink limited by max_step",
        flat(5),
        Reason.SUSTAINED_LOW_UTILIZATION,
        6,
        current=8,
        policy=PolicySettings(max_step=2),
    ),
    Case("low clamps to min_replicas", flat(1), Reason.SUSTAINED_LOW_UTILIZATION, 2, current=6),
    Case("at min replicas", flat(10), Reason.AT_MIN_REPLICAS, 2, current=2),
    Case("at max replicas", flat(95), Reason.AT_MAX_REPLICAS, 8, current=8),
    Case("grow clamps to max", flat(100), Reason.SUSTAINED_HIGH_UTILIZATION, 8, current=7),
    Case(
        "grow limited by max_step",
        flat(100),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        3,
        current=2,
        policy=PolicySettings(max_step=1),
    ),
    Case(
        "capacity cap",
        flat(100),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        5,
        job={"free_gpus": 2, "gpus_per_replica": 2},
    ),
    Case(
        "no capacity", flat(100), Reason.NO_CAPACITY, 4, job={"free_gpus": 1, "gpus_per_replica": 2}
    ),
    Case("cooldown", flat(95), Reason.COOLDOWN, 4, history=History(NOW - 100, 1)),
    Case(
        "after cooldown, same direction",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        history=History(NOW - 300, 1),
    ),
    Case(
        "reversal waits for a window after cooldown",
        flat(10),
        Reason.NOT_SUSTAINED,
        4,
        history=History(NOW - 400, 1),
    ),
    Case(
        "reversal after cooldown + sustain",
        flat(10),
        Reason.SUSTAINED_LOW_UTILIZATION,
        2,
        history=History(NOW - 600, 1),
    ),
    Case("stale data", flat(95), Reason.STALE_DATA, 4, fresh=0),
    Case("no data at all", [], Reason.STALE_DATA, 4, fresh=0),
    Case("coverage below min", flat(95), Reason.INSUFFICIENT_COVERAGE, 4, fresh=3),
    Case(
        "partial coverage may grow",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        fresh=9,
        expected=10,
    ),
    Case(
        "partial coverage never shrinks",
        flat(10),
        Reason.INSUFFICIENT_COVERAGE,
        4,
        fresh=9,
        expected=10,
    ),
    Case("paused", flat(95), Reason.PAUSED, 4, job={"paused": True}),
    Case(
        "resize in progress",
        flat(95),
        Reason.RESIZE_IN_PROGRESS,
        4,
        job={"resize_in_progress": True},
    ),
    Case(
        "stabilizing keeps the highest recent recommendation",
        flat(20),
        Reason.STABILIZING,
        4,
        history=History(recommendations=((NOW - 30, 4),)),
    ),
    Case(
        "stabilizing limits the shrink",
        flat(20),
        Reason.SUSTAINED_LOW_UTILIZATION,
        3,
        history=History(recommendations=((NOW - 30, 3), (NOW - 500, 4))),
    ),
    Case(
        "emergency skips cooldown and pause",
        flat(95),
        Reason.NODE_TERMINATION,
        3,
        job={"terminating_replicas": 1, "terminating_node": "n1", "paused": True},
        history=History(NOW - 1, 1),
    ),
    Case(
        "emergency goes below min (the node leaves anyway)",
        flat(50),
        Reason.NODE_TERMINATION,
        1,
        current=2,
        job={"terminating_replicas": 1, "terminating_node": "n1"},
    ),
    Case(
        "emergency supersedes a grow in flight",
        flat(95),
        Reason.NODE_TERMINATION,
        3,
        job={
            "terminating_replicas": 1,
            "terminating_pods": frozenset({"u1"}),
            "resize_in_progress": True,
            "in_flight_decision": 7,
        },
    ),
    Case(
        "a preemption in flight for the same pods is waited for",
        flat(95),
        Reason.RESIZE_IN_PROGRESS,
        4,
        job={
            "terminating_replicas": 1,
            "terminating_pods": frozenset({"u1"}),
            "resize_in_progress": True,
            "in_flight_decision": 7,
            "in_flight_leaving": frozenset({"u1"}),
        },
    ),
    Case(
        "a preemption in flight for fewer pods is superseded by the merged one",
        flat(95),
        Reason.NODE_TERMINATION,
        2,
        job={
            "terminating_replicas": 2,
            "terminating_pods": frozenset({"u1", "u2"}),
            "resize_in_progress": True,
            "in_flight_decision": 7,
            "in_flight_leaving": frozenset({"u1"}),
        },
    ),
    # The goodput guard: throughput (samples/s) by replicas, as the coordinator measured it.
    Case(
        "a grow that made training slower is reverted",
        flat(95),
        Reason.SLOWER_AFTER_SCALE_UP,
        4,
        current=7,
        history=History(NOW - 400, 1, last_from_replicas=4, throughput=((4, 320.0), (7, 280.0))),
    ),
    Case(
        "a grow that was faster but did not pay is kept",
        flat(60),
        Reason.WITHIN_BAND,
        7,
        current=7,
        history=History(NOW - 400, 1, last_from_replicas=4, throughput=((4, 320.0), (7, 340.0))),
    ),
    Case(
        "the guard off never reverts",
        flat(60),
        Reason.WITHIN_BAND,
        7,
        current=7,
        history=History(NOW - 400, 1, last_from_replicas=4, throughput=((4, 320.0), (7, 280.0))),
        policy=PolicySettings(min_scale_up_efficiency=0.0),
    ),
    Case(
        "a grow measured not to pay is not repeated",
        flat(95),
        Reason.LOW_MARGINAL_THROUGHPUT,
        4,
        history=History(throughput=((4, 400.0), (5, 420.0))),
    ),
    Case(
        "a grow past a size that did not pay is halved",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        5,
        history=History(throughput=((4, 400.0), (6, 420.0))),
    ),
    Case(
        "a grow that paid goes on",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        history=History(throughput=((4, 400.0), (6, 570.0))),
    ),
    Case(
        "a measured size beyond the grow does not limit it",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        history=History(throughput=((4, 400.0), (8, 300.0))),
    ),
    Case(
        "a grow on after a step that did not pay is not tried",
        flat(95),
        Reason.LOW_MARGINAL_THROUGHPUT,
        4,
        history=History(throughput=((2, 300.0), (4, 360.0))),
    ),
    Case(
        "a grow on after a step that paid goes on",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        history=History(throughput=((2, 300.0), (4, 560.0))),
    ),
    Case(
        "the guard off grows whatever was measured",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        7,
        history=History(throughput=((4, 400.0), (5, 420.0))),
        policy=PolicySettings(min_scale_up_efficiency=0.0),
    ),
    # Signals (docs/policy.md "Signals"): the same rules on the job's chosen signal.
    Case(
        "sm_active: utilization high but SMs mostly idle shrinks",
        flat(95),
        Reason.SUSTAINED_LOW_UTILIZATION,
        2,
        policy=SM,
        sm=flat(30),
    ),
    Case(
        "sm_active: SMs busy grows on SM activity",
        flat(95),
        Reason.SUSTAINED_HIGH_UTILIZATION,
        6,
        policy=SM,
        sm=flat(90),
    ),
    Case("sm_active within its band", flat(95), Reason.WITHIN_BAND, 4, policy=SM, sm=flat(70)),
    Case(
        "sm_active on GPUs without GPM refuses",
        flat(95),
        Reason.NO_SIGNAL,
        4,
        policy=SM,
        sm=flat(math.nan),
        gpm=0.0,
    ),
    Case(
        "sm_active with GPM on half the GPUs refuses",
        flat(95),
        Reason.NO_SIGNAL,
        4,
        policy=SM,
        sm=flat(95),
        gpm=0.5,
    ),
    Case(
        "tensor_active low shrinks",
        flat(95),
        Reason.SUSTAINED_LOW_UTILIZATION,
        2,
        policy=TENSOR,
        sm=flat(20),
    ),
    Case(
        "throughput: the last grow paid, grow one more",
        flat(50),
        Reason.THROUGHPUT_GAINING,
        5,
        policy=TPUT,
        history=History(throughput=((2, 200.0), (4, 390.0))),
    ),
    Case(
        "throughput: the last grow stopped gaining, shrink back",
        flat(95),
        Reason.THROUGHPUT_STALLED,
        3,
        policy=TPUT,
        history=History(throughput=((3, 300.0), (4, 305.0))),
    ),
    Case(
        "throughput: the last grow paid too little, hold",
        flat(95),
        Reason.LOW_MARGINAL_THROUGHPUT,
        4,
        policy=TPUT,
        history=History(throughput=((3, 300.0), (4, 330.0))),
    ),
    Case("throughput: nothing reported yet refuses", flat(95), Reason.NO_SIGNAL, 4, policy=TPUT),
    Case(
        "throughput: no room to grow",
        flat(50),
        Reason.NO_CAPACITY,
        4,
        policy=TPUT,
        job={"free_gpus": 0},
        history=History(throughput=((4, 400.0),)),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_table(case: Case) -> None:
    job = JobState("ns/a", current_replicas=case.current, **case.job)  # type: ignore[arg-type]
    w = window(case.means, case.fresh, case.expected, case.sm, case.gpm)
    d = decide(job, w, case.policy, case.history, NOW)
    assert d.reason is case.reason, d.message
    assert d.to_replicas == case.to, d.message
    assert d.resize == case.reason.resizes
    assert d.message
    if d.resize:
        assert case.policy.min_replicas <= d.to_replicas <= case.policy.max_replicas or (
            d.trigger is Trigger.EMERGENCY
        )


def test_every_policy_reason_is_covered_by_the_table() -> None:
    # POOL_CONTENDED comes from the pool step after decide (tests/scaler/test_pool.py),
    # RECONCILE from the reconcile pass (tests/scaler/test_reconcile.py).
    not_decide = {
        Reason.MANUAL,
        Reason.MEMBER_LOST,
        Reason.JOB_STARTED,
        Reason.POOL_CONTENDED,
        Reason.RECONCILE,
    }
    assert set(Reason) - not_decide <= {c.reason for c in CASES}


def test_a_signal_is_validated_and_has_its_own_band() -> None:
    with pytest.raises(ConfigError, match="signal"):
        PolicySettings(signal="power")
    with pytest.raises(ConfigError, match="scale_down_sm_active_pct"):
        PolicySettings(scale_down_sm_active_pct=90.0)
    assert SM.band == (50.0, 65.0, 80.0) and P.band == (40.0, 60.0, 80.0)


def test_no_signal_records_the_signal_and_its_window() -> None:
    d = decide(JobState("j", 4), window(flat(95), sm=flat(math.nan), gpm=0.0), SM, History(), NOW)
    ev = d.inputs["signal"]
    assert ev["name"] == "sm_active" and ev["bucket_s"] == 30.0 and ev["sustain_s"] == 300.0
    assert ev["gpm_fractions"] == [0.0] * 10 and ev["bucket_means_pct"] == [None] * 10
    assert "not taken as zero" in d.message


def test_the_guard_records_its_evidence() -> None:
    hist = History(throughput=((4, 400.0), (6, 420.0)))
    d = decide(JobState("j", 4), window(flat(95)), P, hist, NOW)
    assert d.inputs["goodput"] == {
        "throughput_by_replicas": {"4": 400.0, "6": 420.0},
        "compared_replicas": 6,
        "efficiency": pytest.approx(0.1),
        "min_scale_up_efficiency": 0.5,
        "verdict": "halved",
    }
    assert "halved below 6" in d.message
    revert = decide(
        JobState("j", 7),
        window(flat(95)),
        P,
        History(NOW - 400, 1, last_from_replicas=4, throughput=((4, 320.0), (7, 280.0))),
        NOW,
    )
    assert revert.inputs["goodput"]["verdict"] == "reverted"
    assert "320.0 -> 280.0 samples/s" in revert.message


def test_reason_values_mirror_the_proto() -> None:
    from tide.v1 import common_pb2

    for r in Reason:
        assert common_pb2.DecisionReason.Value(f"DECISION_REASON_{r.name}") == r.value
    for t in Trigger:
        assert common_pb2.DecisionTrigger.Value(f"DECISION_TRIGGER_{t.name}") == t.value


def test_noop_carries_recommendation_for_stabilization() -> None:
    d = decide(JobState("j", 4), window(flat(20, 5)), P, History(), NOW)
    assert d.reason is Reason.NOT_SUSTAINED
    assert d.recommendation == 2


def test_proportional_is_exact_on_integers() -> None:
    assert proportional(4, 60.0, 60.0) == 4
    assert proportional(3, 100.0, 60.0) == 5


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"scale_up_utilization_pct": 120.0}, "scale_up_utilization_pct"),
        ({"scale_down_utilization_pct": 90.0}, "scale_down_utilization_pct"),
        ({"target_utilization_pct": 95.0}, "target_utilization_pct"),
        ({"sustain_s": 100.0}, "sustain_s"),
        ({"bucket_s": 0.0}, "bucket_s"),
        ({"cooldown_s": -1.0}, "cooldown_s"),
        ({"min_replicas": 0}, "min_replicas"),
        ({"max_replicas": 1}, "max_replicas"),
        ({"min_coverage": 1.5}, "min_coverage"),
        ({"max_step": 0}, "max_step"),
        ({"min_scale_up_efficiency": 1.5}, "min_scale_up_efficiency"),
    ],
)
def test_settings_validation_names_the_field(overrides: dict[str, object], field_name: str) -> None:
    with pytest.raises(ConfigError, match=field_name):
        P.with_overrides(overrides)


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        P.with_overrides({"bogus": 1})


def test_manual_checks_bounds_and_reason() -> None:
    job = JobState("j", 4)
    d: Decision = manual(job, P, 6, "load test")
    assert (d.reason, d.trigger, d.to_replicas) == (Reason.MANUAL, Trigger.MANUAL, 6)
    with pytest.raises(InvalidArgument):
        manual(job, P, 9, "too many")
    with pytest.raises(InvalidArgument):
        manual(job, P, 6, " ")
    with pytest.raises(FailedPrecondition):
        manual(JobState("j", 4, resize_in_progress=True), P, 6, "x")
