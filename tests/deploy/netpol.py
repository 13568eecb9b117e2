"""What a set of NetworkPolicies admits, by the rules of networking.k8s.io/v1, for the
chart's tests: a connection from one endpoint to a port of another is allowed when
the destination's ingress and the source's egress both admit it.

- A pod no policy of a direction selects is open in that direction.
- Selected pods accept only what some rule of some selecting policy admits.
- A peer with a podSelector alone means pods of the policy's own namespace; with a
  namespaceSelector, pods of the namespaces it selects; an ipBlock, addresses.
- A rule without ports admits every port; a named port is resolved against the
  destination pod's container ports.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.support.chart import Rendered, selects


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace, labels, named container ports) or an address outside the cluster."""

    name: str
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)
    ip: str = ""

    @property
    def is_pod(self) -> bool:
        return not self.ip

    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def pods_of(rendered: Rendered, namespace: str) -> dict[str, Endpoint]:
    """Every workload's pod, by workload name."""
    pods = {}
    for w in rendered.workloads():
        template = w["spec"]["template"]
        ports = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
        }
        name = w["metadata"]["name"]
        pods[name] = Endpoint(name, namespace, template["metadata"]["labels"], ports)
    return pods


def _peer_matches(peer: Mapping[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.is_pod:
            return False
        block = peer["ipBlock"]
        addr = ipaddress.ip_address(other.ip)
        inside = addr in ipaddress.ip_network(block["cidr"])
        return inside and not any(addr in ipaddress.ip_network(e) for e in block.get("except", []))
    if not other.is_pod:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.namespace_labels()):
            return False
    elif other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def _port_matches(
    rule_ports: Iterable[Mapping[str, Any]] | None, dest: Endpoint, port: int
) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None or want == port or (isinstance(want, str) and dest.ports.get(want) == port):
            return True
    return False


def _admits(
    policies: list[dict[str, Any]],
    direction: str,
    me: Endpoint,
    other: Endpoint,
    dest: Endpoint,
    port: int,
) -> bool:
    kind = "Ingress" if direction == "ingress" else "Egress"
    peers_key = "from" if direction == "ingress" else "to"
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == me.namespace
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], me.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(direction) or []:
            peers = rule.get(peers_key)
            peer_ok = not peers or any(
                _peer_matches(peer, policy["metadata"]["namespace"], other) for peer in peers
            )
            if peer_ok and _port_matches(rule.get("ports"), dest, port):
                return True
    return False


def allowed(policies: list[dict[str, Any]], src: Endpoint, dest: Endpoint, port_name: str) -> bool:
    """Whether ``src`` may open a TCP connection to ``dest``'s port ``port_name``."""
    port = dest.ports[port_name]
    ingress_ok = not dest.is_pod or _admits(policies, "ingress", dest, src, dest, port)
    egress_ok = not src.is_pod or _admits(policies, "egress", src, dest, dest, port)
    return ingress_ok and egress_ok
