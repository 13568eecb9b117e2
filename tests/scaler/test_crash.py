"""Crash test: the scaler process is SIGKILLed at every lifecycle state (armed by
TIDE_FAULT) and restarted; every decision ends final, each replica change
happened at most once, and nothing acted before its decision was committed.

One scaler process per round: it recovers the previous round's decision
(recovery runs unarmed), then takes a new manual decision that dies at the
round's fault point. The actuator (a file) and the in-memory coordinator's
state file outlive the processes, like a cluster and a coordinator would; the
test entry point (``python -m tide.services.testing.scaler``) injects them.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.support.poll import wait_for
from tests.support.procs import ServiceProcess, start_service
from tide.services.scaler import store as repo
from tide.services.store import db
from tide.services.testing.actuators import read_changes
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

pytestmark = pytest.mark.integration

JOB = "ns/crash"
T = 10.0

ROUNDS = [
    ("decision:PENDING", 4),
    ("decision:PREPARING", 2),
    ("decision:PREPARING", 4),
    ("decision:PREPARING+effect", 2),
    ("decision:PREPARING+effect", 4),
    ("decision:ACTUATING", 2),
    ("decision:ACTUATING", 4),
    ("decision:ACTUATING+effect", 2),
    ("decision:ACTUATING+effect", 4),
    ("decision:COMPLETED", 2),
]


def scaler(url: str, tmp: Path, fault: str) -> ServiceProcess:
    return start_service(
        [
            "-m",
            "tide.services.testing.scaler",
            "--coordinator",
            "memory",
            "--listen",
            "127.0.0.1:0",
            "--db",
            url,
            "--actuator",
            f"file:{tmp / 'actuator.jsonl'}",
            "--coordinator-state-file",
            str(tmp / "coordinator.json"),
            "--min-replicas",
            "1",
            "--log-level",
            "WARNING",
        ],
        env={"TIDE_FAULT": fault} if fault else {"TIDE_FAULT": ""},
    )


def stub_of(proc: ServiceProcess) -> tuple[grpc.Channel, scaler_pb2_grpc.ScalerStub]:
    ch = grpc.insecure_channel(proc.target)
    return ch, scaler_pb2_grpc.ScalerStub(ch)


def settled(stub: scaler_pb2_grpc.ScalerStub) -> scaler_pb2.Job | None:
    job = stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T)
    return job if job.active_decision_id == 0 else None


@pytest.mark.slow
def test_sigkill_at_every_lifecycle_state(scaler_db_url: str, tmp_path: Path) -> None:
    proc = scaler(scaler_db_url, tmp_path, "")
    ch, stub = stub_of(proc)
    stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id=JOB, initial_replicas=2), timeout=T)
    wait_for(lambda: settled(stub), timeout_s=30, what="the job's start")
    ch.close()
    proc.terminate()
    killed = 0
    for fault, target in ROUNDS:
        proc = scaler(scaler_db_url, tmp_path, fault)
        ch, stub = stub_of(proc)
        try:
            wait_for(lambda s=stub: settled(s), timeout_s=30, what="previous decision to finish")
            try:
                stub.RequestResize(
                    scaler_pb2.RequestResizeRequest(
                        job_id=JOB, replicas=target, reason=f"crash at {fault}", requested_by="t"
                    ),
                    timeout=T,
                )
            except grpc.RpcError as exc:
                # Killed before the answer went out (the PENDING fault point).
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            rc = proc.proc.wait(timeout=30)
            assert rc == -9, f"{fault}: scaler exited {rc}, not by SIGKILL"
            killed += 1
        finally:
            ch.close()
            proc.kill()
    proc = scaler(scaler_db_url, tmp_path, "")
    ch, stub = stub_of(proc)
    try:
        job = wait_for(lambda: settled(stub), timeout_s=30, what="last decision to finish")
        assert job.current_replicas == 2
        page = stub.ListDecisions(scaler_pb2.ListDecisionsRequest(page_size=100), timeout=T)
        # The job's start (JOB_STARTED 0 -> 2), then one manual resize per round.
        assert len(page.decisions) == len(ROUNDS) + 1 and len(ROUNDS) == killed
        assert page.decisions[-1].reason == common_pb2.DECISION_REASON_JOB_STARTED
        assert {d.state for d in page.decisions} == {common_pb2.DECISION_STATE_COMPLETED}
    finally:
        ch.close()
        proc.terminate()
    check_actuator_history(scaler_db_url, tmp_path / "actuator.jsonl")


def check_actuator_history(url: str, path: Path) -> None:
    changes = [c for c in read_changes(path) if c.old != c.new]
    engine = db.make_engine(url)
    try:
        factory = db.make_session_factory(engine)
        with db.session_scope(factory, write=False) as s:
            decisions = {
                d.id: repo.get_decision(s, d.id)
                for d in repo.list_decisions(s, page_size=1000).decisions
            }
    finally:
        engine.dispose()
    # Each decision changed the replicas exactly once (no abort here), and in sequence.
    assert sorted(c.decision_id for c in changes) == sorted(decisions)
    assert [c.decision_id for c in changes] == sorted(c.decision_id for c in changes)
    replicas = 0
    for c in changes:
        assert c.old == replicas
        replicas = c.new
        detail = decisions[c.decision_id]
        d = detail.decision
        assert (c.old, c.new) == (d.from_replicas, d.to_replicas)
        # The state that authorizes the change was committed before it happened.
        authorizing = (
            repo.DecisionState.PREPARING
            if d.to_replicas > d.from_replicas
            else repo.DecisionState.ACTUATING
        )
        ev = next(e for e in detail.events if e.state is authorizing)
        assert c.at is not None
        assert ev.at.timestamp() <= c.at + 1e-3, (d.id, authorizing)
