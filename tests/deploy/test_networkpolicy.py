"""The chart's NetworkPolicies admit the flows Tide has and nothing else: their
selectors match the rendered pods' labels, their named ports exist, and, evaluated
by the rules of networking.k8s.io/v1 (tests/deploy/netpol.py), each flow is allowed
or denied as it should be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.netpol import Endpoint, allowed, pods_of
from tests.support.chart import EXAMPLES, NAMESPACE, PRODUCTION, SMALL, render, selects

pytestmark = pytest.mark.component

PADDLE_OPERATOR_WORKER = {"paddle-res-name": "job-worker-0", "paddle-res-type": "worker"}
KUBEFLOW_WORKER = {
    "training.kubeflow.org/job-name": "job",
    "training.kubeflow.org/operator-name": "paddlejob-controller",
    "training.kubeflow.org/replica-type": "worker",
}
PROMETHEUS = Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
POSTGRES = Endpoint(
    "postgres", "db", {"app.kubernetes.io/name": "postgresql"}, {"pg": 5432, "other": 5433}
)
API_SERVER = Endpoint("apiserver", ip="10.0.0.1", ports={"https": 443})
INTERNET = Endpoint("internet", ip="8.8.8.8", ports={"https": 443})
KUBE_DNS = Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53})


def trainer(namespace: str, labels: dict[str, str]) -> Endpoint:
    return Endpoint(f"trainer@{namespace}", namespace, labels)


def policies(values: Path) -> list[dict[str, Any]]:
    return render(values).all("NetworkPolicy")


def test_the_flows_of_a_small_install() -> None:
    nps = policies(SMALL)
    pods = pods_of(render(SMALL), NAMESPACE)
    scaler, coordinator, agent = pods["tide-scaler"], pods["tide-coordinator"], pods["tide-agent"]
    stranger = Endpoint("stranger", "ml", {"app": "notebook"})
    neighbour = Endpoint("neighbour", NAMESPACE, {"app": "other"})

    assert allowed(nps, agent, scaler, "grpc")
    assert allowed(nps, scaler, coordinator, "grpc")
    # values-small watches ml-research: its trainers reach the coordinator.
    for labels in (PADDLE_OPERATOR_WORKER, KUBEFLOW_WORKER):
        assert allowed(nps, trainer("ml-research", labels), coordinator, "grpc")
        assert not allowed(nps, trainer("ml-research", labels), scaler, "grpc")
    for target in (scaler, coordinator, agent):
        assert allowed(nps, PROMETHEUS, target, "metrics")
        assert not allowed(nps, stranger, target, "metrics")
    for source in (stranger, neighbour, PROMETHEUS, coordinator):
        assert not allowed(nps, source, scaler, "grpc")
    for source in (stranger, neighbour, PROMETHEUS, agent):
        assert not allowed(nps, source, coordinator, "grpc")
    assert not allowed(nps, stranger, agent, "health")
    # Egress is not limited in this install.
    assert allowed(nps, scaler, INTERNET, "https")


def test_the_flows_of_a_production_install() -> None:
    nps = policies(PRODUCTION)
    rendered = render(PRODUCTION)
    pods = pods_of(rendered, NAMESPACE)
    scaler, coordinator, agent = pods["tide-scaler"], pods["tide-coordinator"], pods["tide-agent"]
    migrate = pods["tide-migrate"]

    # apiClients: the CLI from sre-tools, no one else.
    assert allowed(nps, Endpoint("cli", "sre-tools"), scaler, "grpc")
    assert not allowed(nps, Endpoint("cli", "default"), scaler, "grpc")
    # Trainers of the watched namespaces only.
    assert allowed(nps, trainer("ml-prod", KUBEFLOW_WORKER), coordinator, "grpc")
    assert not allowed(nps, trainer("ml-scratch", KUBEFLOW_WORKER), coordinator, "grpc")
    # Egress: each pod's own ways out, both ends of every in-cluster flow agreeing.
    assert allowed(nps, agent, scaler, "grpc")
    assert allowed(nps, scaler, coordinator, "grpc")
    for pod in (scaler, agent):
        assert allowed(nps, pod, API_SERVER, "https")
    for pod in (coordinator, migrate):
        assert not allowed(nps, pod, API_SERVER, "https")
    for pod in (scaler, coordinator, migrate):
        assert allowed(nps, pod, POSTGRES, "pg")
        assert not allowed(nps, pod, POSTGRES, "other")
    assert not allowed(nps, agent, POSTGRES, "pg")
    for pod in (scaler, coordinator, agent, migrate):
        assert allowed(nps, pod, KUBE_DNS, "dns")
        assert not allowed(nps, pod, INTERNET, "https")
    assert not allowed(nps, coordinator, scaler, "grpc")
    assert not allowed(nps, agent, coordinator, "grpc")


def test_sharded_scaler_replicas_reach_each_other() -> None:
    """scaler.shards > 0: replicas ship partials to each other's gRPC port (egress is
    enforced in the production values); without shards, no scaler reaches another."""
    for shards, admitted in (("8", True), ("0", False)):
        sets = {"scaler.replicas": "3", "scaler.shards": shards}
        rendered = render(PRODUCTION, sets=sets)
        scaler = pods_of(rendered, NAMESPACE)["tide-scaler"]
        nps = rendered.all("NetworkPolicy")
        assert allowed(nps, scaler, scaler, "grpc") is admitted
        assert not allowed(nps, Endpoint("cli", "default"), scaler, "grpc")


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_selectors_match_the_pods_and_named_ports_exist(values: Path) -> None:
    rendered = render(values)
    pods = list(pods_of(rendered, NAMESPACE).values())
    for np in rendered.all("NetworkPolicy"):
        name = np["metadata"]["name"]
        selected = [p for p in pods if selects(np["spec"]["podSelector"], p.labels)]
        assert selected, f"{name} selects no pod of the release"
        for rule in np["spec"].get("ingress") or []:
            # An empty peer list would admit everyone.
            assert rule.get("from"), name
            for port in rule.get("ports", []):
                if isinstance(port["port"], str):
                    assert all(port["port"] in p.ports for p in selected), (name, port)
            for peer in rule["from"]:
                if set(peer) == {"podSelector"}:  # a pod of this release
                    assert any(selects(peer["podSelector"], p.labels) for p in pods), (name, peer)
        for rule in np["spec"].get("egress") or []:
            assert rule.get("to"), name
            for peer in rule["to"]:
                if set(peer) != {"podSelector"}:
                    continue
                targets = [p for p in pods if selects(peer["podSelector"], p.labels)]
                assert targets, (name, peer)
                for port in rule.get("ports", []):
                    assert all(port["port"] in t.ports for t in targets), (name, port)


def test_every_pod_of_the_release_is_isolated() -> None:
    """The default-deny policy selects every pod, so nothing unlisted gets through."""
    rendered = render(PRODUCTION)
    deny = rendered.one("NetworkPolicy", "tide-default-deny")
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    for pod in pods_of(rendered, NAMESPACE).values():
        assert selects(deny["spec"]["podSelector"], pod.labels), pod.name
    assert render(SMALL, sets={"networkPolicy.enabled": "false"}).all("NetworkPolicy") == []
