"""Reconcile, don't assume (tide/services/scaler/reconcile.py): the pure comparison, then the
scaler core with the in-memory coordinator and actuator, where drift is made by hand."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.scaler.service_rig import FAST, T0, Rig, final, make_rig
from tests.support.poll import eventually, wait_for
from tests.support.procs import start_service
from tide.services.scaler.reconcile import Observed, compare
from tide.services.scaler.store import DecisionState
from tide.services.testing.actuators import ReplicaChange, read_changes, record_change
from tide.services.testing.clock import FakeClock
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

JOB = "ns/a"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("observed", "asked", "sources"),
    [
        (Observed(2, 2, 3), None, None),  # all agree
        (Observed(None, None, None), None, None),  # nobody could say: not a drift
        (Observed(2, 0, 0), None, None),  # the coordinator has no generation yet
        (Observed(3, 2, 3), None, ("actuator",)),  # the PaddleJob was edited by hand
        (Observed(2, 3, 3), None, ("coordinator",)),  # same generation, other world
        (Observed(2, 1, 2), None, ("coordinator",)),  # the coordinator went back in time
        (Observed(1, 3, 3), None, ("actuator", "coordinator")),
        (Observed(2, 1, 4), None, None),  # re-formed smaller: a member lost, not ours
        (Observed(2, 3, 4), None, None),  # re-formed bigger: a member back, not ours
        (Observed(2, 2, 3), 2, None),
        (Observed(3, 2, 3), 3, None),  # still asked for the lost member's pod
        (Observed(2, 2, 3), 3, None),  # ...or runs the job's size now: the pod given up
        (Observed(4, 2, 3), 3, ("actuator",)),
    ],
)
def test_compare(observed: Observed, asked: int | None, sources: tuple[str, ...] | None) -> None:
    drift = compare(JOB, 2, 3, observed, asked_replicas=asked)
    assert (drift.sources if drift else None) == sources
    if drift is not None:
        d = drift.decision()
        assert (d.reason.name, d.trigger.name, d.to_replicas) == ("RECONCILE", "RECONCILE", 2)
        expected = (
            observed.actuator_replicas if "actuator" in sources else observed.coordinator_world_size
        )
        assert d.from_replicas == expected
        assert d.from_replicas != d.to_replicas
        assert "putting back 2" in d.message


@pytest.fixture
async def rig(scaler_db_url: str) -> AsyncIterator[Rig]:
    r = make_rig(scaler_db_url, FakeClock(T0))
    await r.core.start()
    await r.core.upsert_job(JOB, FAST, initial_replicas=2, gpus_per_replica=4)
    await eventually(lambda: JOB not in r.core.active, what="the job's start")
    yield r
    await r.core.close()
    r.store.engine.dispose()


def drift_count(rig: Rig, source: str) -> float:
    value = rig.core.metrics.drift.labels(source)._value.get()
    return float(value)


@pytest.mark.component
async def test_no_drift_no_decision(rig: Rig) -> None:
    before = len((await rig.store.list_decisions(job_id=JOB)).decisions)
    assert await rig.core.reconcile() == []
    assert len((await rig.store.list_decisions(job_id=JOB)).decisions) == before


@pytest.mark.component
async def test_replicas_changed_behind_the_scalers_back_are_put_back_by_a_recorded_decision(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.actuator.replicas[JOB] = 5  # someone scaled the PaddleJob by hand
    drifts = await rig.core.reconcile()
    assert [d.sources for d in drifts] == [("actuator",)]
    assert drift_count(rig, "actuator") == 1
    assert rig.core.metrics.drifting._value.get() == 1
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    assert (dec.reason, dec.trigger, dec.from_replicas, dec.to_replicas) == (
        "RECONCILE",
        "RECONCILE",
        5,
        2,
    )
    assert dec.inputs["drift"]["actuator_replicas"] == 5
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert rig.actuator.replicas[JOB] == 2
    assert rig.core.jobs[JOB].current_replicas == 2
    lines = [r for r in caplog.records if "drift (actuator)" in r.getMessage()]
    assert len(lines) == 1 and getattr(lines[0], "job_id", None) == JOB
    # Corrected: the next pass finds nothing, and records nothing.
    assert await rig.core.reconcile() == []
    assert len((await rig.store.list_decisions(job_id=JOB)).decisions) == 2


@pytest.mark.component
async def test_a_job_with_a_decision_in_flight_is_not_compared(rig: Rig) -> None:
    rig.core.active[JOB] = 999_999  # as while a resize runs: the parties are between sizes
    rig.actuator.replicas[JOB] = 5
    try:
        assert await rig.core.reconcile() == []
    finally:
        del rig.core.active[JOB]


@pytest.mark.component
async def test_after_a_member_lost_the_actuator_still_asked_for_its_pod_is_no_drift(
    rig: Rig,
) -> None:
    await rig.core.tick()
    rig.coordinator.lose_member(JOB, lost_steps=1)
    await rig.core.tick()  # recorded as MEMBER_LOST: the view is 1, the actuator asked 2
    assert rig.core.jobs[JOB].current_replicas == 1 and rig.actuator.replicas[JOB] == 2
    assert await rig.core.reconcile() == []


@pytest.mark.component
def test_the_scaler_process_corrects_a_hand_edit_and_exports_it(tmp_path: Path) -> None:
    """Over real sockets: the production scaler with the file actuator (its file is the
    cluster) notices an edit behind its back within a reconcile interval."""
    changes = tmp_path / "replicas.jsonl"
    scaler = start_service(
        [
            "-m",
            "tide.services.testing.scaler",
            "--coordinator",
            "memory",
            "--actuator",
            f"file:{changes}",
            "--db",
            f"sqlite:///{tmp_path / 'tide.db'}",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--reconcile-interval-s",
            "0.5",
            "--log-level",
            "WARNING",
        ]
    )
    with grpc.insecure_channel(scaler.target) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        try:
            stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id=JOB, initial_replicas=2), timeout=10)

            def settled() -> bool:
                job = stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=10)
                return job.active_decision_id == 0 and job.current_replicas == 2

            wait_for(settled, timeout_s=30, what="the job's start")
            record_change(changes, ReplicaChange(JOB, 2, 4, 0))  # someone scales it by hand

            def corrected() -> scaler_pb2.Decision | None:
                page = stub.ListDecisions(scaler_pb2.ListDecisionsRequest(job_id=JOB), timeout=10)
                return next(
                    (
                        d
                        for d in page.decisions
                        if d.reason == common_pb2.DECISION_REASON_RECONCILE
                        and d.state == common_pb2.DECISION_STATE_COMPLETED
                    ),
                    None,
                )

            d = wait_for(corrected, timeout_s=15, what="a RECONCILE decision")
            assert (d.from_replicas, d.to_replicas, d.trigger) == (
                4,
                2,
                common_pb2.DECISION_TRIGGER_RECONCILE,
            )
            assert read_changes(changes)[-1].new == 2
            url = f"http://127.0.0.1:{scaler.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
            assert 'tide_scaler_drift_total{source="actuator"} 1.0' in text
        finally:
            scaler.kill()
    _, err = scaler.proc.communicate(timeout=10)
    assert sum(f"job {JOB}: drift (actuator)" in line for line in err.splitlines()) == 1


@pytest.mark.component
async def test_a_job_whose_record_changed_while_the_parties_were_asked_is_not_compared(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def answer_after_a_decision_ended(job_id: str) -> int:
        # As _on_final does when a decision ends: the job's record is a new one.
        rig.core.jobs[job_id] = dataclasses.replace(rig.core.jobs[job_id])
        return 5

    monkeypatch.setattr(rig.actuator, "get_replicas", answer_after_a_decision_ended)
    assert await rig.core.reconcile() == []
    assert drift_count(rig, "actuator") == 0
