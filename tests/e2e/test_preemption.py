"""Preemption end to end with real Paddle workers on gloo: a node's termination notice, seen
by the scaler, becomes a coordinated leave of exactly the pod on it (docs/preemption.md).

The scaler runs in this process (tide.services.testing.preempt: ScalerCore, a SQLite store, the
real coordinator's gRPC client and the local actuator starting real launchers); the notice
arrives as an agent's node report would, through the ingest engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.e2e.checks import check_exactly_once, steps_by_generation
from tests.support.poll import eventually
from tide.services.scaler.policy import Reason
from tide.services.scaler.store import DecisionState
from tide.services.testing.kube.operators import POD
from tide.services.testing.preempt import (
    KUBE_NAME,
    KUBE_NS,
    KubePreemptRig,
    PreemptRig,
    kube_preempt_rig,
    notice,
    preempt_rig,
)

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


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[PreemptRig]:
    async with preempt_rig(tmp_path, TRAIN, JOB) as r:
        yield r


async def test_a_notice_for_a_middle_pod_removes_exactly_that_pod_and_loses_nothing(
    rig: PreemptRig,
) -> None:
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    assert sorted(before) == [0, 1, 2]
    # The registry follows the coordinator's members: the doomed pod must be known as one.
    await eventually(lambda: rig.core.registry.by_name.get("e2e-trainer-1") == JOB)

    t0 = time.monotonic()
    notice(rig.core, "spot-1", ["e2e-trainer-1"], deadline_in_s=20.0)
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


@pytest.fixture
async def leaving_rig(tmp_path: Path) -> AsyncIterator[PreemptRig]:
    async with preempt_rig(tmp_path, TRAIN, JOB, env={"TIDE_LEAVE_GRACE_S": "25"}) as r:
        yield r


async def test_sigterm_to_a_trainer_pod_is_a_coordinated_leave(leaving_rig: PreemptRig) -> None:
    """Eviction, graceful node shutdown, `kubectl delete pod`: the launcher asks to leave,
    the scaler drains it, it exits 0 within its grace, and nothing is lost."""
    rig = leaving_rig
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    t0, sent = time.monotonic(), time.time()
    os.kill(before[1], signal.SIGTERM)
    await eventually(
        lambda: any(m.leave_requested for m in rig.core.registry.members(JOB)),
        what="the leave request seen by the scaler",
    )
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 2)
    for task in list(rig.core.controller.tasks.values()):
        await task
    left_s = time.monotonic() - t0
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED, detail.decision
    assert detail.decision.lost_steps == 0
    assert left_s < 25.0, f"the pod left {left_s:.1f}s after SIGTERM, past its grace"
    # The launcher sent its grace's end: the barrier was planned within it.
    assert dec.inputs["node_deadline_s"] == pytest.approx(sent + 25.0, abs=2.0)
    assert dec.inputs["notice_plan"]["reason"] == "NOTICE"
    after = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    assert after == {0: before[0], 2: before[2]}
    st = await rig.job.wait_status(lambda s: s.finished, 120, "the job finished")
    assert st.lost_steps_total == 0 and st.step == STEPS, st
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)


async def test_a_notice_for_a_node_with_two_pods_of_the_job_is_one_leave(
    rig: PreemptRig,
) -> None:
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    await eventually(lambda: rig.core.registry.by_name.get("e2e-trainer-2") == JOB)
    notice(rig.core, "spot-2", ["e2e-trainer-0", "e2e-trainer-2"], deadline_in_s=20.0)
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 1)
    for task in list(rig.core.controller.tasks.values()):
        await task
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    assert dec.inputs["leaving_pods"] == ["e2e-trainer-0", "e2e-trainer-2"]
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED, detail.decision
    assert detail.decision.lost_steps == 0
    # Pod 1, the one not on the node, alone trains on as rank 0 of the new generation.
    assert {p.index: p.pid for p in rig.actuator.pods(JOB)} == {1: before[1]}
    st = await rig.job.wait_status(lambda s: s.finished, 120, "the job finished")
    assert st.lost_steps_total == 0 and st.step == STEPS, st
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)


async def test_a_notice_during_a_grow_aborts_the_grow_then_removes_the_pod(
    rig: PreemptRig,
) -> None:
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 10, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    await eventually(lambda: rig.core.registry.by_name.get("e2e-trainer-1") == JOB)
    grow = await rig.core.request_resize(JOB, 4, "load test", "alice")
    # The newcomer's launcher is importing Paddle: the grow waits for it.
    await eventually(lambda: 3 in {p.index for p in rig.actuator.pods(JOB)}, what="pod 3")
    notice(rig.core, "spot-1", ["e2e-trainer-1"], deadline_in_s=20.0)
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.supersedes) == (Reason.NODE_TERMINATION, grow.id)
    await rig.core.controller.tasks[grow.id]
    aborted = (await rig.store.get_decision(grow.id)).decision
    assert aborted.state is DecisionState.ABORTED, aborted
    assert "superseded by a node termination" in (aborted.error or "")
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 2)
    for task in list(rig.core.controller.tasks.values()):
        await task
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED, detail.decision
    assert detail.decision.lost_steps == 0
    # The newcomer (never a member of a generation) was given back by the abort.
    assert {p.index: p.pid for p in rig.actuator.pods(JOB)} == {0: before[0], 2: before[2]}
    st = await rig.job.wait_status(lambda s: s.finished, 120, "the job finished")
    assert st.lost_steps_total == 0 and st.step == STEPS, st
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)


@pytest.fixture
async def kube_rig(tmp_path: Path) -> AsyncIterator[KubePreemptRig]:
    async with kube_preempt_rig(tmp_path, TRAIN, replicas=3, gpus=3) as r:
        yield r


def _pods(rig: KubePreemptRig) -> dict[str, tuple[str, int]]:
    """The PaddleJob's pods not terminating: name -> (uid, pid of its container)."""
    out = {}
    for p in rig.api.list(POD, KUBE_NS)[0]:
        name = p["metadata"]["name"]
        proc = rig.kubelet.procs.get((KUBE_NS, name))
        if not p["metadata"].get("deletionTimestamp") and proc is not None:
            out[name] = (p["metadata"]["uid"], proc.pid)
    return out


@pytest.mark.timeout(300)
async def test_through_the_kubernetes_actuator_a_middle_pod_goes_and_no_member_stops(
    kube_rig: KubePreemptRig,
) -> None:
    """paddle-operator deletes the highest indexes on a shrink: the actuator keeps the
    replicas and deletes the named pod (the operator recreates it as a spare), so pods 0
    and 2, the new generation, keep their processes; 0 steps lost, every sample once."""
    rig, job_id = kube_rig, f"{KUBE_NS}/{KUBE_NAME}"
    await rig.core.upsert_job(job_id, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 120, "3 members")
    before = _pods(rig)
    assert sorted(before) == [f"{KUBE_NAME}-worker-{i}" for i in range(3)]
    doomed = f"{KUBE_NAME}-worker-1"
    await eventually(lambda: rig.core.registry.by_uid.get(before[doomed][0]) == job_id)

    t0 = time.monotonic()
    # The agent names pods as the kubelet's pod-resources API does: by name.
    notice(rig.core, "spot-1", [doomed], deadline_in_s=20.0, namespace=KUBE_NS)
    d = await rig.core.evaluate(job_id)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 2)
    for task in list(rig.core.controller.tasks.values()):
        await task
    released_s = time.monotonic() - t0
    dec = (await rig.store.list_decisions(job_id=job_id)).decisions[0]
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is DecisionState.COMPLETED, detail.decision
    assert detail.decision.lost_steps == 0
    assert released_s < 20.0, f"the pod was gone {released_s:.1f}s after a 20s notice"

    after = _pods(rig)
    keep = [f"{KUBE_NAME}-worker-0", f"{KUBE_NAME}-worker-2"]
    assert {n: after[n] for n in keep} == {n: before[n] for n in keep}
    assert after.get(doomed, ("", 0))[0] != before[doomed][0]  # gone, or a new pod
    # The replicas stay 3: the operator recreates index 1 as a spare.
    assert await rig.actuator.get_replicas(job_id) == 3

    st = await rig.job.wait_status(lambda s: s.finished, 120, "the job finished")
    assert st.lost_steps_total == 0 and st.step == STEPS, st
    # One change of generation, the preemption's: nothing was lost and re-formed.
    assert st.generation == 2, st
    assert before[doomed][0] not in {m.pod_uid for m in st.members}
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)


async def test_a_notice_shorter_than_a_resize_checkpoints_first(rig: PreemptRig) -> None:
    """2 s of notice, under the 11 s a resize is planned to take before a checkpoint
    was measured (CHECKPOINT_FIRST): the barrier, whose checkpoint is its first act,
    gets all of it; the node takes the pod at the deadline wherever the resize is; at
    most the step in flight is lost, every sample once, pods 0 and 2 never stop."""
    await rig.core.upsert_job(JOB, {"min_replicas": 1}, initial_replicas=3, gpus_per_replica=1)
    await rig.job.wait_status(lambda s: s.world_size == 3 and s.step >= 15, 90, "3 members")
    before = {p.index: p.pid for p in rig.actuator.pods(JOB)}
    await eventually(lambda: rig.core.registry.by_name.get("e2e-trainer-1") == JOB)
    deadline_s = 2.0
    t0 = time.monotonic()
    notice(rig.core, "spot-1", ["e2e-trainer-1"], deadline_in_s=deadline_s)
    d = await rig.core.evaluate(JOB)
    assert (d.reason, d.from_replicas, d.to_replicas) == (Reason.NODE_TERMINATION, 3, 2)
    dec = (await rig.store.list_decisions(job_id=JOB)).decisions[0]
    assert dec.inputs["notice_plan"]["reason"] == "CHECKPOINT_FIRST", dec.inputs
    assert dec.inputs["barrier_deadline_s"] == pytest.approx(deadline_s, abs=0.5)
    # The node goes at its deadline: not a poll, the notice's own time.
    await asyncio.sleep(max(0.0, t0 + deadline_s - time.monotonic()))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(before[1], signal.SIGKILL)
    for task in list(rig.core.controller.tasks.values()):
        await task
    # An aborted barrier would have resumed the training the node then cut short.
    detail = await rig.store.get_decision(dec.id)
    assert detail.decision.state is not DecisionState.ABORTED, detail.decision
    # Pods 0 and 2 are the same processes; read before the job finishes, since a finished
    # job's launchers exit, each in its own time.
    assert {p.index: p.pid for p in rig.actuator.pods(JOB)} == {0: before[0], 2: before[2]}
    st = await rig.job.wait_status(lambda s: s.finished, 150, "the job finished")
    assert st.lost_steps_total <= 1 and st.step == STEPS, st
    check_exactly_once(rig.job.log_dir, DATASET, STEPS, SPE)
