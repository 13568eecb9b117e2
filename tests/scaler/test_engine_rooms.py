"""The scaler engine's rooms on their own (tide/services/scaler/engine/): the job book, the
ownership interface, the wakeups and the event feed. The pipeline, the driver, custody,
losses and the loop are covered through ScalerCore (test_service.py, test_sharding.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from tide.services.scaler import policy as pol
from tide.services.scaler.engine.feed import DecisionFeed
from tide.services.scaler.engine.jobs import JobBook
from tide.services.scaler.engine.ownership import Ownership
from tide.services.scaler.engine.wakeups import Wakeups
from tide.services.scaler.errors import NotLeader, NotOwner
from tide.services.scaler.leases import LeaderElector, ShardLeases
from tide.services.scaler.metrics import ScalerMetrics
from tide.services.scaler.store import DecisionRecord, DecisionState, JobRecord
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.unit

T = datetime(2026, 1, 1, tzinfo=UTC)


def _job(job_id: str = "ns/a", replicas: int = 2, **overrides: Any) -> JobRecord:
    return JobRecord(
        job_id=job_id,
        min_replicas=1,
        max_replicas=8,
        current_replicas=replicas,
        gpus_per_replica=4,
        policy_overrides=overrides,
        autoscaling_paused=False,
        pause_reason="",
        paused_at=None,
        generation=1,
        last_resize_ended_at=None,
        owner_epoch=1,
        owner_id="s1",
        created_at=T,
        updated_at=T,
        version=1,
    )


def _decision(
    did: int, frm: int, to: int, state: DecisionState, reason: str = "SUSTAINED_HIGH_UTILIZATION"
) -> DecisionRecord:
    return DecisionRecord(
        id=did,
        job_id="ns/a",
        from_replicas=frm,
        to_replicas=to,
        reason=reason,
        trigger="POLICY",
        message="",
        inputs={},
        state=state,
        error="",
        pause_s=0.0,
        lost_steps=0,
        generation=2,
        requested_by="",
        created_at=T,
        updated_at=T,
        ended_at=T if state is not DecisionState.PENDING else None,
        version=1,
    )


def _book() -> JobBook:
    return JobBook(pol.PolicySettings(), ScalerMetrics(CollectorRegistry()))


def test_the_book_says_when_a_jobs_windows_must_be_reshaped() -> None:
    book = _book()
    assert not book.know(_job())  # new: shaped when made
    assert not book.know(_job(cooldown_s=1.0))  # the window's shape is the same
    assert book.know(_job(bucket_s=60.0))
    assert book.shape("ns/a") == (60.0, book.policies["ns/a"].buckets)


def test_a_final_decision_is_mirrored_into_the_book() -> None:
    book = _book()
    book.know(_job())
    book.track(_decision(7, 2, 4, DecisionState.PENDING))
    assert book.active == {"ns/a": 7}
    book.recommended("ns/a", 100.0, 3, window_s=60.0)
    book.finished(_decision(7, 2, 4, DecisionState.COMPLETED))
    assert book.active == {}
    job = book.jobs["ns/a"]
    assert (job.current_replicas, job.generation, job.last_resize_ended_at) == (4, 2, T)
    h = book.history("ns/a", 200.0)
    assert (h.last_direction, h.last_from_replicas, h.recommendations) == (1, 2, ())


def test_a_reconcile_correction_is_not_learnt_as_a_resize() -> None:
    book = _book()
    book.know(_job())
    book.finished(_decision(8, 2, 3, DecisionState.COMPLETED, reason="RECONCILE"))
    assert book.jobs["ns/a"].current_replicas == 3
    assert book.history("ns/a", 0.0).last_direction == 0


def test_recommendations_leave_the_stabilization_window() -> None:
    book = _book()
    book.know(_job())
    for t, r in ((0.0, 5), (30.0, 4), (90.0, 3)):
        book.recommended("ns/a", t, r, window_s=60.0)
    assert book.history("ns/a", 90.0).recommendations == ((30.0, 4), (90.0, 3))


def test_clearing_an_override_puts_the_default_back() -> None:
    book = _book()
    book.know(_job(cooldown_s=5.0))
    merged, rest = book.merged_policy("ns/a", {"max_replicas": 6}, clear=["cooldown_s"])
    assert merged.cooldown_s == pol.PolicySettings().cooldown_s
    assert (merged.max_replicas, rest) == (6, {})


class _Leases:
    me = "r0"

    def __init__(self, owned: set[str]) -> None:
        self.owned = owned

    def owns(self, job_id: str) -> bool:
        return job_id in self.owned

    def owner_of(self, job_id: str) -> None:
        return None

    def shard_of(self, job_id: str) -> int:
        return 3


class _Elector:
    def __init__(self, leads: bool) -> None:
        self.leads = leads

    def may_act(self) -> bool:
        return self.leads

    def follower_message(self) -> str:
        return "the leader is r1"


def test_ownership_alone_elected_and_sharded() -> None:
    o = Ownership()
    assert o.acts_on("ns/a")
    o.fence("ns/a", RuntimeError("taken by s2"))
    assert not o.acts_on("ns/a")
    assert o.must_take("ns/a", {"ns/a": 3})
    o.took(["ns/a"])
    assert o.acts_on("ns/a") and not o.must_take("ns/a", {"ns/a": 3})

    o.leader = cast(LeaderElector, _Elector(leads=False))
    with pytest.raises(NotLeader, match="the leader is r1"):
        o.require("ns/a")
    o.leader = None

    o.shards = cast(ShardLeases, _Leases({"ns/a", "ns/b"}))
    assert o.acts_on("ns/a")  # taken above
    assert not o.acts_on("ns/b") and o.accepts("ns/b")  # held, not yet taken
    assert not o.accepts("ns/c")
    with pytest.raises(NotOwner, match="shard 3"):
        o.require("ns/c")
    o.dropped(["ns/a"])
    assert not o.acts_on("ns/a")


def test_wakeups_only_for_jobs_known_and_acted_on() -> None:
    known = {"ns/a", "ns/b"}
    o = Ownership()
    o.fence("ns/b", RuntimeError("taken"))
    w = Wakeups(FakeClock(), o, known)
    w.slot_opened("ns/b", 1.0)
    w.slot_opened("ns/x", 1.0)
    assert not w.triggers and not w.event.is_set()
    w.slot_opened("ns/a", 1.0)
    assert w.triggers and w.event.is_set()


async def test_the_feed_tells_every_observer_and_watcher_even_when_one_fails() -> None:
    feed = DecisionFeed()
    seen: list[tuple[int, str]] = []

    def broken(d: DecisionRecord, detail: str) -> None:
        raise RuntimeError("observer down")

    feed.observers += [broken, lambda d, detail: seen.append((d.id, detail))]
    q = feed.subscribe("ns/a")
    other = feed.subscribe("ns/other")
    feed.publish(_decision(1, 2, 3, DecisionState.PENDING), "made")
    assert seen == [(1, "made")]
    watched = await asyncio.wait_for(q.get(), 1.0)
    assert watched is not None and watched.detail == "made"
    assert other.empty()
