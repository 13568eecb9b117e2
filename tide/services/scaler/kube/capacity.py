"""Free GPUs in the cluster, from a watch-backed cache of Nodes and Pods.

Free = allocatable ``nvidia.com/gpu`` of the schedulable, Ready nodes minus the
GPU requests of the pods bound to them that have not finished (every tenant's
pods count: they hold GPUs too). Pods waiting to be scheduled are not
subtracted: they are waiting for exactly this capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kubernetes import client

from tide.services.scaler.kube.client import Reflector
from tide.services.scaler.kube.paddlejob import GPU, spec_gpus

Obj = Mapping[str, Any]


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def node_gpus(node: Obj) -> int:
    """Allocatable GPUs of a node that takes new pods; 0 for a cordoned or unready one."""
    if node.get("spec", {}).get("unschedulable"):
        return 0
    conditions = node.get("status", {}).get("conditions") or []
    if any(c.get("type") == "Ready" and c.get("status") != "True" for c in conditions):
        return 0
    return _int((node.get("status", {}).get("allocatable") or {}).get(GPU))


def pod_gpus(pod: Obj) -> int:
    """GPUs a pod holds: :func:`spec_gpus` of its spec."""
    return spec_gpus(pod.get("spec", {}))


def free_gpus(nodes: Iterable[Obj], pods: Iterable[Obj]) -> int:
    """Allocatable GPUs of schedulable nodes minus the requests of the live pods on them."""
    alloc = {n.get("metadata", {}).get("name"): node_gpus(n) for n in nodes}
    used = 0
    for p in pods:
        node = p.get("spec", {}).get("nodeName")
        # Only nodes that offer GPUs count: a cordoned node's pods free nothing for us.
        if alloc.get(node) and p.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            used += pod_gpus(p)
    return max(0, sum(alloc.values()) - used)


class CapacityCache:
    """Nodes and pods of the whole cluster, kept by two reflectors."""

    def __init__(
        self,
        api: client.ApiClient,
        on_change: Callable[[], None] | None = None,
        watch_timeout_s: int = 60,
    ) -> None:
        core = client.CoreV1Api(api)
        self.nodes = Reflector(
            "nodes", core.list_node, on_change=on_change, watch_timeout_s=watch_timeout_s
        )
        self.pods = Reflector(
            "pods",
            core.list_pod_for_all_namespaces,
            on_change=on_change,
            watch_timeout_s=watch_timeout_s,
        )

    def start(self) -> CapacityCache:
        self.nodes.start()
        self.pods.start()
        return self

    def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()

    def free_gpus(self) -> int | None:
        """None until both caches have listed once."""
        if not (self.nodes.synced.is_set() and self.pods.synced.is_set()):
            return None
        return free_gpus(self.nodes.objects(), self.pods.objects())
