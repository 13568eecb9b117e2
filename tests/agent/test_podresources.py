"""Pod attribution against a PodResourcesLister server on a real unix socket."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.poll import eventually
from tide.base.errors import Unavailable
from tide.services.agent.attribution import PodResourcesClient
from tide.services.agent.model import PodOwner
from tide.services.agent.nvml import NvmlSource
from tide.services.agent.podresources import api_pb2, api_pb2_grpc

from .fake_nvml import FakeGpu, FakeNvml
from .support import RunAgent, Scaler, agent_settings

pytestmark = pytest.mark.component


def _pod(name: str, namespace: str, *containers: tuple[str, str, list[str]]) -> Any:
    return api_pb2.PodResources(
        name=name,
        namespace=namespace,
        containers=[
            api_pb2.ContainerResources(
                name=c,
                devices=[api_pb2.ContainerDevices(resource_name=res, device_ids=ids)]
                if ids
                else [],
            )
            for c, res, ids in containers
        ],
    )


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.pods: list[Any] = []
        self.calls = 0

    async def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
async def kubelet() -> AsyncIterator[tuple[Kubelet, str]]:
    # A short path: unix socket paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="podres-") as tmp:
        path = os.path.join(tmp, "kubelet.sock")
        servicer = Kubelet()
        server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        yield servicer, path
        await server.stop(None)


GPU = "nvidia.com/gpu"


async def test_gpus_map_to_the_right_pods(kubelet: tuple[Kubelet, str]) -> None:
    servicer, path = kubelet
    servicer.pods = [
        _pod("trainer-0", "ml", ("worker", GPU, ["GPU-0", "GPU-1"]), ("sidecar", "", [])),
        _pod("trainer-1", "ml", ("worker", GPU, ["GPU-2::0", "GPU-2::1"])),
        _pod("web", "default", ("nginx", "", [])),  # a pod without GPUs
        _pod("nic-user", "net", ("app", "example.com/sriov", ["0000:3b:00.1"])),
    ]
    client = PodResourcesClient(path, GPU, timeout_s=2.0)
    try:
        owners = await client.gpu_owners()
    finally:
        await client.close()
    assert owners == {
        "GPU-0": PodOwner("ml", "trainer-0", "worker"),
        "GPU-1": PodOwner("ml", "trainer-0", "worker"),
        "GPU-2": PodOwner("ml", "trainer-1", "worker"),
    }


async def test_missing_socket_is_unavailable(tmp_path: Path) -> None:
    client = PodResourcesClient(str(tmp_path / "nope.sock"), GPU, timeout_s=0.5)
    try:
        with pytest.raises(Unavailable, match="kubelet PodResources"):
            await client.gpu_owners()
    finally:
        await client.close()


async def test_agent_reports_carry_pod_owners(
    kubelet: tuple[Kubelet, str], scaler: Scaler, run_agent: RunAgent
) -> None:
    servicer, path = kubelet
    servicer.pods = [
        _pod("trainer-0", "ml", ("worker", GPU, ["GPU-a"])),
        _pod("idle", "ml", ("main", "", [])),
    ]
    nv = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])  # GPU-b is held by nobody
    settings = agent_settings(scaler.port, pod_resources_socket=path, pod_resources_refresh_s=0.1)
    client = PodResourcesClient(path, GPU, timeout_s=2.0)
    r = await run_agent(settings, NvmlSource(nv), pod_resources=client)

    def attributed() -> Any:
        for report in scaler.recorder.received:
            if report.gpus and report.gpus[0].pod.name:
                return report
        return None

    report = await eventually(attributed, what="an attributed report")
    a, b = report.gpus
    assert (a.uuid, a.pod.namespace, a.pod.name) == ("GPU-a", "ml", "trainer-0")
    assert b.uuid == "GPU-b" and not b.HasField("pod")

    # The pod leaves: the GPU is reported without an owner.
    servicer.pods = []
    seen = len(scaler.recorder.received)
    await eventually(
        lambda: any(not rep.gpus[0].HasField("pod") for rep in scaler.recorder.received[seen:]),
        what="owner cleared",
    )
    await r.shutdown()
