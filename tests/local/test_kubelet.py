"""The stand-in kubelet, read by the node agent's own PodResources client over a unix socket."""

from __future__ import annotations

from pathlib import Path

import pytest

from tide.services.agent.attribution import PodResourcesClient
from tide.services.local.kubelet import serve_pod_resources

pytestmark = pytest.mark.component


async def test_the_agent_client_sees_which_local_pod_holds_each_gpu(tmp_path: Path) -> None:
    owners = {0: ("ml", "a-trainer-0"), 1: ("ml", "a-trainer-0"), 3: ("nlp", "b-trainer-1")}
    sock = tmp_path / "kubelet.sock"
    sock.write_text("stale")  # left by a killed run: replaced, not an error
    server = await serve_pod_resources(sock, lambda: owners)
    client = PodResourcesClient(str(sock))
    try:
        got = await client.gpu_owners()
        assert {k: (o.namespace, o.name) for k, o in got.items()} == {
            "0": ("ml", "a-trainer-0"),
            "1": ("ml", "a-trainer-0"),
            "3": ("nlp", "b-trainer-1"),
        }
        owners.clear()  # the pods went away: the next answer says so
        assert await client.gpu_owners() == {}
    finally:
        await client.close()
        await server.stop(0)
