"""The replay on histories made up here: what it reads, what it assumes, what it decides."""

from __future__ import annotations

import pytest

from tide.services.scaler.policy import PolicySettings
from tide.services.sim.replay import JobHistory, Recorded, Second, real_replicas, replay

pytestmark = pytest.mark.unit

P = PolicySettings(bucket_s=2.0, sustain_s=10.0, cooldown_s=10.0, min_replicas=2, max_replicas=8)
T0 = 1_800_000_000.0


def seconds(*spans: tuple[int, float]) -> tuple[Second, ...]:
    out, t = [], T0
    for n, util in spans:
        for _ in range(n):
            out.append(Second(t, util, 2))
            t += 1
    return tuple(out)


def history(secs: tuple[Second, ...], *decisions: Recorded) -> JobHistory:
    return JobHistory("ns/a", 1, T0, secs[-1].t_s + 1, 2, secs, decisions, float(len(secs)))


def test_a_sustained_load_grows_after_the_sustain() -> None:
    r = replay(history(seconds((20, 50.0), (40, 95.0))), P)
    (d,) = [x for x in r.decisions if x.reason == "SUSTAINED_HIGH_UTILIZATION"][:1]
    # 95 % from T0+20: every 2 s bucket of the last 10 s is above 80 % at T0+30.
    assert (d.from_replicas, d.to_replicas) == (2, 4)
    assert d.at_s - (T0 + 20) == pytest.approx(10.0, abs=1.0)
    assert r.extra >= 1 and not r.exact  # nothing was recorded to match


def test_recorded_decisions_of_no_policy_happen_as_they_happened() -> None:
    manual = Recorded(7, T0 + 5, T0 + 8, 2, 6, "MANUAL", "MANUAL", "COMPLETED")
    r = replay(history(seconds((60, 50.0)), manual), P)
    assert [(x.from_replicas, x.to_replicas, x.matches) for x in r.decisions] == [(2, 6, 7)]
    assert r.replicas[-1] == (T0 + 8, 6)
    assert real_replicas(history(seconds((60, 50.0)), manual))[-1] == (T0 + 8, 6)


def test_minutes_without_detail_are_replayed_a_minute_at_a_time() -> None:
    minutes = tuple(Second(T0 + 60 * i, 95.0, 120, 60.0) for i in range(5))
    h = JobHistory("ns/a", 1, T0, T0 + 300, 2, minutes, (), 0.0)
    r = replay(h, P)
    grows = [x for x in r.decisions if x.reason == "SUSTAINED_HIGH_UTILIZATION"]
    assert grows and grows[0].at_s == pytest.approx(T0 + 60, abs=1.0)


def test_the_load_model_decides_what_a_job_at_another_size_would_show() -> None:
    """The real job ran at 2 replicas, its GPUs at 95 %. Replayed at 4, the same work
    spread over twice the GPUs shows 47.5 % (proportional: no further grow), or the GPUs
    stay at 95 % (same: the job grows again after the cooldown and a sustain)."""
    h = history(seconds((90, 95.0)))
    prop = replay(h, P, load_model="proportional")
    same = replay(h, P, load_model="same")
    grows = lambda r: [(x.from_replicas, x.to_replicas) for x in r.decisions]  # noqa: E731
    assert grows(prop) == [(2, 4)]
    assert grows(same)[:2] == [(2, 4), (4, 7)]
    assert same.gpu_hours > prop.gpu_hours
