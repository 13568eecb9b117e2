"""The control loop end to end in one process: reports in, committed decisions out,
the (fake) coordinator and actuator driven in the documented order."""

from __future__ import annotations

from typing import Any

import pytest

from tests.scaler.service_rig import FAST, T0, Rig, feed, final, make_rig
from tests.scaler.support import report
from tests.support.poll import eventually
from tide.base.errors import InvalidArgument, StoreUnavailable, Unavailable
from tide.services.scaler.convert import inputs_to_proto
from tide.services.scaler.coordination import Phase
from tide.services.scaler.policy import Reason
from tide.services.scaler.store import DecisionState, DecisionStore, StaleEpoch
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator, ReplicaChange
from tide.services.testing.clock import FakeClock
from tide.v1 import telemetry_pb2

pytestmark = pytest.mark.component


async def test_sustained_high_grows_through_the_lifecycle(rig: Rig) -> None:
    feed(rig, 35, 95.0)
    d = await rig.core.evaluate("ns/a")
    assert d.reason is Reason.SUSTAINED_HIGH_UTILIZATION
    assert (d.from_replicas, d.to_replicas) == (2, 4)
    page = await rig.store.list_decisions(job_id="ns/a")
    dec = page.decisions[0]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    detail = await rig.store.get_decision(dec.id)
    assert [e.state for e in detail.events] == [
        DecisionState.PENDING,
        DecisionState.PREPARING,
        DecisionState.ACTUATING,
        DecisionState.COMPLETED,
    ]
    assert detail.decision.inputs["window"]["gpus_fresh"] == 8
    assert rig.actuator.changes == [ReplicaChange("ns/a", 2, 4, dec.id)]
    assert rig.coordinator.job("ns/a") == (2, 4)
    assert rig.core.jobs["ns/a"].current_replicas == 4
    # The cooldown comes from the decision's end.
    assert (await rig.core.evaluate("ns/a")).reason is Reason.COOLDOWN


@pytest.mark.parametrize("failing", [DecisionState.PREPARING, DecisionState.ACTUATING])
async def test_a_decision_waits_out_a_store_outage_and_carries_on(
    rig: Rig, failing: DecisionState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose commit meets an outage did not happen: the decision waits for the
    store, reads itself back and goes on from there (before, it was left unfinished
    and blocked its job until a restart)."""
    real = rig.store.transition
    failed: list[DecisionState] = []

    async def flaky(d: Any, state: DecisionState, *a: Any, **kw: Any) -> Any:
        if state is failing and not failed:
            failed.append(state)
            raise StoreUnavailable(f"decision {d.id} -> {state}: database unavailable")
        return await real(d, state, *a, **kw)

    monkeypatch.setattr(rig.store, "transition", flaky)
    rig.core.controller.retry_s = 0.01
    dec = await rig.core.request_resize("ns/a", 4, "load test", "alice")
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert failed == [failing]
    detail = await rig.store.get_decision(dec.id)
    assert [e.state for e in detail.events] == [
        DecisionState.PENDING,
        DecisionState.PREPARING,
        DecisionState.ACTUATING,
        DecisionState.COMPLETED,
    ]
    assert rig.actuator.changes == [ReplicaChange("ns/a", 2, 4, dec.id)]


async def test_brief_spike_and_stale_data_do_nothing(rig: Rig) -> None:
    feed(rig, 29, 50.0)
    feed(rig, 11, 99.0, start_seq=30)
    assert (await rig.core.evaluate("ns/a")).reason is Reason.NOT_SUSTAINED
    rig.clock.advance(30)
    assert (await rig.core.evaluate("ns/a")).reason is Reason.STALE_DATA
    assert rig.actuator.changes == []


async def test_grow_aborted_by_the_coordinator_puts_replicas_back(rig: Rig) -> None:
    rig.coordinator.fail_at["ns/a"] = Phase.CHECKPOINTING
    feed(rig, 35, 95.0)
    await rig.core.evaluate("ns/a")
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert await final(rig, dec.id) is DecisionState.ABORTED
    assert [(c.old, c.new) for c in rig.actuator.changes] == [(2, 4), (4, 2)]
    assert rig.core.jobs["ns/a"].current_replicas == 2
    assert rig.core.jobs["ns/a"].last_resize_ended_at is not None


async def test_sustained_low_shrinks_checkpoint_first(rig: Rig) -> None:
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 35, 10.0)
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.to_replicas) == (Reason.SUSTAINED_LOW_UTILIZATION, 1)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    # The coordinator resized before the actuator lowered the replicas.
    assert rig.coordinator.calls[0].target_world_size == 1
    assert [(c.old, c.new) for c in rig.actuator.changes] == [(2, 1)]


async def test_termination_notice_shrinks_off_the_node(rig: Rig) -> None:
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 5, 60.0)
    st = rig.core.ingest.open_stream()
    r = report("n2", 1, t=rig.clock.now(), utils=[60.0] * 4, pods=["uid-a-1"] * 4)
    r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    rig.core.ingest.process(st, r)
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.to_replicas) == (Reason.NODE_TERMINATION, 1)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert dec.inputs["leaving_pods"] == ["uid-a-1"]
    assert dec.inputs["leaving_pod_names"] == ["a-trainer-1"]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert rig.coordinator.calls[0].leaving_pods == ("uid-a-1",)
    # The actuator is told which pod goes, not only how many stay; by name too, which is
    # all it can find a pod by once the pod is gone.
    assert rig.actuator.removed == [("ns/a", ("uid-a-1", "a-trainer-1"), dec.id)]


async def test_a_notice_for_a_pod_below_the_highest_index_removes_that_pod(rig: Rig) -> None:
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 5, 60.0)
    st = rig.core.ingest.open_stream()
    # Pod 0 of 2, the lowest index: a count alone would have the actuator stop pod 1.
    r = report("n0", 1, t=rig.clock.now(), utils=[60.0] * 4, pods=["uid-a-0"] * 4)
    r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    rig.core.ingest.process(st, r)
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.to_replicas) == (Reason.NODE_TERMINATION, 1)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert dec.inputs["leaving_pods"] == ["uid-a-0"]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert rig.actuator.removed == [("ns/a", ("uid-a-0", "a-trainer-0"), dec.id)]


def notice(rig: Rig, node: str, pod: str) -> None:
    st = rig.core.ingest.open_stream()
    r = report(node, 1, t=rig.clock.now(), utils=[60.0] * 4, pods=[pod] * 4)
    r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    rig.core.ingest.process(st, r)


async def test_a_notice_supersedes_a_grow_in_flight(rig: Rig) -> None:
    """The grow is aborted (ABORTED in the history, with the reason), then the leave."""
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 5, 60.0)
    rig.coordinator.step_s = 0.3
    grow = await rig.core.request_resize("ns/a", 4, "load test", "alice")
    await eventually(lambda: rig.coordinator.calls)
    notice(rig, "n0", "uid-a-0")
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.supersedes) == (Reason.NODE_TERMINATION, grow.id)
    assert await final(rig, grow.id) is DecisionState.ABORTED
    aborted = (await rig.store.get_decision(grow.id)).decision
    assert "superseded by a node termination" in (aborted.error or "")
    assert [(c.old, c.new) for c in rig.actuator.changes] == [(2, 4), (4, 2)]
    rig.coordinator.step_s = 0.0
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.from_replicas, d.to_replicas, d.supersedes) == (
        Reason.NODE_TERMINATION,
        2,
        1,
        0,
    )
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert rig.actuator.removed == [("ns/a", ("uid-a-0", "a-trainer-0"), dec.id)]


async def test_a_second_nodes_notice_merges_into_one_leave(rig: Rig) -> None:
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 5, 60.0)
    dec = await rig.core.request_resize("ns/a", 4, "load test", "alice")
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    rig.coordinator.step_s = 0.3
    notice(rig, "n0", "uid-a-0")
    first = await rig.core.evaluate("ns/a")
    assert (first.from_replicas, first.to_replicas) == (4, 3)
    one = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    # The same notice again is the leave in flight: nothing new.
    assert (await rig.core.evaluate("ns/a")).reason is Reason.RESIZE_IN_PROGRESS
    notice(rig, "n3", "uid-a-3")
    assert (await rig.core.evaluate("ns/a")).supersedes == one.id
    assert await final(rig, one.id) is DecisionState.ABORTED
    rig.coordinator.step_s = 0.0
    d = await rig.core.evaluate("ns/a")
    assert (d.from_replicas, d.to_replicas) == (4, 2)
    merged = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert merged.inputs["leaving_pods"] == ["uid-a-0", "uid-a-3"]
    assert await final(rig, merged.id) is DecisionState.COMPLETED
    assert rig.actuator.removed == [
        ("ns/a", ("uid-a-0", "uid-a-3", "a-trainer-0", "a-trainer-3"), merged.id)
    ]


async def test_a_pod_that_got_sigterm_is_drained_like_a_noticed_one(rig: Rig) -> None:
    """The launcher's leave request (docs/preemption.md) names its pod: pod 0 goes."""
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    rig.coordinator.request_leave("ns/a", 0)
    await eventually(lambda: any(m.leave_requested for m in rig.core.registry.members("ns/a")))
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 2, 1)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert dec.inputs["leaving_pods"] == ["uid-a-0"]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert rig.actuator.removed == [("ns/a", ("uid-a-0", "a-trainer-0"), dec.id)]


async def test_a_sigterm_leave_is_planned_within_its_grace(rig: Rig) -> None:
    """The launcher sends when its grace ends: the barrier fits in it (not the phase
    timeout), as for a node notice's deadline."""
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    rig.coordinator.request_leave("ns/a", 0, deadline_s=rig.clock.now() + 25.0)
    await eventually(lambda: any(m.leave_requested for m in rig.core.registry.members("ns/a")))
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 2, 1)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert dec.inputs["node_deadline_s"] == pytest.approx(rig.clock.now() + 25.0)
    assert dec.inputs["notice_plan"]["reason"] == "NOTICE"
    assert dec.inputs["barrier_deadline_s"] < 25.0


async def test_a_member_lost_without_notice_is_a_member_lost_record(rig: Rig) -> None:
    await rig.core.tick()  # the baseline of lost steps is what the scaler first saw
    rig.coordinator.lose_member("ns/a", lost_steps=7)
    await rig.core.tick()
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert (dec.reason, dec.trigger, dec.from_replicas, dec.to_replicas) == (
        "MEMBER_LOST",
        "POLICY",
        2,
        1,
    )
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED
    assert (detail.decision.lost_steps, detail.decision.generation) == (7, 2)
    assert rig.core.jobs["ns/a"].current_replicas == 1
    assert rig.actuator.changes == []  # nothing was acted on
    # Seen once: the next tick records nothing more.
    await rig.core.tick()
    assert len((await rig.store.list_decisions(job_id="ns/a")).decisions) == 1


async def test_a_finished_job_is_no_longer_evaluated(rig: Rig) -> None:
    rig.coordinator.finish("ns/a")
    feed(rig, 35, 95.0)
    await rig.core.tick()
    assert "ns/a" not in rig.core.evaluations
    assert (await rig.store.list_decisions(job_id="ns/a")).decisions == ()


async def test_a_failed_job_is_no_longer_evaluated(rig: Rig) -> None:
    said: list[tuple[str, str]] = []
    rig.core.feed.failure_observers.append(lambda job_id, why: said.append((job_id, why)))
    why = "restart budget spent: the worker was killed by SIGSEGV"
    rig.coordinator.fail("ns/a", why)
    feed(rig, 35, 95.0)
    await rig.core.tick()
    assert "ns/a" not in rig.core.evaluations
    assert (await rig.store.list_decisions(job_id="ns/a")).decisions == ()
    # Said once (the Kubernetes Event of the failure), not at every pass.
    await rig.core.tick()
    assert said == [("ns/a", why)]


async def test_the_notice_deadline_rules_the_barrier_deadline(rig: Rig) -> None:
    """The node goes in 30 s: the resize gets 30 s less the margin, not the 60 s phase
    timeout; the plan is in the decision's inputs for `tide explain`."""
    await rig.core.upsert_job("ns/a", {"min_replicas": 1})
    feed(rig, 5, 60.0)
    st = rig.core.ingest.open_stream()
    r = report("n2", 1, t=rig.clock.now(), utils=[60.0] * 4, pods=["uid-a-1"] * 4)
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    ev.deadline.FromNanoseconds(int((rig.clock.now() + 30.0) * 1e9))
    rig.core.ingest.process(st, r)
    await rig.core.evaluate("ns/a")
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    # No checkpoint measured yet: a 2 x 5 s margin.
    assert dec.inputs["barrier_deadline_s"] == pytest.approx(20.0)
    assert dec.inputs["notice_plan"]["reason"] == "NOTICE"
    assert rig.coordinator.calls[0].deadline_s == pytest.approx(20.0)
    msg = inputs_to_proto(dec.inputs)
    assert (list(msg.leaving_pods), msg.barrier_deadline_s) == (["uid-a-1"], 20.0)
    assert msg.notice_plan.startswith("NOTICE: 30.0s left")


async def test_an_evaluation_reads_only_the_jobs_own_nodes(rig: Rig) -> None:
    # A thousand nodes of other work: a job's evaluation must not walk them.
    engine = rig.core.ingest
    for i in range(1000):
        st = engine.open_stream()
        engine.process(st, report(f"other-{i}", 1, t=rig.clock.now(), utils=[50.0] * 8))
        engine.close_stream(st)
    feed(rig, 35, 95.0)
    visited: list[str] = []

    class Counting(dict[str, Any]):
        def values(self) -> Any:
            visited.extend(self)
            return super().values()

        def items(self) -> Any:
            visited.extend(self)
            return super().items()

    engine.job_nodes["ns/a"] = Counting(engine.job_nodes["ns/a"])

    def fleet(now: float) -> dict[str, int]:
        raise AssertionError("a single job's evaluation counted the whole fleet")

    class Fleet(dict[str, Any]):
        def values(self) -> Any:
            raise AssertionError("a single job's evaluation walked every node")

        items = values

    engine.fresh_gpus = fleet  # type: ignore[method-assign]
    engine.nodes = Fleet(engine.nodes)
    d = await rig.core.evaluate("ns/a")
    assert d.reason is Reason.SUSTAINED_HIGH_UTILIZATION
    assert set(visited) == {"n1"}


async def test_manual_resize_and_pause(rig: Rig) -> None:
    await rig.core.set_autoscaling("ns/a", True, "maintenance")
    feed(rig, 35, 95.0)
    assert (await rig.core.evaluate("ns/a")).reason is Reason.PAUSED
    dec = await rig.core.request_resize("ns/a", 3, "load test", "alice")
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert [(c.old, c.new) for c in rig.actuator.changes] == [(2, 3)]


async def test_a_job_in_whole_groups_resizes_by_them_end_to_end(rig: Rig) -> None:
    """replica_multiple reaches the coordinator with each resize (from the policy stored
    with the decision), and a manual resize to part of a group is refused at the edge."""
    await rig.core.upsert_job("ns/a", {"min_replicas": 2, "max_step": 4, "replica_multiple": 2})
    with pytest.raises(InvalidArgument, match="replicas=3 is not a multiple"):
        await rig.core.request_resize("ns/a", 3, "load test", "alice")
    feed(rig, 35, 95.0)
    d = await rig.core.evaluate("ns/a")
    assert (d.reason, d.to_replicas) == (Reason.SUSTAINED_HIGH_UTILIZATION, 4)
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert (
        rig.coordinator.calls[0].target_world_size,
        rig.coordinator.calls[0].world_multiple,
    ) == (4, 2)


async def test_restart_resumes_a_committed_decision(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    a = make_rig(scaler_db_url, clock)
    await a.core.start()
    await a.core.upsert_job("ns/a", FAST)
    await a.store.acquire("ns/a")
    # Committed but never acted on: what a crash right after the commit leaves.
    d = await a.store.create(
        job_id="ns/a",
        from_replicas=2,
        to_replicas=4,
        reason="MANUAL",
        trigger="MANUAL",
        message="x",
        inputs={},
    )
    await a.core.close()
    b = make_rig(scaler_db_url, clock, owner="s2")
    await b.core.start()
    assert await final(b, d.id) is DecisionState.COMPLETED
    assert [(c.old, c.new) for c in b.actuator.changes] == [(2, 4)]
    await b.core.close()
    a.store.engine.dispose()
    b.store.engine.dispose()


async def test_two_scalers_never_both_act_on_a_job(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    a = make_rig(scaler_db_url, clock, owner="a")
    await a.core.start()
    await a.core.upsert_job("ns/a", FAST)
    b = make_rig(scaler_db_url, clock, owner="b")
    await b.core.start()  # takes the job: a's epoch is now stale
    with pytest.raises(StaleEpoch):
        await a.core.request_resize("ns/a", 4, "from a", "a")
    # Its policy loop stops deciding for the job instead of failing every tick.
    await eventually(lambda: "uid-a-1" in a.core.registry.by_uid)
    feed(a, 35, 95.0)
    await a.core.tick()
    assert a.core.fenced == {"ns/a"}
    assert a.actuator.changes == []
    dec = await b.core.request_resize("ns/a", 4, "from b", "b")
    assert await final(b, dec.id) is DecisionState.COMPLETED
    page = await b.store.list_decisions(job_id="ns/a")
    assert [x.requested_by for x in page.decisions] == ["b"]
    for r in (a, b):
        await r.core.close()
        r.store.engine.dispose()


async def test_rollups_reach_sql(rig: Rig) -> None:
    feed(rig, 130, 70.0)
    assert await rig.core.flush_rollups() >= 1
    rows = await rig.store.rollups_between(
        "ns/a", db.utc_from_epoch(T0 - 60), db.utc_from_epoch(T0 + 600)
    )
    assert rows and all(r.mean_pct == 70.0 and r.replicas == 2 for r in rows)
    # Each second of those minutes too: 8 samples of 70 % a second (what `tide whatif` replays).
    seconds = await rig.store.seconds_between(
        "ns/a", db.utc_from_epoch(T0 - 60), db.utc_from_epoch(T0 + 600)
    )
    assert set(seconds) == {r.minute for r in rows}
    for sums, counts in seconds.values():
        assert all(c in (0, 8) for c in counts) and sum(counts) > 0
        assert all(t == 70.0 * c for t, c in zip(sums, counts, strict=True))


async def test_store_warm_up_leaves_nothing_behind(scaler_db_url: str) -> None:
    store = DecisionStore(db.make_engine(scaler_db_url), "w", FakeClock(T0))
    await store.warm_up()
    assert await store.list_jobs() == []
    assert (await store.list_decisions()).decisions == ()
    store.engine.dispose()


async def test_new_job_with_initial_replicas_is_started_by_a_decision(scaler_db_url: str) -> None:
    r = make_rig(scaler_db_url, FakeClock(T0))
    await r.core.start()
    job = await r.core.upsert_job("ns/b", FAST, initial_replicas=3, gpus_per_replica=2)
    # Recorded, committed and handed to the controller, but nothing runs yet.
    assert job.current_replicas == 0
    did = r.core.active["ns/b"]
    assert await final(r, did) is DecisionState.COMPLETED
    detail = await r.store.get_decision(did)
    d = detail.decision
    assert (d.reason, d.trigger, d.from_replicas, d.to_replicas) == ("JOB_STARTED", "MANUAL", 0, 3)
    assert [e.state for e in detail.events] == [
        DecisionState.PENDING,
        DecisionState.PREPARING,
        DecisionState.ACTUATING,
        DecisionState.COMPLETED,
    ]
    assert d.inputs["policy"]["cooldown_s"] == 60.0 and d.inputs["free_gpus"] == 64
    # Pods first, then the coordinator formed the first generation.
    assert r.actuator.changes == [ReplicaChange("ns/b", 0, 3, did)]
    assert r.coordinator.calls[0].target_world_size == 3
    assert r.coordinator.job("ns/b") == (1, 3)
    stored = await r.store.get_job("ns/b")
    assert (stored.current_replicas, stored.generation) == (3, 1)
    assert (r.core.jobs["ns/b"].current_replicas, r.core.jobs["ns/b"].generation) == (3, 1)
    # Upserting it again changes its policy but starts nothing more.
    await r.core.upsert_job("ns/b", {"cooldown_s": 30.0}, initial_replicas=4)
    assert "ns/b" not in r.core.active
    assert len((await r.store.list_decisions(job_id="ns/b")).decisions) == 1
    await r.core.close()
    r.store.engine.dispose()


async def test_aborted_start_leaves_the_job_at_zero_and_a_manual_resize_retries(
    scaler_db_url: str,
) -> None:
    r = make_rig(scaler_db_url, FakeClock(T0))
    await r.core.start()
    r.coordinator.fail_at["ns/b"] = Phase.WAITING_FOR_MEMBERS
    await r.core.upsert_job("ns/b", FAST, initial_replicas=2)
    first = r.core.active["ns/b"]
    assert await final(r, first) is DecisionState.ABORTED
    assert [(c.old, c.new) for c in r.actuator.changes] == [(0, 2), (2, 0)]
    assert r.core.jobs["ns/b"].current_replicas == 0
    again = await r.core.request_resize("ns/b", 2, "retry the start", "sre")
    assert await final(r, again.id) is DecisionState.COMPLETED
    assert r.coordinator.job("ns/b") == (1, 2)
    await r.core.close()
    r.store.engine.dispose()


async def test_a_start_interrupted_by_a_restart_is_resumed(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    a = make_rig(scaler_db_url, clock)
    await a.core.start()
    # The controller never gets to run before the scaler goes: the start is only committed.
    await a.core.upsert_job("ns/b", FAST, initial_replicas=2)
    await a.core.close()
    assert a.actuator.changes == []
    b = make_rig(scaler_db_url, clock, owner="s2", coordinator=a.coordinator)
    await b.core.start()
    (d,) = (await b.store.list_decisions(job_id="ns/b")).decisions
    assert d.reason == "JOB_STARTED"
    assert await final(b, d.id) is DecisionState.COMPLETED
    assert [(c.old, c.new) for c in b.actuator.changes] == [(0, 2)]
    assert a.coordinator.job("ns/b") == (1, 2)
    await b.core.close()
    a.store.engine.dispose()
    b.store.engine.dispose()


async def test_start_outside_the_bounds_is_refused_and_writes_nothing(rig: Rig) -> None:
    with pytest.raises(InvalidArgument, match="initial_replicas=9"):
        await rig.core.upsert_job("ns/b", FAST, initial_replicas=9)
    assert "ns/b" not in rig.core.jobs
    assert [j.job_id for j in await rig.store.list_jobs()] == ["ns/a"]


async def test_metrics_follow_the_decisions_of_a_job(rig: Rig) -> None:
    get = rig.core.metrics.registry.get_sample_value
    job = {"job_id": "ns/a"}
    assert get("tide_scaler_job_replicas", job) == 2
    assert get("tide_scaler_job_scale_up_threshold_ratio", job) == 0.8
    feed(rig, 35, 95.0)
    await rig.core.evaluate("ns/a")
    dec = (await rig.store.list_decisions(job_id="ns/a")).decisions[0]
    assert get("tide_scaler_job_desired_replicas", job) == 4
    created = get("tide_scaler_job_active_decision_created_timestamp_seconds", job)
    assert created == dec.created_at.timestamp()
    assert get("tide_scaler_job_window_utilization_ratio", job) == pytest.approx(0.95)
    assert get("tide_scaler_job_window_coverage_ratio", job) == 1.0
    await final(rig, dec.id)
    labels = {**job, "reason": "sustained_high_utilization", "trigger": "policy"}
    assert get("tide_scaler_decisions_total", {**labels, "state": "completed"}) == 1
    assert get("tide_scaler_job_replicas", job) == 4
    assert get("tide_scaler_job_desired_replicas", job) == 4
    # Final: no active decision, so nothing for the stuck-decision alert to see.
    assert get("tide_scaler_job_active_decision_created_timestamp_seconds", job) is None
    assert get("tide_scaler_evaluation_duration_seconds_count") == 1
    rig.clock.advance(60)
    await rig.core.evaluate("ns/a")
    # An empty window has no utilization rather than a NaN drawn as 0.
    assert get("tide_scaler_job_window_utilization_ratio", job) is None
    assert get("tide_scaler_job_window_coverage_ratio", job) == 0.0
    await rig.core.set_autoscaling("ns/a", True, "maintenance")
    assert get("tide_scaler_job_autoscaling_paused", job) == 1


async def test_actuator_errors_are_counted_by_operation() -> None:
    from prometheus_client import CollectorRegistry

    from tide.services.scaler.actuators.counted import CountedActuator
    from tide.services.scaler.metrics import ScalerMetrics

    class Broken(InMemoryActuator):
        async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
            raise Unavailable("API server down")

    metrics = ScalerMetrics(CollectorRegistry())
    actuator = CountedActuator(Broken(), metrics.actuator_errors)
    with pytest.raises(Unavailable):
        await actuator.set_replicas("ns/a", 3, decision_id=1)
    assert await actuator.free_gpus() is None
    get = metrics.registry.get_sample_value
    assert get("tide_scaler_actuator_errors_total", {"operation": "set_replicas"}) == 1
    assert get("tide_scaler_actuator_errors_total", {"operation": "free_gpus"}) == 0
