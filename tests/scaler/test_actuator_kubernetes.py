"""The Kubernetes actuator beyond the shared contract: both PaddleJob kinds, the
resourceVersion on every patch, a 409 re-read and re-checked, the pods' watch
recovering from 410, free GPUs from the node and pod cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.scaler.kube_world import (
    KUBEFLOW,
    PADDLE_OPERATOR,
    Cluster,
    cluster,
    kubeflow_job,
    paddle_operator_job,
)
from tests.support.poll import eventually
from tide.base.errors import FailedPrecondition, NotFound
from tide.services.scaler.actuators import acting_while
from tide.services.scaler.actuators.kubernetes import (
    OWNER_EPOCH,
    KubernetesActuator,
    KubernetesActuatorSettings,
)
from tide.services.scaler.errors import StaleEpoch
from tide.services.testing.kube.operators import job_pods

pytestmark = pytest.mark.integration  # pods are real processes


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Cluster, KubernetesActuator]]:
    with cluster(tmp_path, gpus=4) as c:
        actuator = KubernetesActuator(
            KubernetesActuatorSettings(source=str(c.kubeconfig), pod_wait_s=30, watch_timeout_s=5)
        )
        actuator.start()
        try:
            yield c, actuator
        finally:
            actuator.stop()


async def test_both_kinds_resize_through_their_own_replicas_field(
    world: tuple[Cluster, KubernetesActuator],
) -> None:
    c, a = world
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("pdj", 1))
    c.api.create(KUBEFLOW, kubeflow_job("kf", 1))
    await a.set_replicas("default/pdj", 2, decision_id=1)
    await a.set_replicas("default/kf", 2, decision_id=2)
    assert c.api.get(PADDLE_OPERATOR, "default", "pdj")["spec"]["worker"]["replicas"] == 2
    kf = c.api.get(KUBEFLOW, "default", "kf")
    assert kf["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"] == 2
    # Returned once the operator made the pods: both, by index.
    assert c.live_pods(PADDLE_OPERATOR, "default", "pdj") == ["pdj-worker-0", "pdj-worker-1"]
    assert c.live_pods(KUBEFLOW, "default", "kf") == ["kf-worker-0", "kf-worker-1"]
    # A shrink returns once the highest index is gone, not only asked to go.
    await a.set_replicas("default/pdj", 1, decision_id=3)
    assert c.live_pods(PADDLE_OPERATOR, "default", "pdj") == ["pdj-worker-0"]
    assert await a.get_replicas("default/kf") == 2
    assert await a.get_replicas("default/none") is None
    with pytest.raises(NotFound):
        await a.set_replicas("default/none", 1, decision_id=4)


async def test_a_conflict_is_read_again_and_rechecked(
    world: tuple[Cluster, KubernetesActuator],
) -> None:
    c, a = world
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 1))
    # Every patch carries the resourceVersion it read: a stale one is refused.
    c.api.conflict_next("paddlejobs")
    await a.set_replicas("default/j", 2, decision_id=1)
    # Every 409 the server gave was read again; the operator stand-in's own status write can
    # make one more than the injected one on a loaded machine (it raced the first read).
    assert a.conflicts_retried == c.api.stats.conflicts >= 1
    assert c.api.get(PADDLE_OPERATOR, "default", "j")["spec"]["worker"]["replicas"] == 2
    # Its status writes as the new pod starts would race the next decisions' reads as well.
    # The later conflicts count from what the first decision met (CI once counted 4 retries
    # for 3 injected conflicts, two of them in the first decision), once the job is settled.
    await eventually(lambda: _running(c, "j") == 2, 10, what="the operator's status: 2 running")
    first = a.conflicts_retried

    # The other writer lowered the maximum to 2: growing to 3 is no longer allowed.
    def lower_max(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["worker"]["limits"] = 2
        return obj

    c.api.conflict_next("paddlejobs", change=lower_max)
    with pytest.raises(FailedPrecondition, match="outside the PaddleJob's bounds"):
        await a.set_replicas("default/j", 3, decision_id=2)
    assert c.api.get(PADDLE_OPERATOR, "default", "j")["spec"]["worker"]["replicas"] == 2

    # The other writer did what we wanted: nothing left to patch.
    def to_one(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["worker"]["replicas"] = 1
        return obj

    c.api.conflict_next("paddlejobs", change=to_one)
    await a.set_replicas("default/j", 1, decision_id=3)
    assert a.conflicts_retried == first + 2


def _running(c: Cluster, name: str) -> int:
    """The workers running, as the operator stand-in wrote the job's status."""
    job = c.api.get(PADDLE_OPERATOR, "default", name)
    return int((job.get("status") or {}).get("worker", {}).get("running", 0))


async def test_a_leader_that_lost_its_lease_while_it_retried_a_conflict_patches_nothing(
    world: tuple[Cluster, KubernetesActuator],
) -> None:
    """The race bench.failover found: a leader reads, is paused, another leader
    changes the job, the old one wakes to a 409 and reads again. Re-applying its
    change on top of the new leader's would be a second actuation: it asks first."""
    c, a = world
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 2))

    def new_leader_grew_it(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["worker"]["replicas"] = 3
        return obj

    c.api.conflict_next("paddlejobs", change=new_leader_grew_it)
    asked = [True, False]  # it led when it read; not when it came back from the 409
    with acting_while(lambda: asked.pop(0)), pytest.raises(StaleEpoch):
        await a.set_replicas("default/j", 1, decision_id=1)
    assert c.api.get(PADDLE_OPERATOR, "default", "j")["spec"]["worker"]["replicas"] == 3
    assert a.conflicts_retried == 1


async def test_the_pod_watch_recovers_from_410(world: tuple[Cluster, KubernetesActuator]) -> None:
    c, a = world
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 1))
    await eventually(lambda: a.capacity.pods.synced.is_set(), 10)
    # The history the watch would resume from is gone, and the watch is cut.
    c.api.compact()
    c.api.drop_watches()
    await a.set_replicas("default/j", 3, decision_id=1)
    assert c.live_pods(PADDLE_OPERATOR, "default", "j") == [f"j-worker-{i}" for i in range(3)]
    await eventually(lambda: a.capacity.pods.stats.expired >= 1, 10, what="a 410 and a re-list")
    assert a.capacity.pods.stats.lists >= 2


async def test_free_gpus_follow_the_nodes_and_every_tenants_pods(
    world: tuple[Cluster, KubernetesActuator],
) -> None:
    c, a = world
    await eventually(lambda: a.capacity.free_gpus() == 4, 10)
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 3))
    await eventually(lambda: a.capacity.free_gpus() == 1, 10, what="3 of 4 GPUs taken")
    # Past the node's GPUs: the extra pod stays Pending and the wait still returns.
    await a.set_replicas("default/j", 5, decision_id=1)
    assert await a.free_gpus() == 0
    nodes = c.api.rtype("", "v1", "nodes")
    c.api.update(nodes, "", "gpu-node-1", lambda n: {**n, "spec": {"unschedulable": True}})
    await eventually(lambda: a.capacity.free_gpus() == 0, 10)
    await a.set_replicas("default/j", 1, decision_id=2)
    c.api.update(nodes, "", "gpu-node-1", lambda n: {**n, "spec": {}})
    await eventually(lambda: a.capacity.free_gpus() == 3, 10, what="the node back, 1 GPU used")


@pytest.mark.parametrize("kind", ["paddle-operator", "kubeflow"])
async def test_remove_pods_stops_exactly_the_named_pod_and_no_member(
    world: tuple[Cluster, KubernetesActuator], kind: str
) -> None:
    """Pod 1 of 3 is on a dying node. Lowering the count would make the operator delete
    pod 2, a member of the generation formed without pod 1: the replicas stay 3, pod 1
    alone is deleted, and the operator recreates it as a spare (both operators recreate
    a missing index below the replicas)."""
    c, a = world
    rtype = PADDLE_OPERATOR if kind == "paddle-operator" else KUBEFLOW
    c.api.create(rtype, (paddle_operator_job if rtype is PADDLE_OPERATOR else kubeflow_job)("j", 3))
    await eventually(lambda: len(running(c, rtype)) == 3, 15, what="3 pods running")
    before = running(c, rtype)
    # By uid (what the launcher registers with, from the Downward API) or by name.
    named = before["j-worker-1"] if kind == "kubeflow" else "j-worker-1"
    await a.remove_pods("default/j", [named], replicas=2, decision_id=7)
    now = uids(c, rtype)
    assert before["j-worker-1"] not in now.values()
    assert now["j-worker-0"] == before["j-worker-0"] and now["j-worker-2"] == before["j-worker-2"]
    assert await a.get_replicas("default/j") == 3
    await eventually(
        lambda: running(c, rtype).get("j-worker-1") not in (None, before["j-worker-1"]),
        15,
        what="the operator's replacement for pod 1",
    )
    # A repeat by uid finds the pod gone: not a change (the replacement is a new uid).
    spare = running(c, rtype)["j-worker-1"]
    await a.remove_pods("default/j", [before["j-worker-1"]], replicas=2, decision_id=7)
    assert running(c, rtype) == {**before, "j-worker-1": spare}


async def test_remove_pods_lowers_the_count_only_across_named_pods(
    world: tuple[Cluster, KubernetesActuator],
) -> None:
    c, a = world
    c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 4))
    await eventually(lambda: len(running(c, PADDLE_OPERATOR)) == 4, 15, what="4 pods running")
    before = running(c, PADDLE_OPERATOR)
    # Pods 3 and 1 named: 3 goes with the count, 1 by its deletion (then a spare);
    # 2 is no named pod, so it stays although the count asked is 2: it may be a member
    # while the spare at 1 is not.
    await a.remove_pods("default/j", ["j-worker-3", "j-worker-1"], replicas=2, decision_id=8)
    assert await a.get_replicas("default/j") == 3
    now = uids(c, PADDLE_OPERATOR)
    assert {n: now[n] for n in ("j-worker-0", "j-worker-2")} == {
        n: before[n] for n in ("j-worker-0", "j-worker-2")
    }
    assert before["j-worker-1"] not in now.values() and "j-worker-3" not in now
    # Pod 2's node goes next, with the spare at 1: only pod 2 goes.
    await a.remove_pods("default/j", ["j-worker-2"], replicas=1, decision_id=9)
    assert await a.get_replicas("default/j") == 2
    assert uids(c, PADDLE_OPERATOR)["j-worker-0"] == before["j-worker-0"]


def uids(c: Cluster, rtype: Any) -> dict[str, str]:
    """The job's pods not terminating, by name: their uids."""
    job = c.api.get(rtype, "default", "j")
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in job_pods(c.api, "default", job["metadata"]["uid"])
        if not p["metadata"].get("deletionTimestamp")
    }


def running(c: Cluster, rtype: Any) -> dict[str, str]:
    job = c.api.get(rtype, "default", "j")
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in job_pods(c.api, "default", job["metadata"]["uid"])
        if not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("phase") == "Running"
    }


async def test_the_paddlejob_is_fenced_by_the_owner_epoch(
    world: tuple[Cluster, KubernetesActuator], tmp_path: Path
) -> None:
    """Two scaler replicas' actuators, the old leader at epoch 1 and the new at 2, each
    sure it leads (its own clock has not told it otherwise). The epoch each writes on
    the PaddleJob refuses the old one's change, also when its read came before the new
    leader's write (the 409 and the re-read compare again), and it never goes back."""
    c, new = world
    old = KubernetesActuator(
        KubernetesActuatorSettings(source=str(c.kubeconfig), pod_wait_s=30, watch_timeout_s=5)
    )
    old.start()
    try:
        c.api.create(PADDLE_OPERATOR, paddle_operator_job("j", 1))

        def stored() -> tuple[int, str]:
            obj = c.api.get(PADDLE_OPERATOR, "default", "j")
            return obj["spec"]["worker"]["replicas"], obj["metadata"]["annotations"][OWNER_EPOCH]

        with acting_while(lambda: True, epoch=1):
            await old.set_replicas("default/j", 2, decision_id=1)
        assert stored() == (2, "1")
        with acting_while(lambda: True, epoch=2):
            await new.set_replicas("default/j", 3, decision_id=2)
        assert stored() == (3, "2")

        # The old leader wakes and acts on what it decided before the takeover.
        with acting_while(lambda: True, epoch=1), pytest.raises(StaleEpoch, match="epoch 2") as err:
            await old.set_replicas("default/j", 1, decision_id=1)
        assert stored() == (3, "2")
        # The way out after a store reset, which the epochs alone cannot tell apart.
        assert (
            f"kubectl annotate paddlejobs.batch.paddlepaddle.org j -n default {OWNER_EPOCH}-"
            in str(err.value)
        )

        # Its read came first, the new leader's write between it and the patch: the
        # patch is a 409, and the re-read finds the newer epoch.
        def new_leader_wrote(obj: dict[str, Any]) -> dict[str, Any]:
            obj["spec"]["worker"]["replicas"] = 2
            obj["metadata"]["annotations"][OWNER_EPOCH] = "3"
            return obj

        c.api.conflict_next("paddlejobs", change=new_leader_wrote)
        before = new.conflicts_retried
        with acting_while(lambda: True, epoch=2), pytest.raises(StaleEpoch, match="epoch 3"):
            await new.set_replicas("default/j", 1, decision_id=3)
        assert new.conflicts_retried == before + 1
        assert stored() == (2, "3")

        # A leader at the stored epoch writes, and leaves the epoch as it is.
        with acting_while(lambda: True, epoch=3):
            await new.set_replicas("default/j", 1, decision_id=4)
        assert stored() == (1, "3")
    finally:
        old.stop()
