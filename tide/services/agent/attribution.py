"""Which pod holds which GPU, from the kubelet PodResources v1 API (unix socket)."""

from __future__ import annotations

import logging

import grpc

from tide.base.errors import Unavailable

from .model import GpuReading, PodOwner
from .podresources import api_pb2, api_pb2_grpc

logger = logging.getLogger(__name__)


def device_key(device_id: str) -> str:
    """The NVIDIA device plugin names a GPU by UUID, or ``UUID::N`` for the N-th
    time-sliced replica of a shared GPU; all replicas belong to the one GPU."""
    return device_id.split("::", 1)[0]


def owners_from_response(
    response: api_pb2.ListPodResourcesResponse, resource_name: str
) -> dict[str, PodOwner]:
    """Device id (UUID, or index with --device-id-strategy=index) → its pod."""
    owners: dict[str, PodOwner] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name != resource_name:
                    continue
                for device_id in devices.device_ids:
                    owners[device_key(device_id)] = PodOwner(
                        namespace=pod.namespace, name=pod.name, container=container.name
                    )
    return owners


def owner_of(owners: dict[str, PodOwner], reading: GpuReading) -> PodOwner | None:
    return owners.get(reading.uuid) or owners.get(str(reading.index))


class PodResourcesClient:
    """A client of the kubelet's PodResourcesLister. One channel, reused."""

    def __init__(
        self, socket_path: str, resource_name: str = "nvidia.com/gpu", timeout_s: float = 5.0
    ) -> None:
        self.socket_path = socket_path
        self.resource_name = resource_name
        self._timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(f"unix://{socket_path}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)

    async def gpu_owners(self) -> dict[str, PodOwner]:
        try:
            response = await self._stub.List(
                api_pb2.ListPodResourcesRequest(), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(
                f"kubelet PodResources at {self.socket_path}: {exc.code().name}: {exc.details()}"
            ) from None
        return owners_from_response(response, self.resource_name)

    async def close(self) -> None:
        await self._channel.close()
