"""A preemption rig: the real coordinator, a scaler core in this process (SQLite store,
the coordinator's gRPC client, the local actuator starting real launchers), and node
notices delivered as an agent's report would be. Shared by tests/e2e/test_preemption.py
and bench/preemption.py.

``kube_preempt_rig``: the same with the Kubernetes actuator, a PaddleJob on the API
server emulator, paddle-operator's stand-in and a kubelet running each pod's launcher
(tide/services/testing/kube)."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tide.base.timeconv import ts_from_seconds
from tide.services.common.clock import SystemClock
from tide.services.scaler.actuators.base import Actuator
from tide.services.scaler.actuators.kubernetes import KubernetesActuator, KubernetesActuatorSettings
from tide.services.scaler.actuators.local import JobSpec, LocalActuator, LocalActuatorSettings
from tide.services.scaler.coordination import GrpcCoordinatorClient
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.kube.apiserver import KubeApiServer
from tide.services.testing.kube.crds import PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import start_operators
from tide.services.testing.localjob import EXAMPLE, ROOT, LocalJob
from tide.v1 import common_pb2, telemetry_pb2


@dataclass
class PreemptRig:
    job: LocalJob
    core: ScalerCore
    actuator: LocalActuator
    store: DecisionStore


@asynccontextmanager
async def preempt_rig(
    workdir: Path,
    train_args: Sequence[str],
    job_id: str = "ns/e2e",
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[PreemptRig]:
    """``env``: the pods' environment beyond the local actuator's (TIDE_LEAVE_GRACE_S)."""
    # A generous heartbeat timeout: a starved coordinator on 2 shared cores must not
    # declare members lost (tests/e2e/test_elastic.py).
    job = LocalJob(workdir / "job", train_args, job_id=job_id, heartbeat_timeout_s=10.0)
    job.start_coordinator()
    actuator = LocalActuator(
        LocalActuatorSettings(
            state_dir=workdir / "pods", coordinator=f"127.0.0.1:{job.port}", stop_grace_s=15.0
        )
    )
    command = (sys.executable, EXAMPLE, "--ckpt-dir", str(job.ckpt_dir))
    actuator.write_spec(
        job_id,
        JobSpec(
            command=(*command, "--log-dir", str(job.log_dir), *train_args), env=dict(env or {})
        ),
    )
    try:
        async with _scaler(workdir, job, actuator) as (core, store):
            yield PreemptRig(job, core, actuator, store)
    finally:
        await actuator.stop_all()
        await job.close()


@dataclass
class KubePreemptRig:
    job: LocalJob
    core: ScalerCore
    actuator: KubernetesActuator
    store: DecisionStore
    api: KubeApiServer
    kubelet: KubeletStandIn


#: The PaddleJob of ``kube_preempt_rig``: its pods are NAME-worker-INDEX.
KUBE_NS, KUBE_NAME = "default", "e2e"


@asynccontextmanager
async def kube_preempt_rig(
    workdir: Path, train_args: Sequence[str], replicas: int, gpus: int
) -> AsyncIterator[KubePreemptRig]:
    """A paddle-operator PaddleJob of ``replicas`` workers on one emulated node of ``gpus``
    GPUs; the scaler's actuator is the Kubernetes one, through the official client."""
    job_id = f"{KUBE_NS}/{KUBE_NAME}"
    job = LocalJob(workdir / "job", train_args, job_id=job_id, heartbeat_timeout_s=10.0)
    job.start_coordinator()
    api = KubeApiServer()
    api.start()
    install_paddlejob_crds(api, PADDLE_OPERATOR)
    ops = start_operators(api)
    kubelet = KubeletStandIn(
        api,
        "gpu-node-1",
        workdir / "kubelet",
        gpus=gpus,
        images={"tide-trainer": [sys.executable, "-m", "tide.trainer.launch"]},
        cwd=ROOT,
    ).start()
    kubeconfig = api.write_kubeconfig(workdir / "kubeconfig")
    actuator = KubernetesActuator(
        KubernetesActuatorSettings(source=str(kubeconfig), pod_wait_s=60, watch_timeout_s=10)
    )
    actuator.start()
    api.create(PADDLE_OPERATOR, _paddlejob(job, replicas), KUBE_NS)
    try:
        async with _scaler(workdir, job, actuator) as (core, store):
            yield KubePreemptRig(job, core, actuator, store, api, kubelet)
    finally:
        actuator.stop()
        kubelet.stop()  # kills whatever pods it still runs
        for op in ops:
            op.stop()
        api.close()
        await job.close()


def _paddlejob(job: LocalJob, replicas: int) -> dict[str, Any]:
    train = [
        sys.executable, EXAMPLE, "--ckpt-dir", str(job.ckpt_dir.resolve()),
        "--log-dir", str(job.log_dir.resolve()), *job.train_args,
    ]  # fmt: skip
    field_env = {
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_UID": "metadata.uid",
    }
    container = {
        "name": "worker",
        "image": "tide-trainer",
        "args": ["--", *train],
        "env": [
            {"name": "TIDE_COORDINATOR", "value": f"127.0.0.1:{job.port}"},
            *(
                {"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}}
                for k, v in field_env.items()
            ),
        ],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    return {
        "metadata": {"name": KUBE_NAME, "annotations": {"tide.dev/autoscale": "true"}},
        "spec": {
            "worker": {
                "replicas": replicas,
                "requests": 1,
                "limits": replicas + 1,
                "template": {"spec": {"containers": [container]}},
            }
        },
    }


@asynccontextmanager
async def _scaler(
    workdir: Path, job: LocalJob, actuator: Actuator
) -> AsyncIterator[tuple[ScalerCore, DecisionStore]]:
    url = f"sqlite:///{workdir / 'scaler.db'}"
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
        yield core, store
    finally:
        await core.close()
        await channel.close()
        store.engine.dispose()


def notice(
    core: ScalerCore, node: str, pods: Sequence[str], deadline_in_s: float, namespace: str = "ns"
) -> None:
    """What an agent reports when its node gets a spot interruption notice: the node's
    GPUs, held by ``pods``, and the termination event with its deadline."""
    now = time.time()
    r = telemetry_pb2.NodeReport(node_name=node, boot_id="b1", seq=1, gpu_capacity=len(pods))
    at = ts_from_seconds(now)
    deadline = ts_from_seconds(now + deadline_in_s)
    assert at is not None and deadline is not None
    r.sampled_at.CopyFrom(at)
    for i, pod in enumerate(pods):
        g = r.gpus.add(index=i, uuid=f"GPU-{node}-{i}", utilization_pct=60.0)
        g.pod.CopyFrom(common_pb2.PodRef(namespace=namespace, name=pod))
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    ev.deadline.CopyFrom(deadline)
    st = core.ingest.open_stream()
    core.ingest.process(st, r)
    core.ingest.close_stream(st)
