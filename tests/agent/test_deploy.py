"""deploy/agent: valid against the Kubernetes schemas, and in the device-plugin posture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "agent"
K8S_VERSION = "1.30"


def documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_valid_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    # strict: unknown fields (a typo like readOnlyRootFileSystem) are errors too.
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_catches_a_typo() -> None:
    ds = by_kind("DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = (
        True
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_daemonset_posture() -> None:
    pod = by_kind("DaemonSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc.get("privileged") is False
    # Exactly one host mount, the PodResources socket directory, read-only.
    host_volumes = [v for v in pod["volumes"] if "hostPath" in v]
    assert [v["hostPath"]["path"] for v in host_volumes] == ["/var/lib/kubelet/pod-resources"]
    assert len(pod["volumes"]) == 1
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/var/lib/kubelet/pod-resources" and mount["readOnly"] is True
    assert "nvidia.com/gpu.present" in pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    limits = container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(limits)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_rbac_reads_nodes_only() -> None:
    role = by_kind("ClusterRole")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
    ]
    binding = by_kind("ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = by_kind("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "tide-system"}
    ]
    pod = by_kind("DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


def test_daemonset_args_are_agent_flags() -> None:
    """Every flag in the manifest is one the agent accepts (a renamed flag breaks here)."""
    from services.agent.settings import AgentSettings
    from services.common.config import load_settings

    (container,) = by_kind("DaemonSet")["spec"]["template"]["spec"]["containers"]
    settings = load_settings(AgentSettings, container["args"], env={"NODE_NAME": "n"})
    assert settings.source == "nvml" and settings.metrics_listen == "0.0.0.0:9102"


def test_the_pod_grace_covers_the_agent_drain() -> None:
    """SIGTERM: the last sample (at most 1 s), the final flush, then, when the agent
    serves health on --listen, the grace period for RPCs in flight; the kubelet must
    not SIGKILL it before that."""
    from services.agent.settings import AgentSettings
    from services.common.config import load_settings

    pod = by_kind("DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    s = load_settings(AgentSettings, container["args"], env={"NODE_NAME": "n"})
    drain_s = 1.0 + s.shutdown_flush_s + (s.grace_period_s if s.listen else 0.0)
    assert pod["terminationGracePeriodSeconds"] >= drain_s
