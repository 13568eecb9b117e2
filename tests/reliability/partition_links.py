"""The partitioned links between Tide's own services: agent ↔ scaler, scaler ↔
coordinator, launcher ↔ coordinator (each run by partition_driver.py inside the
server namespace).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tests.coordinator.fakes import ResizeWatch
from tests.coordinator.test_process import HEARTBEAT_S, LiveLauncher
from tests.coordinator.test_process import JOB as PEER_JOB
from tests.reliability.partition_common import (
    BACKOFF_MAX_S,
    CUT_AFTER_NOTICE_S,
    KEEPALIVE_TIME_S,
    KEEPALIVE_TIMEOUT_S,
    MEMBER_TIMEOUT_S,
    PARTITION_S,
    STALE_AFTER_S,
    STREAM_IDLE_TIMEOUT_S,
    LogTail,
    poll_until,
    scrape,
)
from tests.support.netns import CLIENT_ADDR, SERVER_ADDR, NetnsPair
from tests.support.poll import wait_for
from tests.support.procs import ROOT, ServiceProcess, start_memory_scaler, start_service
from tide.services.testing.actuators import read_changes
from tide.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    scaler_pb2,
    scaler_pb2_grpc,
)
from tide.v1.coordinator_pb2 import Directive

K = Directive


def agent_scaler(pair: NetnsPair, db_url: str) -> dict[str, object]:
    """T06: the agent in the client namespace streams to the scaler here; the link is cut."""
    scaler = start_memory_scaler(
        db_url,
        "--listen",
        "0.0.0.0:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--stream-idle-timeout-s",
        str(STREAM_IDLE_TIMEOUT_S),
        "--stale-after-s",
        str(STALE_AFTER_S),
        "--log-level",
        "WARNING",
    )
    agent = subprocess.Popen(
        [
            *pair.exec_in("client"),
            sys.executable,
            "-m",
            "tide.services.agent",
            f"--scaler={SERVER_ADDR}:{scaler.port}",
            "--node-name=part-node",
            "--source=synthetic",
            "--synthetic-gpus=2",
            "--interval-s=0.2",
            "--no-watch-node",
            "--pod-resources-socket=",
            "--backoff-initial-s=0.2",
            f"--backoff-max-s={BACKOFF_MAX_S}",
            f"--keepalive-time-s={KEEPALIVE_TIME_S}",
            f"--keepalive-timeout-s={KEEPALIVE_TIMEOUT_S}",
            # Far above the partition: the transport's keepalive must be what notices.
            "--ack-timeout-s=30",
            "--log-level=INFO",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    log = LogTail(agent)
    streams = "tide_scaler_telemetry_streams"
    fresh = 'tide_scaler_telemetry_nodes{freshness="fresh"}'
    stale = 'tide_scaler_telemetry_nodes{freshness="stale"}'
    try:
        wait_for(lambda: scrape(scaler, streams) == 1, timeout_s=30, what="the agent's stream")
        wait_for(lambda: scrape(scaler, fresh) == 1, timeout_s=10, what="a fresh node")
        accepted_before = scrape(scaler, 'tide_scaler_telemetry_reports_total{result="accepted"}')

        t_cut = pair.cut()
        ended = wait_for(
            lambda: log.first(t_cut, "telemetry stream to", "ended ("),
            timeout_s=PARTITION_S + 20,
            what="the agent noticing",
        )
        wait_for(lambda: scrape(scaler, streams) == 0, timeout_s=20, what="the scaler noticing")
        scaler_detect_s = time.monotonic() - t_cut
        wait_for(lambda: scrape(scaler, stale) == 1, timeout_s=20, what="the node stale")
        stale_s = time.monotonic() - t_cut
        remaining = PARTITION_S - (time.monotonic() - t_cut)
        if remaining > 0:
            time.sleep(remaining)  # the partition's length is the point here, not a poll

        t_heal = pair.heal()
        up = wait_for(
            lambda: log.first(t_heal, "telemetry stream to", " up; resuming at seq"),
            timeout_s=30,
            what="the agent back",
        )
        wait_for(lambda: scrape(scaler, fresh) == 1, timeout_s=10, what="the node fresh again")
        fresh_s = time.monotonic() - t_heal
        accepted_after = scrape(scaler, 'tide_scaler_telemetry_reports_total{result="accepted"}')
        return {
            "link": "agent-scaler",
            "method": pair.method,
            "agent_detect_s": round(ended[0] - t_cut, 3),
            "agent_reason": ended[1].split("ended (", 1)[1].split(")", 1)[0],
            "scaler_detect_s": round(scaler_detect_s, 3),
            "node_stale_s": round(stale_s, 3),
            "agent_reconnect_s": round(up[0] - t_heal, 3),
            "node_fresh_s": round(fresh_s, 3),
            "seq_gaps": scrape(scaler, "tide_scaler_telemetry_seq_gaps_total"),
            "reports_accepted_across": accepted_after - accepted_before,
            "too_many_pings": sum("too_many_pings" in line for _, line in log.lines),
        }
    finally:
        agent.kill()
        agent.wait(timeout=10)
        scaler.kill()


async def coordinator_peer(db_path: str, launchers: int) -> None:
    """The coordinator's side, run in the client namespace: the coordinator and its
    launchers (heartbeating fakes) on that namespace's loopback, so only the scaler's
    link crosses the veth. Prints ``PORT n``; stops when its stdin closes."""
    coordinator = start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--listen",
            "0.0.0.0:0",
            "--db",
            f"sqlite:///{db_path}",
            "--heartbeat-timeout-s",
            "10",
            "--heartbeat-interval-s",
            "1",
            "--tick-interval-s",
            "0.2",
            "--log-level",
            "WARNING",
        ]
    )
    members = [LiveLauncher(f"127.0.0.1:{coordinator.port}", i) for i in range(launchers)]
    try:
        for m in members:
            await m.start()
        print(f"PORT {coordinator.port}", flush=True)
        await asyncio.to_thread(sys.stdin.read)
    finally:
        for m in members:
            await m.stop()
        coordinator.kill()


def scaler_coordinator(pair: NetnsPair, db_url: str) -> dict[str, object]:
    """The scaler here, the coordinator and three launchers in the client namespace; a
    manual grow 2 -> 3 is decided while the link is cut."""
    workdir = Path(tempfile.mkdtemp(prefix="tide-part-"))
    peer = subprocess.Popen(
        [
            *pair.exec_in("client"),
            sys.executable,
            "-m",
            "tests.reliability.partition_driver",
            "coordinator-peer",
            str(workdir / "coordinator.db"),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert peer.stdout is not None and peer.stdin is not None
    line = peer.stdout.readline()
    assert line.startswith("PORT "), line
    changes = workdir / "replicas.jsonl"
    scaler = start_service(
        [
            "-m",
            "tide.services.testing.scaler",
            "--coordinator",
            f"{CLIENT_ADDR}:{int(line.split()[1])}",
            "--actuator",
            f"file:{changes}",
            "--db",
            db_url,
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
        ]
    )
    log = LogTail(scaler.proc)
    ch = grpc.insecure_channel(scaler.target)
    stub = scaler_pb2_grpc.ScalerStub(ch)
    try:
        stub.UpsertJob(
            scaler_pb2.UpsertJobRequest(
                job_id=PEER_JOB,
                initial_replicas=2,
                policy=scaler_pb2.Policy(min_replicas=1, max_replicas=4, cooldown_s=0.0),
            ),
            timeout=10,
        )

        def job() -> scaler_pb2.Job:
            return stub.GetJob(scaler_pb2.GetJobRequest(job_id=PEER_JOB), timeout=10)

        wait_for(
            lambda: job().active_decision_id == 0 and job().current_replicas == 2,
            timeout_s=30,
            what="the job's first generation",
        )
        generation_before = job().generation

        t_cut = pair.cut()
        d = stub.RequestResize(
            scaler_pb2.RequestResizeRequest(
                job_id=PEER_JOB, replicas=3, reason="across a partition", requested_by="t"
            ),
            timeout=10,
        )
        noticed = wait_for(
            lambda: log.first(t_cut, f"decision {d.id} ", "coordinator unreachable"),
            timeout_s=PARTITION_S + 30,
            what="the scaler noticing",
        )
        # The link stays down a while after the scaler noticed: its re-attach attempts
        # meet the partition too.
        time.sleep(CUT_AFTER_NOTICE_S)
        state_during = stub.GetDecision(
            scaler_pb2.GetDecisionRequest(id=d.id), timeout=10
        ).decision.state

        t_heal = pair.heal()
        wait_for(
            lambda: job().active_decision_id == 0,
            timeout_s=60,
            what="the decision's end after the heal",
        )
        done_s = time.monotonic() - t_heal
        detail = stub.GetDecision(scaler_pb2.GetDecisionRequest(id=d.id), timeout=10)
        applied = [c for c in read_changes(changes) if c.decision_id == d.id]
        return {
            "link": "scaler-coordinator",
            "method": pair.method,
            "scaler_detect_s": round(noticed[0] - t_cut, 3),
            "partition_s": round(t_heal - t_cut, 3),
            "state_during": common_pb2.DecisionState.Name(state_during),
            "final_state": common_pb2.DecisionState.Name(detail.decision.state),
            "completed_after_heal_s": round(done_s, 3),
            "to_replicas": detail.decision.to_replicas,
            "generations_opened": job().generation - generation_before,
            "actuator_changes": [[c.old, c.new] for c in applied],
            "completed_events": sum(
                e.state == common_pb2.DECISION_STATE_COMPLETED for e in detail.events
            ),
        }
    finally:
        ch.close()
        scaler.kill()
        peer.stdin.close()
        try:
            peer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait(timeout=10)


async def launcher_peer(target: str, count: int) -> None:
    """The launchers' side, run in the client namespace: ``count`` heartbeating fake
    launchers of PEER_JOB. Prints ``UP``, then ``FAIL t i CODE`` / ``BACK t i`` (t on
    the machine's monotonic clock, which namespaces share) as each one's calls start
    and stop failing, and ``FINAL {json}`` once its stdin closes."""
    members = [LiveLauncher(target, i) for i in range(count)]
    for m in members:
        await m.fl.join()
    ids: list[list[str]] = [[m.fl.member_id] for m in members]
    failing = [False] * count

    async def beat(i: int, m: LiveLauncher) -> None:
        fl = m.fl
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                if fl.stream_ended():
                    await fl.register()  # the same launcher id, as the real launcher
                    await fl.connect()
                    if fl.member_id != ids[i][-1]:
                        ids[i].append(fl.member_id)
                await fl.heartbeat()
                if failing[i]:
                    failing[i] = False
                    print(f"BACK {time.monotonic()} {i}", flush=True)
            except grpc.aio.AioRpcError as exc:
                if not failing[i]:
                    failing[i] = True
                    print(f"FAIL {time.monotonic()} {i} {exc.code().name}", flush=True)
                await fl.disconnect()

    tasks = [asyncio.create_task(beat(i, m)) for i, m in enumerate(members)]
    print("UP", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    for t in tasks:
        t.cancel()
    final = [
        {
            "member_ids": ids[i],
            "generation": m.fl.generation,
            "world_size": m.fl.world_size,
            "rendezvous": sorted(
                d.rendezvous.generation
                for d in m.fl.handled.values()
                if d.kind == K.KIND_RENDEZVOUS
            ),
        }
        for i, m in enumerate(members)
    ]
    for m in members:
        await m.fl.close()
    print("FINAL " + json.dumps(final), flush=True)


def launcher_coordinator(pair: NetnsPair, db_url: str) -> dict[str, object]:
    """The coordinator here, three launchers in the client namespace; a grow 2 -> 3 is
    asked of the coordinator while the link is cut."""
    coordinator = start_service(
        [
            "-m",
            "tide.services.coordinator",
            "--listen",
            "0.0.0.0:0",
            "--db",
            db_url,
            # Longer than the partition: a member that is only unreachable is kept.
            "--heartbeat-timeout-s",
            str(MEMBER_TIMEOUT_S),
            "--heartbeat-interval-s",
            "1",
            "--tick-interval-s",
            "0.2",
            "--log-level",
            "WARNING",
        ]
    )
    peer = subprocess.Popen(
        [
            *pair.exec_in("client"),
            sys.executable,
            "-m",
            "tests.reliability.partition_driver",
            "launcher-peer",
            f"{SERVER_ADDR}:{coordinator.port}",
            "3",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        return asyncio.run(_launcher_coordinator(pair, coordinator, peer))
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=10)
        coordinator.kill()


async def _launcher_coordinator(
    pair: NetnsPair, coordinator: ServiceProcess, peer: subprocess.Popen[str]
) -> dict[str, object]:
    out = LogTail(peer, stdout=True)
    assert peer.stdin is not None
    await poll_until(lambda: out.first(0.0, "UP"), timeout_s=30)
    async with grpc.aio.insecure_channel(coordinator.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        first = await ResizeWatch(stub, PEER_JOB, 1, 2).final(30.0)
        assert first.phase == coordinator_pb2.RESIZE_PHASE_COMPLETED, first

        t_cut = pair.cut()
        grow = ResizeWatch(stub, PEER_JOB, 2, 3, deadline_s=60.0)
        fails = await poll_until(
            lambda: (
                [ln for ln in out.lines if ln[0] >= t_cut and ln[1].startswith("FAIL")]
                if sum(ln[0] >= t_cut and ln[1].startswith("FAIL") for ln in out.lines) >= 3
                else None
            ),
            timeout_s=PARTITION_S + 20,
        )
        remaining = PARTITION_S - (time.monotonic() - t_cut)
        if remaining > 0:
            await asyncio.sleep(remaining)  # the partition's length is the point
        during = await stub.GetJobStatus(
            coordinator_pb2.GetJobStatusRequest(job_id=PEER_JOB), timeout=5
        )

        t_heal = pair.heal()
        result = await grow.final(60.0)
        done_s = time.monotonic() - t_heal
        after = await stub.GetJobStatus(
            coordinator_pb2.GetJobStatusRequest(job_id=PEER_JOB), timeout=5
        )
    peer.stdin.close()
    final = await poll_until(lambda: out.first(t_heal, "FINAL "), timeout_s=15)
    launchers = json.loads(final[1][len("FINAL ") :])
    return {
        "link": "launcher-coordinator",
        "method": pair.method,
        "launcher_detect_s": round(max(ln[0] for ln in fails) - t_cut, 3),
        "partition_s": round(t_heal - t_cut, 3),
        "generation_during": during.generation,
        "members_during": sum(m.state != coordinator_pb2.MEMBER_STATE_GONE for m in during.members),
        "final_phase": coordinator_pb2.ResizePhase.Name(result.phase),
        "completed_after_heal_s": round(done_s, 3),
        "generation_after": after.generation,
        "world_size_after": after.world_size,
        "lost_steps_total": after.lost_steps_total,
        "launchers": launchers,
    }
