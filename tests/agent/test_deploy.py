"""The agent's DaemonSet as the Helm chart renders it: the device-plugin posture, its
health probe on --listen, and a termination grace that covers its drain. (The schema
validation of every rendered object is tests/deploy/test_chart.py's.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.chart import EXAMPLES, Rendered, render

pytestmark = pytest.mark.component


def agent(values: Path) -> tuple[Rendered, dict[str, Any]]:
    rendered = render(values)
    return rendered, rendered.pod("DaemonSet", "tide-agent")


def agent_settings(rendered: Rendered, tmp_path: Path) -> Any:
    """The agent's settings from its rendered flags and settings file."""
    from tide.services.agent.settings import AgentSettings
    from tide.services.common.config import load_settings

    (container,) = rendered.pod("DaemonSet", "tide-agent")["containers"]
    config = tmp_path / "agent.yaml"
    config.write_text(rendered.one("ConfigMap", "tide-agent")["data"]["agent.yaml"])
    args = [f"--config={config}" if a.startswith("--config=") else a for a in container["args"]]
    # The CA and the projected token are mounted files: stand-ins here.
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if value.startswith("/var/run/tide/"):
            stand_in = tmp_path / value.rpartition("/")[2]
            stand_in.write_text("x")
            args[i] = f"{flag}={stand_in}"
    return load_settings(AgentSettings, args, env={"NODE_NAME": "n"})


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_daemonset_posture(values: Path) -> None:
    _, pod = agent(values)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc.get("privileged") is False
    # Exactly one host mount, the PodResources socket directory, read-only; beside it
    # only the settings file, the CA alone (not the scaler's key) and a bound token of
    # Tide's audience (docs/security.md).
    host_volumes = [v for v in pod["volumes"] if "hostPath" in v]
    assert [v["hostPath"]["path"] for v in host_volumes] == ["/var/lib/kubelet/pod-resources"]
    others = [v for v in pod["volumes"] if "hostPath" not in v and "configMap" not in v]
    by_name = {v["name"]: v for v in others}
    assert set(by_name) == {"tide-ca", "tide-token"}
    assert by_name["tide-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    (source,) = by_name["tide-token"]["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "tide"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    assert all(m["readOnly"] for m in mounts.values())
    assert "nvidia.com/gpu.present" in pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_health_probe_asks_the_agents_listen_port(values: Path, tmp_path: Path) -> None:
    rendered, pod = agent(values)
    settings = agent_settings(rendered, tmp_path)
    assert settings.source == "nvml"
    assert settings.tls_ca_file and settings.token_file and not settings.insecure
    (container,) = pod["containers"]
    health = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert settings.listen == f"0.0.0.0:{health}"
    assert container["readinessProbe"]["grpc"] == {"port": health}
    # Liveness asks its own health name (docs/reliability.md), on the same port.
    assert container["livenessProbe"]["grpc"] == {"port": health, "service": "liveness"}


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_pod_grace_covers_the_agent_drain(values: Path, tmp_path: Path) -> None:
    """SIGTERM: the last sample (at most 1 s), the final flush, then, since the agent
    serves health on --listen, the grace period for RPCs in flight; the kubelet must
    not SIGKILL it before that."""
    rendered, pod = agent(values)
    s = agent_settings(rendered, tmp_path)
    assert s.listen
    drain_s = 1.0 + s.shutdown_flush_s + s.grace_period_s
    assert pod["terminationGracePeriodSeconds"] >= drain_s
