"""Jobs found from the cluster, with the real scaler core (SQLite, the in-memory
coordinator) and the Kubernetes actuator on the emulator: opt-in, bounds and
overrides kept in step, refusal when another autoscaler targets the job, deletion,
and an HPA-style Event at each decision state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from tide.services.common.clock import SystemClock
from tide.services.scaler.actuators.kubernetes import KubernetesActuator, KubernetesActuatorSettings
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.kube.link import KubeLink
from tide.services.scaler.store import DecisionState, DecisionStore
from tide.services.store import db
from tide.services.testing.coordinator import InMemoryCoordinator

pytestmark = pytest.mark.integration  # pods are real processes

HPA = ("autoscaling", "v2", "horizontalpodautoscalers")


@dataclass
class Rig:
    c: Cluster
    core: ScalerCore
    link: KubeLink
    actuator: KubernetesActuator

    def events(self, name: str) -> list[tuple[str, str, str]]:
        items, _ = self.c.api.list(
            self.c.api.rtype("", "v1", "events"),
            "default",
            fields=f"involvedObject.name={name}",
        )
        items.sort(key=lambda e: int(e["metadata"]["resourceVersion"]))  # as posted
        return [(e["type"], e["reason"], e["message"]) for e in items]

    def reasons(self, name: str) -> list[str]:
        return [r for _, r, _ in self.events(name)]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    url = f"sqlite:///{tmp_path / 'scaler.db'}"
    await asyncio.to_thread(db.upgrade, url)
    engine = db.make_engine(url)
    clock = SystemClock()
    with cluster(tmp_path, gpus=8) as c:
        actuator = KubernetesActuator(
            KubernetesActuatorSettings(source=str(c.kubeconfig), pod_wait_s=20, watch_timeout_s=5)
        )
        core = ScalerCore(
            store=DecisionStore(engine, "test", clock),
            actuator=actuator,
            coordinator=InMemoryCoordinator(),
            clock=clock,
        )
        await core.start()
        link = KubeLink(actuator)
        (run,) = link.attach(core)
        task = asyncio.create_task(run())
        try:
            yield Rig(c, core, link, actuator)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await core.close()
            engine.dispose()


async def test_an_opted_in_paddlejob_becomes_a_job_and_follows_its_changes(rig: Rig) -> None:
    api = rig.c.api
    api.create(
        PADDLE_OPERATOR,
        paddle_operator_job(
            "a",
            2,
            lo=1,
            hi=4,
            annotations={"tide.dev/cooldown-s": "600", "tide.dev/sustain-s": "soon"},
        ),
    )
    not_in = paddle_operator_job("quiet", 1)
    not_in["metadata"]["annotations"] = {}
    api.create(PADDLE_OPERATOR, not_in)
    job = await eventually(lambda: rig.core.jobs.get("default/a"), 20, what="the job")
    assert (job.min_replicas, job.max_replicas) == (1, 4)
    assert "default/quiet" not in rig.core.jobs
    assert rig.core.policies["default/a"].cooldown_s == 600.0
    # The job started at the PaddleJob's replicas: its first generation formed by a decision.
    await eventually(lambda: rig.core.jobs["default/a"].current_replicas == 2, 20)
    await eventually(lambda: "SuccessfulRescale" in rig.reasons("a"), 20, what="an Event")
    reasons = rig.reasons("a")
    assert reasons.index("Adopted") < reasons.index("RescaleDecided")
    assert "InvalidPolicyAnnotation" in reasons
    warning = next(e for e in rig.events("a") if e[1] == "InvalidPolicyAnnotation")
    assert warning[0] == "Warning" and "tide.dev/sustain-s='soon'" in warning[2]
    assert [r for r in reasons if r.startswith("Rescale") or r == "SuccessfulRescale"] == [
        "RescaleDecided",
        "RescalePreparing",
        "RescaleActuating",
        "SuccessfulRescale",
    ]

    # Bounds and overrides change with the PaddleJob; a removed override is gone.
    def change(obj: dict[str, Any]) -> dict[str, Any]:
        obj["spec"]["worker"]["limits"] = 6
        del obj["metadata"]["annotations"]["tide.dev/cooldown-s"]
        return obj

    api.update(PADDLE_OPERATOR, "default", "a", change)
    await eventually(lambda: rig.core.jobs["default/a"].max_replicas == 6, 20)
    await eventually(lambda: rig.core.policies["default/a"].cooldown_s == 300.0, 20)

    # A resize through the scaler lands on the PaddleJob and says so on it.
    d = await rig.core.request_resize("default/a", 3, "test", "tester")
    await eventually(lambda: rig.core.jobs["default/a"].current_replicas == 3, 30)
    assert api.get(PADDLE_OPERATOR, "default", "a")["spec"]["worker"]["replicas"] == 3
    done = await eventually(
        lambda: [
            e for e in rig.events("a") if e[1] == "SuccessfulRescale" and "New size: 3" in e[2]
        ],
        20,
    )
    assert f"decision {d.id}, 2 -> 3" in done[0][2]

    # Deleted: the job is no longer autoscaled; its decisions stay.
    api.delete(PADDLE_OPERATOR, "default", "a")
    job = await eventually(
        lambda: rig.core.jobs["default/a"].autoscaling_paused and rig.core.jobs["default/a"], 20
    )
    assert "deleted" in job.pause_reason
    page = await rig.core.store.list_decisions(job_id="default/a")
    assert {x.state for x in page.decisions} == {DecisionState.COMPLETED}


async def test_a_job_the_coordinator_failed_gets_a_warning_event_once(rig: Rig) -> None:
    rig.c.api.create(PADDLE_OPERATOR, paddle_operator_job("f", 1, lo=1, hi=2))
    await eventually(lambda: rig.core.jobs.get("default/f"), 20, what="the job")
    # Its first generation formed (by a decision): the coordinator knows the job.
    await eventually(lambda: rig.core.jobs["default/f"].current_replicas == 1, 20)
    await eventually(lambda: "SuccessfulRescale" in rig.reasons("f"), 20, what="formed")
    coordinator = rig.core.coordinator
    assert isinstance(coordinator, InMemoryCoordinator)
    coordinator.fail("default/f", "restart budget spent: the worker was killed by SIGSEGV")
    await rig.core.tick()
    event = await eventually(
        lambda: [e for e in rig.events("f") if e[1] == "JobFailed"], 20, what="the Event"
    )
    assert event[0][0] == "Warning" and "killed by SIGSEGV" in event[0][2]
    await rig.core.tick()
    assert rig.reasons("f").count("JobFailed") == 1


async def test_a_job_another_autoscaler_targets_is_refused_until_it_goes(rig: Rig) -> None:
    api = rig.c.api
    hpa_t = api.rtype(*HPA)
    api.create(
        hpa_t,
        {
            "metadata": {"name": "h"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "batch.paddlepaddle.org/v1",
                    "kind": "PaddleJob",
                    "name": "a",
                },
                "maxReplicas": 4,
            },
        },
    )
    api.create(PADDLE_OPERATOR, paddle_operator_job("a", 2))
    job = await eventually(
        lambda: (j := rig.core.jobs.get("default/a")) is not None and j.autoscaling_paused and j, 20
    )
    assert "an HPA already targets this PaddleJob (h)" in job.pause_reason
    conflict = await eventually(
        lambda: [e for e in rig.events("a") if e[1] == "AutoscalerConflict"], 20
    )
    assert conflict[0][0] == "Warning"
    api.delete(hpa_t, "default", "h")
    await eventually(lambda: not rig.core.jobs["default/a"].autoscaling_paused, 20)

    api.create(KUBEFLOW, kubeflow_job("kf", 1, metrics=True))
    job = await eventually(
        lambda: (j := rig.core.jobs.get("default/kf")) is not None and j.autoscaling_paused and j,
        20,
    )
    assert "elasticPolicy.metrics" in job.pause_reason
