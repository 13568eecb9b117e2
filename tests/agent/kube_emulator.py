"""The agent's view of the shared API server emulator (tide/services/testing/kube): one
Node, changed the way the node watch tests need (cordon, taints, deletion), with
the emulator's resourceVersion, 410 and hung-watch faults."""

from __future__ import annotations

from typing import Any

from tide.services.testing.kube import KubeApiServer


class NodeApi:
    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.server = KubeApiServer()
        self.nodes = self.server.rtype("", "v1", "nodes")
        self.server.create(self.nodes, {"metadata": {"name": node_name}, "spec": {}})

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def lists(self) -> int:
        return self.server.stats.lists

    @property
    def watches(self) -> int:
        return self.server.stats.watches

    @property
    def blackhole(self) -> bool:
        return self.server.blackhole

    @blackhole.setter
    def blackhole(self, hang: bool) -> None:
        self.server.hang_watches(hang)

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()

    def update_spec(self, **spec: Any) -> None:
        """Replace spec fields, e.g. unschedulable=True, taints=[...]."""

        def change(node: dict[str, Any]) -> dict[str, Any]:
            node["spec"] = {**node.get("spec", {}), **spec}
            return node

        self.server.update(self.nodes, "", self.node_name, change)

    def delete(self) -> None:
        self.server.delete(self.nodes, "", self.node_name)

    def compact(self) -> None:
        self.server.compact()

    def drop_watches(self) -> None:
        self.server.drop_watches()
