"""One contract for tide.services.scaler.actuators.Actuator, run over the in-memory and
file doubles (tide.services.testing.actuators) and the real local actuator (launcher
processes; tests/local/fake_launcher.py stands in for tide.trainer.launch) and the
Kubernetes actuator on PaddleJobs (the API server emulator, both operators and a
kubelet of tide.services.testing.kube, running a sleeping process per pod)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from tests.support.procs import ROOT
from tide.base.errors import InvalidArgument
from tide.services.scaler.actuators import Actuator, PodRemover, acting_while, remove_pods
from tide.services.scaler.actuators.kubernetes import KubernetesActuator, KubernetesActuatorSettings
from tide.services.scaler.actuators.local import JobSpec, LocalActuator, LocalActuatorSettings
from tide.services.scaler.errors import StaleEpoch
from tide.services.testing.actuators import FileActuator, InMemoryActuator, read_changes
from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import job_pods, start_operators

pytestmark = pytest.mark.component

JOB = "ml/contract"
FAKE_LAUNCHER = str(ROOT / "tests" / "local" / "fake_launcher.py")


class World(Protocol):
    actuator: Actuator

    def define(self, job_id: str, gpus_per_replica: int) -> None:
        """The job exists for this actuator (a PaddleJob, a local spec file)."""

    def running(self, job_id: str) -> int:
        """Pods of the job that run now, as the actuator's world sees them."""


class MemoryWorld:
    def __init__(self, actuator: InMemoryActuator) -> None:
        self.actuator: Actuator = actuator
        self.mem = actuator

    def define(self, job_id: str, gpus_per_replica: int) -> None:
        self.mem.gpus_per_replica[job_id] = gpus_per_replica

    def running(self, job_id: str) -> int:
        return self.mem.replicas.get(job_id, 0)


class LocalWorld:
    def __init__(self, actuator: LocalActuator) -> None:
        self.actuator: Actuator = actuator
        self.local = actuator

    def define(self, job_id: str, gpus_per_replica: int) -> None:
        self.local.write_spec(
            job_id, JobSpec(command=("train",), gpus_per_replica=gpus_per_replica)
        )

    def running(self, job_id: str) -> int:
        return len(self.local.pods(job_id))


class KubeWorld:
    """PaddleJobs on the emulator; pods are what the operator stand-in made of them."""

    def __init__(self, api: KubeApiServer, actuator: KubernetesActuator) -> None:
        self.api = api
        self.kube = actuator
        self.actuator: Actuator = actuator

    def define(self, job_id: str, gpus_per_replica: int) -> None:
        ns, name = job_id.split("/")
        namespaces = self.api.rtype("", "v1", "namespaces")
        if not self.api.list(namespaces, fields=f"metadata.name={ns}")[0]:
            self.api.create(namespaces, {"metadata": {"name": ns}})
        container = {
            "name": "worker",
            "image": "trainer",
            "command": [sys.executable, "-c", "import time; time.sleep(600)"],
            "resources": {"limits": {"nvidia.com/gpu": gpus_per_replica}},
        }
        self.api.create(
            PADDLE_OPERATOR,
            {
                "metadata": {"name": name, "annotations": {"tide.dev/autoscale": "true"}},
                "spec": {
                    "worker": {
                        "replicas": 0,
                        "requests": 1,
                        "limits": 8,
                        "template": {"spec": {"containers": [container]}},
                    }
                },
            },
            ns,
        )

    def running(self, job_id: str) -> int:
        ns, name = job_id.split("/")
        uid = self.api.get(PADDLE_OPERATOR, ns, name)["metadata"]["uid"]
        return sum(
            1 for p in job_pods(self.api, ns, uid) if not p["metadata"].get("deletionTimestamp")
        )


@pytest.fixture(params=["memory", "file", "local", "kubernetes"])
def world(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[World]:
    if request.param == "memory":
        yield MemoryWorld(InMemoryActuator(total_gpus=8))
        return
    if request.param == "file":
        yield MemoryWorld(FileActuator(tmp_path / "changes.jsonl", total_gpus=8))
        return
    if request.param == "kubernetes":
        with KubeApiServer() as api:
            install_paddlejob_crds(api)
            ops = start_operators(api)
            kubelet = KubeletStandIn(api, "gpu-node", tmp_path / "kubelet", gpus=8).start()
            kube = KubernetesActuator(
                KubernetesActuatorSettings(
                    source=str(api.write_kubeconfig(tmp_path / "kubeconfig")), pod_wait_s=30
                )
            )
            try:
                yield KubeWorld(api, kube)
            finally:
                kube.stop()
                for op in ops:
                    op.stop()
                kubelet.stop()
        return
    log = tmp_path / "launches.log"
    log.touch()
    monkeypatch.setenv("FAKE_LAUNCHER_LOG", str(log))
    settings = LocalActuatorSettings(
        state_dir=tmp_path / "state",
        coordinator="127.0.0.1:1",
        launcher=(sys.executable, FAKE_LAUNCHER),
        total_gpus=8,
        stop_grace_s=5.0,
    )
    local = LocalActuator(settings)
    try:
        yield LocalWorld(local)
    finally:
        # Never leave a process behind, whatever the test did.
        for job in local.jobs():
            for pod in local.pods(job):
                os.killpg(pod.pid, signal.SIGKILL)
        for proc in local._children.values():
            proc.wait(10)


async def test_set_replicas_is_what_runs_and_is_idempotent(world: World) -> None:
    world.define(JOB, 1)
    a = world.actuator
    await a.set_replicas(JOB, 3, decision_id=1)
    assert await a.get_replicas(JOB) == 3 and world.running(JOB) == 3
    # Asking again for the count the job has changes nothing (a resumed decision).
    await a.set_replicas(JOB, 3, decision_id=1)
    assert await a.get_replicas(JOB) == 3 and world.running(JOB) == 3
    await a.set_replicas(JOB, 1, decision_id=2)
    assert await a.get_replicas(JOB) == 1 and world.running(JOB) == 1
    await a.set_replicas(JOB, 0, decision_id=3)
    assert await a.get_replicas(JOB) == 0 and world.running(JOB) == 0


async def test_remove_pods_lowers_to_the_count_asked(world: World) -> None:
    """Every actuator names the pods that go (PodRemover; which ones went is
    test_actuator_local's and test_actuator_kubernetes's); with no named pod among
    the job's, the highest go. The count is the contract."""
    world.define(JOB, 1)
    a = world.actuator
    assert isinstance(a, PodRemover)
    await a.set_replicas(JOB, 3, decision_id=1)
    await remove_pods(a, JOB, ["nobody"], replicas=2, decision_id=2)
    assert await a.get_replicas(JOB) == 2 and world.running(JOB) == 2
    await remove_pods(a, JOB, ["nobody"], replicas=2, decision_id=2)
    assert await a.get_replicas(JOB) == 2 and world.running(JOB) == 2


async def test_adopt_changes_no_pod(world: World) -> None:
    world.define(JOB, 1)
    a = world.actuator
    await a.set_replicas(JOB, 2, decision_id=1)
    # The scaler's record says 2 already; adopting the job, even with another count,
    # only informs: pods change through set_replicas alone.
    a.adopt(JOB, replicas=2, gpus_per_replica=1)
    a.adopt(JOB, replicas=5, gpus_per_replica=1)
    assert world.running(JOB) == 2 and await a.get_replicas(JOB) == 2


async def test_an_unknown_job_has_no_replicas(world: World) -> None:
    assert await world.actuator.get_replicas("ml/unknown") is None


async def test_negative_replicas_are_refused(world: World) -> None:
    world.define(JOB, 1)
    with pytest.raises(InvalidArgument):
        await world.actuator.set_replicas(JOB, -1, decision_id=1)
    assert world.running(JOB) == 0


async def test_free_gpus_count_the_replicas_asked_for(world: World) -> None:
    world.define(JOB, 2)
    world.actuator.adopt(JOB, replicas=0, gpus_per_replica=2)
    await world.actuator.set_replicas(JOB, 3, decision_id=1)
    assert await world.actuator.free_gpus() == 8 - 3 * 2


def test_the_file_double_survives_a_restart(tmp_path: Path) -> None:
    """What the crash tests rely on: a new FileActuator reads the state back."""
    path = tmp_path / "changes.jsonl"
    first = FileActuator(path)
    first.seed(JOB, 2)
    asyncio.run(first.set_replicas(JOB, 4, decision_id=9))
    again = FileActuator(path)
    assert again.replicas == {JOB: 4}
    assert [(c.old, c.new, c.decision_id) for c in read_changes(path) if c.old != c.new] == [
        (2, 4, 9)
    ]


async def test_a_replica_that_no_longer_leads_changes_nothing(world: World) -> None:
    """Asked by the controller of a replica whose lease ran out (a leader paused
    between its check and the actuator's write, or while it retried a lost race):
    StaleEpoch, and the pods stay as they are."""
    world.define(JOB, 1)
    a = world.actuator
    await a.set_replicas(JOB, 2, decision_id=1)
    with acting_while(lambda: False), pytest.raises(StaleEpoch):
        await a.set_replicas(JOB, 3, decision_id=2)
    with acting_while(lambda: False), pytest.raises(StaleEpoch):
        await remove_pods(a, JOB, [], replicas=1, decision_id=3)
    assert await a.get_replicas(JOB) == 2 and world.running(JOB) == 2
    # Still leading: it acts.
    with acting_while(lambda: True):
        await a.set_replicas(JOB, 3, decision_id=4)
    assert await a.get_replicas(JOB) == 3
