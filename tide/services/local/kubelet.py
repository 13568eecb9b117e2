"""A stand-in for the kubelet's PodResources API, so real node agents attribute local GPUs.

In a cluster the agent asks the kubelet (a unix socket) which pod holds each
GPU. `tide up` has no kubelet: it serves the same API on
``STATE_DIR/kubelet-<k>.sock`` for synthetic node k, answering from the local
actuator's pods (GPU i of node k is held by the (k·G + i)-th pod of all local
jobs, in job and index order). Device ids are GPU indexes, as with the NVIDIA
device plugin's ``--device-id-strategy=index``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from tide.services.agent.podresources import api_pb2, api_pb2_grpc

logger = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"

#: GPU index on the node → (namespace, pod name).
Owners = Callable[[], Mapping[int, tuple[str, str]]]


class LocalPodResources(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, owners: Owners) -> None:
        self.owners = owners

    async def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:
        by_pod: dict[tuple[str, str], list[str]] = {}
        for index, pod in sorted(self.owners().items()):
            by_pod.setdefault(pod, []).append(str(index))
        resp = api_pb2.ListPodResourcesResponse()
        for (namespace, name), devices in by_pod.items():
            entry = resp.pod_resources.add(name=name, namespace=namespace)
            container = entry.containers.add(name="trainer")
            container.devices.add(resource_name=GPU_RESOURCE, device_ids=devices)
        return resp


async def serve_pod_resources(socket_path: Path, owners: Owners) -> grpc.aio.Server:
    """Serve the API on ``socket_path`` (replacing a stale socket file); stop() the result."""
    # A socket file left by a killed `tide up` would make the bind fail.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(LocalPodResources(owners), server)
    if server.add_insecure_port(f"unix://{socket_path}") == 0:
        raise OSError(f"cannot listen on {socket_path}")
    await server.start()
    logger.info("pod resources for local pods served on %s", socket_path)
    return server
