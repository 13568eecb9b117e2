"""Preemption end to end with real Paddle workers on gloo: a node's termination notice, seen
by the scaler, becomes a coordinated leave of exactly the pod on it (docs/preemption.md).

The scaler runs in this process (ScalerCore, a SQLite store, the real coordinator's gRPC
client and the local actuator starting real launchers); the notice arrives as an agent's
node report would, through the ingest engine."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tide.v1 import telemetry_pb2

from services.common.clock import SystemClock
from services.scaler.actuators.local import JobSpec, LocalActuator, LocalActuatorSettings
from services.scaler.coordination import GrpcCoordinatorClient
from services.scaler.ingest import IngestSettings
from services.scaler.policy import Reason
from services.scaler.service import ScalerCore
from services.scaler.store import DecisionState, DecisionStore
from services.store import db
from services.testing.localjob import EXAMPLE, LocalJob
from tests.e2e.checks import check_exactly_once, steps_by_generation
from tests.scaler.support import report
from tests.support.poll import eventually
from tidebase.timeconv import ts_from_seconds

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

JOB = "ns/e2e"
DATASET, BATCH = 600, 60
SPE = DATASET // BATCH
STEPS = 120
TRAIN = [
    "--dataset-size", str(DATASET),
    "--global-batch", str(BATCH),
    "--hidden", "16",
    "--seed", "5",
    "--steps", str(STEPS),
    "--ckpt-every-steps", "10",
    "--keep", "4",
    "--step-delay-s", "0.05",
]  # fmt: skip


@dataclass
class Rig:
    job: LocalJob
    core: ScalerCore
    actuator: LocalActuator
    store: DecisionStore


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    # A generous heartbeat timeout: a starved coordinator on 2 shared cores must not
    # declare members lost (tests/e2e/test_elastic.py).
    job = LocalJob(tmp_path / "job", TRAIN, job_id=JOB, heartbeat_timeout_s=10.0)
    job.start_coordinator()
    actuator = LocalActuator(
        LocalActuatorSettings(
            state_dir=tmp_path / "pods", coordinator=f"127.0.0.1:{job.port}", stop_grace_s=15.0
        )
    )
    command = (sys.executable, EXAMPLE, "--ckpt-dir", str(job.ckpt_dir))
    actuator.write_spec(JOB, JobSpec(command=(*command, "--log-dir", str(job.log_dir), *TRAIN)))
    url = f"sqlite:///{tmp_path / 'scaler.db'}"
    db.upgrade(url)
    store = DecisionStore(db.make_engine(url), "s1", SystemClock())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{job.port}")
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=GrpcCoordinatorClient(channel),
        clock=SystemClock(),
        ingest=IngestSettings(stagger_slots=False),
    )
    await core.start()
    try:
        yield Rig(job, core, actuator, store)
    finally:
        await core.close()
        await actuator.stop_all()
        await channel.close()
        await job.close()
        store.engine.dispose()


def notice(rig: Rig, node: str, pods: list[str], deadline_in_s: float) -> None:
    """What an agent sends when its node gets a spot interruption notice."""
    st = rig.core.engine.open_stream()
    now = time.time()
    r = report(node, 1, t=now, utils=[60.0] * len(pods), pods=pods, namespace="ns")
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    deadline = ts_from_seconds(now + deadline_in_s)
    assert deadline is not None
    ev.deadline.CopyFrom(deadline)
    rig.core.engine.process(st, r)
    rig.core.engine.close_stream(st)


async def test_a_notice_for_a_middle_pod_removes_exactly_that_pod_and_loses_nothing(
    rig: Rig,
) -> None:
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    assert sorted(before) == [0, 1, 2]
    # The registry follows the coordinator's members: the doomed pod must be known as one.
    await eventually(lambda: rig.core.registry.by_name.get("e2e-trainer-1") == JOB)

    t0 = time.monotonic()
    notice(rig, "spot-1", ["e2e-trainer-1"], deadline_in_s=20.0)
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 2)
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    assert dec.inputs["leaving_pods"] == ["e2e-trainer-1"]
    for task in list(rig.core.controller.tasks.values()):
        await task
    released_s = time.monotonic() - t0
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED, detail.decision
    assert detail.decision.lost_steps == 0
    assert released_s < 20.0, f"the pod was free to go {released_s:.1f}s after a 20s notice"

    # Exactly pod 1 went; pods 0 and 2 are the same processes as before.
    after = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    assert after == {0: before[0], 2: before[2]}
    assert await rig.actuator.get_replicas(JOB) == 2

    st = await rig.job.wait_status(lambda s: s.finished, 120, "the job finished")
    assert st.lost_steps_total == 0 and st.step == STEPS, st
    # The last generation was pods 0 and 2, which trained to the end.
    assert sorted(m.pod_name for m in st.members) == ["e2e-trainer-0", "e2e-trainer-2"]
    gens = steps_by_generation(rig.job.log_dir)
    assert len(gens) == 2, gens
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)
