"""The chart extended as charts usually are (issue 32): global, commonLabels, podLabels,
extraEnv and volumes, image.digest, ServiceAccount annotations, spread constraints, per
component security contexts (the agent as root); and what a training namespace gets
without hand work: the CA copied by the scaler, its ServiceAccount a launcher, and the
CLI in the scaler's pod wired to the pod's own credentials."""

from __future__ import annotations

import pytest

from tests.deploy.test_chart import kube_schema_errors
from tests.support.chart import PRODUCTION, SMALL, render

pytestmark = pytest.mark.component

DIGEST = "sha256:" + "a" * 64
SETS = {
    "global.imageRegistry": "mirror.example.com",
    "commonLabels.team": "ml-platform",
    "serviceAccount.annotations.iam\\.gke\\.io/gcp-service-account": "tide@p.iam",
    "image.digest": DIGEST,
    "scaler.podLabels.tier": "control",
    "scaler.extraEnv[0].name": "HTTPS_PROXY",
    "scaler.extraEnv[0].value": "http://proxy:3128",
    "coordinator.extraVolumes[0].name": "extra",
    "coordinator.extraVolumes[0].emptyDir.medium": "Memory",
    "coordinator.extraVolumeMounts[0].name": "extra",
    "coordinator.extraVolumeMounts[0].mountPath": "/extra",
    "agent.topologySpreadConstraints[0].maxSkew": "1",
    "agent.topologySpreadConstraints[0].topologyKey": "zone",
    "agent.topologySpreadConstraints[0].whenUnsatisfiable": "ScheduleAnyway",
    "agent.podSecurityContext.runAsNonRoot": "false",
    "agent.podSecurityContext.runAsUser": "0",
    "agent.securityContext.runAsNonRoot": "false",
}


def test_the_usual_extension_points_reach_the_objects() -> None:
    r = render(PRODUCTION, sets=SETS)
    assert kube_schema_errors(r.objects, "1.35") == []
    assert all(o["metadata"]["labels"]["team"] == "ml-platform" for o in r.workloads())
    for sa in r.all("ServiceAccount"):
        assert sa["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "tide@p.iam"}
    scaler = r.pod("Deployment", "tide-scaler")
    (c,) = scaler["containers"]
    assert c["image"] == f"ghcr.io/tide-project/tide@{DIGEST}"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"]
    labels = r.one("Deployment", "tide-scaler")["spec"]["template"]["metadata"]["labels"]
    assert labels["tier"] == "control" and labels["team"] == "ml-platform"
    coord = r.pod("Deployment", "tide-coordinator")
    assert {"name": "extra", "emptyDir": {"medium": "Memory"}} in coord["volumes"]
    assert {"name": "extra", "mountPath": "/extra"} in coord["containers"][0]["volumeMounts"]
    agent = r.pod("DaemonSet", "tide-agent")
    assert agent["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    # Root only where asked, the rest of the posture kept.
    assert agent["securityContext"]["runAsUser"] == 0
    sc = agent["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert r.pod("Deployment", "tide-scaler")["securityContext"]["runAsUser"] == 65532


def test_a_training_namespace_needs_no_hand_work() -> None:
    r = render(SMALL)
    scaler = r.pod("Deployment", "tide-scaler")
    (c,) = scaler["containers"]
    assert "--trust-configmap=tide-ca" in c["args"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    # `kubectl exec deploy/tide-scaler -- tide ...`: the pod's own credentials.
    assert env["TIDE_SCALER"] == "127.0.0.1:50051"
    assert env["TIDE_TLS_SERVER_NAME"] == "tide-scaler"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/run/tide/ca", "/var/run/tide/token"} <= mounts
    assert env["TIDE_TLS_CA_FILE"].startswith("/var/run/tide/ca/")
    # The watched namespace's default ServiceAccount is a launcher there, and only there.
    (ids,) = [a for a in c["args"] if a.startswith("--token-identities=")]
    assert "ml-research/default=launcher" in ids.split("=", 1)[1].split(",")
    off = render(SMALL, sets={"security.tls.enabled": "false"})
    (c,) = off.pod("Deployment", "tide-scaler")["containers"]
    assert not any(a.startswith("--trust-configmap") for a in c["args"])
