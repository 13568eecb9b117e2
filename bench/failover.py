"""Failover of the scaler (two replicas, one leader) and of the coordinator
(reliability catalog T08; docs/reliability.md).

    python -m bench.failover [--quick] [--pg-url URL] [--leader-election sql|kubernetes]

Scaler: two replicas of ``python -m tide.services.testing.scaler`` with
``--leader-election sql`` (the default: a lease row in the store) or
``kubernetes`` (a coordination.k8s.io/v1 Lease on the API server emulator,
tide/services/testing/kube, run by this process) on one PostgreSQL schema, sharing the actuator's file
and the in-memory coordinator's state file (the cluster and the coordinator,
which outlive any scaler). A driver asks for resizes of one job, 2 -> 3 -> 2 ...,
through whichever replica is ready, and records every decision acknowledged.
The leader is SIGSTOPped mid-run; the follower must lead within lease + renew
+ 1 s (``failover_s``, from the SIGSTOP to the follower's health SERVING). The
old leader is then SIGCONTed: it must find its lease gone and exit, and
nothing it writes may land.

- ``stale_writes_accepted``: decision events of the job written with an owner
  epoch older than one already written before them (each event carries the
  epoch its writer held; fencing must keep them non-decreasing);
- ``double_actuations``: decisions whose replica change reached the actuator
  more than once;
- ``decisions_lost``: acknowledged decisions missing from the store.

The baseline of the scaler's run is the lease itself: ``failover_over_bound`` is
failover_s / (lease + renew + 1 s), which must stay at most 1.

Coordinator, hot: a leader and a started standby (``--leader-election sql``, a
2 s lease renewed every 0.5 s) on one SQLite store, and a member that dials
both (IP:PORT,IP:PORT: each call goes to the replica whose health is SERVING).
The leader is SIGSTOPped between its writes (a SQLite writer paused inside one keeps
the file's lock, and no standby could lead: docs/coordinator.md, Standby replicas);
``coordinator_failover_s`` runs until the member's
heartbeat, with the member id it registered under, is answered by the standby
(which loaded the job from SQL on election). ``coordinator_takeover_s`` runs
from the SIGSTOP until the standby's health is SERVING, and
``coordinator_takeover_over_bound`` is that over lease + renew + 1 s, which
must stay at most 1 (the heartbeat adds the client's routing: a call that
went to the stopped leader waits out its 1 s deadline).
``coordinator_old_leader_exit_code`` is the old leader's status once
SIGCONTed (3: it found its lease gone).

Coordinator, cold, the baseline in the same run: SIGKILL, a new process on the
same store and port, until the member's heartbeat is answered
(``coordinator_cold_failover_s``). It is split in two: ``coordinator_start_s``,
until the new process listens (the interpreter, imports, migrations: what the
standby does not pay), and ``coordinator_restore_s``, from then until the
heartbeat is answered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import sqlalchemy as sa
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tide.base.client import channel_target
from tide.base.listening import parse_listening
from tide.services.testing.actuators import read_changes
from tide.services.testing.kube import KubeApiServer
from tide.services.testing.replicas import pause_outside_a_write, replica_args
from tide.v1 import coordinator_pb2 as cpb
from tide.v1 import coordinator_pb2_grpc as cpb_grpc
from tide.v1 import scaler_pb2, scaler_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
JOB = "ns/failover"
LEASE_S = 6.0
RENEW_S = 2.0
T = 3.0
#: The coordinator's replicas: a short lease, as a coordinator's takeover is what
#: members wait for (docs/coordinator.md, "Standby replicas").
COORD_LEASE_S = 2.0
COORD_RENEW_S = 0.5


def _start(args: list[str], log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    err = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True
        )
    finally:
        if not isinstance(err, int):
            err.close()  # the child holds its own copy
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{args[1]} did not start")
        ports = parse_listening(line)
        if ports is not None:
            return proc, f"127.0.0.1:{ports.grpc_port}"


def _serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            stub: Any = health_pb2_grpc.HealthStub(ch)  # grpcio-health ships no stub types
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def _wait(cond: Any, timeout_s: float, what: str, logs: Path | None = None) -> float:
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout_s:
            tails = ""
            for log in sorted(logs.glob("*.log")) if logs is not None else []:
                tails += f"\n--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-40:])
            raise SystemExit(f"timed out waiting for {what}{tails}")
        time.sleep(0.05)
    return time.monotonic() - started


def _lease_args(election: str, kubeconfig: Path | None) -> list[str]:
    args = ["--leader-election", election]
    if election == "kubernetes":
        assert kubeconfig is not None
        args += ["--lease-kubeconfig", str(kubeconfig), "--lease-namespace", "default"]
    return args


def _replica(
    url: str, tmp: Path, owner: str, lease: list[str]
) -> tuple[subprocess.Popen[str], str]:
    return _start(
        replica_args(
            tmp,
            owner,
            url,
            *lease,
            "--lease-duration-s",
            str(LEASE_S),
            "--lease-renew-s",
            str(RENEW_S),
            "--min-replicas",
            "1",
        ),
        log=tmp / f"{owner}.log",
    )


class Driver(threading.Thread):
    """Asks for 2 -> 3 -> 2 ... through whichever replica answers; records acks."""

    def __init__(self, targets: list[str]) -> None:
        super().__init__(daemon=True)
        self.targets = targets
        self.acked: list[int] = []
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        channels = [grpc.insecure_channel(t) for t in self.targets]
        stubs = [scaler_pb2_grpc.ScalerStub(c) for c in channels]
        want = 3
        while not self.stop.is_set():
            for stub in stubs:
                try:
                    job = stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T)
                    if job.active_decision_id:
                        break
                    d = stub.RequestResize(
                        scaler_pb2.RequestResizeRequest(
                            job_id=JOB, replicas=want, reason="failover bench", requested_by="b"
                        ),
                        timeout=T,
                    )
                    self.acked.append(d.id)
                    want = 5 - want
                    break
                except grpc.RpcError:
                    self.refused += 1  # a paused leader, or a follower: try the other
            time.sleep(0.2)
        for c in channels:
            c.close()


def scaler_failover(url: str, tmp: Path, engine: sa.Engine, lease: list[str]) -> dict[str, Any]:
    a, a_target = _replica(url, tmp, "replica-a", lease)
    _wait(lambda: _serving(a_target), 30, "replica a to lead", tmp)
    b, b_target = _replica(url, tmp, "replica-b", lease)
    try:
        assert not _serving(b_target), "the second replica must follow"
        with grpc.insecure_channel(a_target) as ch:
            scaler_pb2_grpc.ScalerStub(ch).UpsertJob(
                scaler_pb2.UpsertJobRequest(job_id=JOB, initial_replicas=2), timeout=T
            )
        driver = Driver([a_target, b_target])
        driver.start()
        _wait(lambda: len(driver.acked) >= 4, 60, "decisions before the pause", tmp)
        os.kill(a.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        failover_s = _wait(lambda: _serving(b_target), 30, "replica b to lead", tmp)
        before = len(driver.acked)
        _wait(lambda: len(driver.acked) >= before + 4, 60, "decisions after the failover", tmp)
        os.kill(a.pid, signal.SIGCONT)
        a_rc = a.wait(timeout=30)
        driver.stop.set()
        driver.join(timeout=30)
        with grpc.insecure_channel(b_target) as ch:
            stub = scaler_pb2_grpc.ScalerStub(ch)
            _wait(
                lambda: (
                    stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T).active_decision_id
                    == 0
                ),
                60,
                "the last decision to end",
            )
    finally:
        for p in (a, b):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=20)
    with engine.connect() as conn:
        ids = {r[0] for r in conn.execute(sa.text("SELECT id FROM decisions"))}
        events = conn.execute(
            sa.text(
                "SELECT e.owner_epoch FROM decision_events e JOIN decisions d"
                " ON d.id = e.decision_id WHERE d.job_id = :j ORDER BY e.id"
            ),
            {"j": JOB},
        ).all()
    stale, high = 0, 0
    for (epoch,) in events:
        if epoch < high:
            stale += 1
        high = max(high, epoch)
    changes = [c for c in read_changes(tmp / "actuator.jsonl") if c.old != c.new]
    per_decision: dict[int, list[tuple[int, int]]] = {}
    for c in changes:
        per_decision.setdefault(c.decision_id, []).append((c.old, c.new))
    bound_s = LEASE_S + RENEW_S + 1.0
    return {
        "failover_s": round(failover_s, 2),
        "failover_bound_s": bound_s,
        "failover_over_bound": round(failover_s / bound_s, 3),
        "stale_writes_accepted": stale,
        # The same change applied twice for one decision (an aborted grow's way back
        # to where it was is a second, different change, not a double).
        "double_actuations": sum(
            1 for ch in per_decision.values() if len(ch) != len({new for _, new in ch})
        ),
        "decisions_with_several_changes": {
            str(d): ch for d, ch in per_decision.items() if len(ch) > 1
        },
        "decisions_lost": len(set(driver.acked) - ids),
        "decisions_acked": len(driver.acked),
        "old_leader_exit_code": a_rc,
        "stopped_for_s": round(time.monotonic() - stopped, 1),
        "calls_refused_during_failover": driver.refused,
    }


def _beats(stub: Any, member: str, seen: list[str] | None = None) -> bool:
    """Whether the member's heartbeat is answered; ``seen`` keeps the last refusal."""
    try:
        stub.Heartbeat(cpb.HeartbeatRequest(member_id=member), timeout=1.0)
    except grpc.RpcError as exc:
        if seen is not None:
            seen[:] = [f"{exc.code().name}: {exc.details()}"]
        return False
    return True


def coordinator_cold_failover(tmp: Path) -> dict[str, float]:
    """No standby: SIGKILL, a new process on the same store and port."""
    db_url = f"sqlite:///{tmp / 'cold.db'}"
    args = ["-m", "tide.services.coordinator", "--db", db_url, "--log-level", "ERROR", "--insecure"]
    first, target = _start([*args, "--listen", "127.0.0.1:0"])
    port = target.rpartition(":")[2]
    with grpc.insecure_channel(target) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        member = _wait_value(lambda: _try_register(stub), 30, "the member registered")
    first.kill()
    first.wait(timeout=10)
    killed = time.monotonic()
    second, target = _start([*args, "--listen", f"127.0.0.1:{port}"])
    listening = time.monotonic()
    try:
        with grpc.insecure_channel(target) as ch:
            stub = cpb_grpc.CoordinatorStub(ch)
            _wait(lambda: _beats(stub, member), 30, "the member's heartbeat on the new coordinator")
        done = time.monotonic()
        return {
            "coordinator_cold_failover_s": round(done - killed, 2),
            "coordinator_start_s": round(listening - killed, 2),
            "coordinator_restore_s": round(done - listening, 2),
        }
    finally:
        second.terminate()
        second.wait(timeout=20)


def coordinator_failover(tmp: Path) -> dict[str, Any]:
    """A leader and a started standby on one store (``--leader-election sql``); the
    member dials both (tide.base.client.channel_target: the replica whose health is
    SERVING gets the call). The leader is SIGSTOPped; ``coordinator_failover_s`` runs
    until the member's heartbeat is answered by the standby, with its old member id."""
    db_url = f"sqlite:///{tmp / 'standby.db'}"
    logs = tmp / "coordinator-logs"
    logs.mkdir(exist_ok=True)
    args = [
        "-m",
        "tide.services.coordinator",
        "--db",
        db_url,
        "--log-level",
        "INFO",
        "--insecure",
        "--listen",
        "127.0.0.1:0",
        "--leader-election",
        "sql",
        "--lease-duration-s",
        str(COORD_LEASE_S),
        "--lease-renew-s",
        str(COORD_RENEW_S),
    ]
    a, a_target = _start([*args, "--owner-id", "a"], logs / "a.log")
    _wait(lambda: _serving(a_target), 30, "coordinator a leads", logs)
    b, b_target = _start([*args, "--owner-id", "b"], logs / "b.log")
    try:
        target, options = channel_target(f"{a_target},{b_target}")
        with grpc.insecure_channel(target, options=list(options.items())) as ch:
            stub = cpb_grpc.CoordinatorStub(ch)
            member = _wait_value(lambda: _try_register(stub), 30, "the member registered", logs)
            leads: list[float] = []
            watcher = threading.Thread(
                target=lambda: leads.append(_wait(lambda: _serving(b_target), 30, "b leads")),
                daemon=True,
            )
            # On SQLite, between the leader's writes: a pause inside one holds the file's
            # write lock, and no standby can lead until it runs (docs/coordinator.md).
            pause_outside_a_write(a, db_url)
            stopped = time.monotonic()
            watcher.start()
            refused: list[str] = []
            try:
                _wait(lambda: _beats(stub, member, refused), 30, "the member's heartbeat", logs)
            except SystemExit as exc:
                raise SystemExit(
                    f"{exc} [on the standby; its health SERVING: {_serving(b_target)}; "
                    f"the last refusal: {refused}]"
                ) from None
            done = time.monotonic()
            watcher.join(timeout=30)
        a.send_signal(signal.SIGCONT)
        a_rc = a.wait(timeout=30)
        bound_s = COORD_LEASE_S + COORD_RENEW_S + 1.0
        return {
            "coordinator_failover_s": round(done - stopped, 2),
            "coordinator_takeover_s": round(leads[0], 2) if leads else None,
            "coordinator_lease_s": COORD_LEASE_S,
            "coordinator_failover_bound_s": bound_s,
            "coordinator_takeover_over_bound": round(leads[0] / bound_s, 3) if leads else None,
            "coordinator_old_leader_exit_code": a_rc,
        }
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                p.wait(timeout=20)


def _try_register(stub: Any) -> str:
    try:
        return str(
            stub.Register(
                cpb.RegisterRequest(
                    job_id="ns/c",
                    pod_name="c-0",
                    host="127.0.0.1",
                    launcher_id="l-0",
                    free_port=40000,
                ),
                timeout=T,
            ).member_id
        )
    except grpc.RpcError:
        return ""


def _wait_value(get: Any, timeout_s: float, what: str, logs: Path | None = None) -> Any:
    box: list[Any] = []

    def got() -> bool:
        value = get()
        if value:
            box.append(value)
        return bool(value)

    _wait(got, timeout_s, what, logs)
    return box[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one failover (the default)")
    ap.add_argument(
        "--pg-url",
        default=os.environ.get(
            "TIDE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    )
    ap.add_argument(
        "--leader-election",
        choices=("sql", "kubernetes"),
        default="sql",
        help="where the replicas' lease lives: a row in the store, or a Kubernetes Lease",
    )
    args = ap.parse_args(argv)
    admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    schema = f"failover_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in args.pg_url else "?"
    url = f"{args.pg_url}{sep}options={quote(f'-csearch_path={schema}')}"
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            kubeconfig = None
            if args.leader_election == "kubernetes":
                kube = stack.enter_context(KubeApiServer())
                kubeconfig = kube.write_kubeconfig(Path(tmp) / "kubeconfig")
            lease = _lease_args(args.leader_election, kubeconfig)
            result: dict[str, Any] = {"leader_election": args.leader_election}
            result |= scaler_failover(url, Path(tmp), engine, lease)
            result |= coordinator_failover(Path(tmp))
            result |= coordinator_cold_failover(Path(tmp))
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
    print(json.dumps(result, indent=1), file=sys.stderr)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
