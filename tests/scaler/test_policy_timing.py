"""The policy owns its timing: ``answer_holds_until`` knows every rule of ``decide`` that
reads the time. For any situation, ``decide`` at a later time before that bound (the
window sliding on with the same bucket means, as the scaler's answer cache assumes)
gives the same decision; a time-based rule added to ``decide`` alone breaks this, and
:func:`test_a_time_rule_unknown_to_the_timing_fails` shows the check finds it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from tide.services.scaler import policy as pol

pytestmark = pytest.mark.unit

Decide = Callable[
    [pol.JobState, pol.WindowView, pol.PolicySettings, pol.History, float], pol.Decision
]

#: Utilizations around every threshold of the default policy, and an empty bucket.
_MEANS = st.sampled_from([math.nan, 5.0, 30.0, 39.0, 41.0, 60.0, 79.0, 81.0, 95.0])
#: A condition that ends the policy's reading early, drawn seldom so that the later
#: rules (the ones that read the time) are reached often.
_RARELY = st.sampled_from([False, False, False, True])


@dataclass(frozen=True)
class Case:
    job: pol.JobState
    window: pol.WindowView
    policy: pol.PolicySettings
    history: pol.History
    now: float
    # Where in [now, bound) the later evaluation falls, as a fraction.
    later: float


@st.composite
def cases(draw: st.DrawFn) -> Case:
    bucket_s = draw(st.sampled_from([10.0, 30.0]))
    buckets = draw(st.integers(1, 4))
    p = pol.PolicySettings(
        bucket_s=bucket_s,
        sustain_s=bucket_s * buckets,
        cooldown_s=draw(st.sampled_from([0.0, 20.0, 120.0])),
        scale_down_stabilization_s=draw(st.sampled_from([0.0, 60.0, 300.0])),
        min_replicas=1,
        max_replicas=8,
        min_scale_up_efficiency=draw(st.sampled_from([0.0, 0.5])),
    )
    end_s = 10_000.0
    now = end_s + draw(st.floats(0.0, bucket_s, exclude_max=True))
    cur = draw(st.integers(1, 8))
    gpr = draw(st.sampled_from([1, 4]))
    n = draw(st.integers(max(0, buckets - 1), buckets + 1))
    means = tuple(draw(_MEANS) for _ in range(n))
    expected = cur * gpr
    window = pol.WindowView(
        bucket_s, end_s, means, expected, draw(st.sampled_from([0, expected // 2, *[expected] * 4]))
    )
    terminating = draw(st.sampled_from([0, 0, 0, 1]))
    job = pol.JobState(
        "ns/j",
        cur,
        gpr,
        paused=draw(_RARELY),
        resize_in_progress=draw(_RARELY),
        free_gpus=draw(st.sampled_from([None, 0, 4, 64])),
        terminating_replicas=terminating,
        terminating_pods=frozenset({"p0"}) if terminating else frozenset(),
    )
    ago = draw(st.sampled_from([None, 1.0, 15.0, 40.0, 100.0, 500.0]))
    recs = tuple(
        (now - draw(st.floats(0.0, 400.0)), draw(st.integers(1, 8)))
        for _ in range(draw(st.integers(0, 3)))
    )
    curve = draw(st.sampled_from([(), ((cur, 100.0),), ((max(1, cur - 1), 90.0), (cur, 100.0))]))
    history = pol.History(
        None if ago is None else now - ago,
        draw(st.sampled_from([-1, 0, 1])),
        tuple(sorted(recs)),
        last_from_replicas=draw(st.integers(0, 8)),
        throughput=curve,
    )
    return Case(job, window, p, history, now, draw(st.floats(0.0, 1.0, exclude_max=True)))


def _outcome(d: pol.Decision) -> pol.Decision:
    return replace(d, message="")


def _still_holds(c: Case, decide: Decide, *, exact: bool) -> bool:
    """Whether ``decide`` gives the same answer at the drawn later time before the bound."""
    d = decide(c.job, c.window, c.policy, c.history, c.now)
    until = pol.answer_holds_until(d, c.job, c.window, c.policy, c.history, c.now, exact=exact)
    if until <= c.now:
        return True  # asked anew every time: nothing to hold
    bound = min(until, c.now + 3600.0)
    t = min(c.now + c.later * (bound - c.now), math.nextafter(bound, -math.inf))
    b = c.window.bucket_s
    # The window as the scaler sees it at t: the same means, its end on t's bucket boundary.
    slid = replace(c.window, end_s=c.window.end_s + b * (math.floor(t / b) - math.floor(c.now / b)))
    again = decide(c.job, slid, c.policy, c.history, t)
    return again == d if exact else _outcome(again) == _outcome(d)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.booleans())
def test_the_answer_holds_until_the_policy_says(c: Case, exact: bool) -> None:
    assert _still_holds(c, pol.decide, exact=exact)


def test_a_time_rule_unknown_to_the_timing_fails() -> None:
    """A new rule in ``decide`` that reads the time (here: a job within its band for a
    while after its last resize is called settled) and that ``answer_holds_until`` does
    not know of: the check above finds a situation where a held answer is wrong."""

    def with_settling(
        job: pol.JobState, w: pol.WindowView, p: pol.PolicySettings, h: pol.History, now: float
    ) -> pol.Decision:
        d = pol.decide(job, w, p, h, now)
        end = h.last_resize_end_s
        if d.reason is pol.Reason.WITHIN_BAND and end is not None and now > end + 200.0:
            return dataclasses.replace(d, message="settled within the band")
        return d

    found = find(
        cases(),
        lambda c: not _still_holds(c, with_settling, exact=True),
        settings=settings(max_examples=5000, database=None),
    )
    assert found.history.last_resize_end_s is not None
