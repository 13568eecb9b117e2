"""Two `python -m tide.services.coordinator --leader-election sql` replicas on one store
(SQLite and PostgreSQL): the standby is not ready and answers UNAVAILABLE; the leader
is SIGSTOPped and the standby leads within lease + renew + 1 s, loading the job from
SQL; a member keeps its member id through the takeover (its heartbeat is answered by
the new leader through the same two-address channel); the old leader, SIGCONTed with
a Register waiting for it, exits with status 3 and that Register lands nowhere."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.pg import schema_url
from tests.support.poll import wait_for
from tests.support.procs import ServiceProcess, start_service
from tide.base.client import channel_target
from tide.services.testing.replicas import pause_outside_a_write
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

JOB = "ns/standby"
LEASE_S = 2.0
RENEW_S = 0.5
T = 3.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tide.db'}"
        return
    admin = request.getfixturevalue("pg_admin")
    with schema_url(admin, request.getfixturevalue("pg_url"), "cstandby") as url:
        yield url


def _replica(db_url: str, owner: str) -> ServiceProcess:
    return start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--db",
            db_url,
            "--listen",
            "127.0.0.1:0",
            "--leader-election",
            "sql",
            "--lease-duration-s",
            str(LEASE_S),
            "--lease-renew-s",
            str(RENEW_S),
            "--owner-id",
            owner,
            "--heartbeat-timeout-s",
            "60",
            "--log-level",
            "WARNING",
        ]
    )


def _serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            stub: Any = health_pb2_grpc.HealthStub(ch)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _register(stub: pb_grpc.CoordinatorStub, pod: str, timeout_s: float = T) -> str:
    req = pb.RegisterRequest(
        job_id=JOB, pod_name=pod, host="127.0.0.1", launcher_id=f"l-{pod}", free_port=40000
    )
    return str(stub.Register(req, timeout=timeout_s).member_id)


def _members(db_url: str) -> list[tuple[str, str]]:
    engine = sa.create_engine(db_url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT member_id, pod_name FROM coordinator_members WHERE job_id = :j"),
                {"j": JOB},
            )
            return sorted((str(r[0]), str(r[1])) for r in rows)
    finally:
        engine.dispose()


@pytest.mark.serial  # a takeover-time bound: measured alone (Makefile)
def test_standby_takes_over_from_a_paused_leader_and_the_old_leader_writes_nothing(
    db_url: str,
) -> None:
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_replica, db_url, "a").result()
        wait_for(lambda: _serving(a.target), timeout_s=30, what="replica a leads")
        b = pool.submit(_replica, db_url, "b").result()
    try:
        # The standby: not ready, and every call UNAVAILABLE (never NOT_FOUND, which
        # would make a launcher register again as a new member).
        def refusal() -> str:
            with grpc.insecure_channel(b.target) as ch, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(ch).Heartbeat(pb.HeartbeatRequest(member_id="m"), timeout=T)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            return refused.value.details() or ""

        wait_for(lambda: "following a" in refusal(), timeout_s=10, what="b names its leader")
        assert not _serving(b.target)

        # One channel to both replicas, as a launcher given both addresses dials them.
        target, options = channel_target(f"{a.target},{b.target}")
        with grpc.insecure_channel(target, options=list(options.items())) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            member = _register(stub, "p-0")
            stub.Heartbeat(pb.HeartbeatRequest(member_id=member), timeout=T)

            pause_outside_a_write(a.proc, db_url)
            stopped = time.monotonic()
            wait_for(lambda: _serving(b.target), timeout_s=30, what="replica b leads")
            took_over = time.monotonic() - stopped
            assert took_over <= LEASE_S + RENEW_S + 1.0, took_over

            def beats() -> bool:
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(member_id=member), timeout=1.0)
                except grpc.RpcError:
                    return False
                return True

            wait_for(beats, timeout_s=30, what="the member's heartbeat answered by b")

        # The old leader wakes with a Register waiting in its socket: whichever runs
        # first, its elector (lease gone: exit 3) or the Register (refused: its lease ran
        # out by its own clock, and the store's fence would refuse the write), nothing lands.
        with grpc.insecure_channel(a.target) as ch, ThreadPoolExecutor(1) as pool:
            late = pool.submit(_register, pb_grpc.CoordinatorStub(ch), "late-0", 10.0)
            time.sleep(0.5)
            a.proc.send_signal(signal.SIGCONT)
            assert a.proc.wait(timeout=30) == 3
            with pytest.raises(grpc.RpcError):
                late.result(timeout=15)
        assert _members(db_url) == [(member, "p-0")]
    finally:
        for p in (a, b):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
            p.kill()
