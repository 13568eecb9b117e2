"""deploy/helm/tide: `helm lint`, `helm template` with both example values files, every
rendered object valid against the Kubernetes schemas, the values schema refusing bad
values, and the rendered services' flags and settings files accepted by the services."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.chart import (
    CHART,
    EXAMPLES,
    KUBE_VERSIONS,
    NAMESPACE,
    PRODUCTION,
    ROOT,
    SMALL,
    HelmFailed,
    Rendered,
    helm,
    render,
    selects,
    template_args,
)

pytestmark = pytest.mark.component

#: Kinds of CRDs the chart renders, which kubernetes-validate has no schema for;
#: test_service_monitor checks the one there is explicitly.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
}


def kube_schema_errors(objects: tuple[dict[str, Any], ...], version: str) -> list[str]:
    """Every schema violation of the built-in kinds, strict (unknown fields are errors)."""
    errors = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    return errors


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_helm_lint(values: Path) -> None:
    helm("lint", CHART, "--strict", "-f", values)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_every_object_is_valid_against_the_kubernetes_schema(values: Path, version: str) -> None:
    rendered = render(values, kube_version=version)
    assert kube_schema_errors(rendered.objects, version.rpartition(".")[0]) == []
    # Nothing is skipped silently: every kind is a built-in one or a CRD checked below.
    unknown = set()
    for obj in rendered.objects:
        try:
            kubernetes_validate.validate(obj, version.rpartition(".")[0], strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unknown.add((obj["apiVersion"], obj["kind"]))
    assert unknown <= CRD_KINDS


def test_schema_validation_catches_a_typo_that_helm_lets_through(tmp_path: Path) -> None:
    chart = tmp_path / "tide"
    shutil.copytree(CHART, chart)
    helpers = chart / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert "readOnlyRootFilesystem: true" in text
    helpers.write_text(text.replace("readOnlyRootFilesystem: true", "readOnlyRootFileSystem: true"))
    helm("lint", chart, "--strict", "-f", SMALL)  # helm itself finds nothing wrong

    errors = kube_schema_errors(render(SMALL, chart=chart).objects, "1.35")
    assert errors
    assert all("readOnlyRootFileSystem" in e for e in errors), errors
    assert {e.split(":")[0] for e in errors} == {
        "Deployment/tide-scaler",
        "Deployment/tide-coordinator",
        "DaemonSet/tide-agent",
    }


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        ({"store.type": "mysql"}, "/store/type"),
        ({"store.type": "postgresql"}, "/store/postgresql/existingSecret"),
        ({"scaler.settings.cooldown_s": "soon"}, "/scaler/settings/cooldown_s"),
        ({"scaler.settings.cooldonw_s": "60"}, "'cooldonw_s' not allowed"),
        # The chart wires the addresses itself; values cannot override them.
        ({"agent.settings.scaler": "elsewhere:1"}, "'scaler' not allowed"),
        ({"coordinator.grpcPort": "0"}, "/coordinator/grpcPort"),
        ({"scaler.watchNamespaces[0]": "Not_A_Namespace"}, "/scaler/watchNamespaces/0"),
        ({"networkPolicy.egress.enabled": "true"}, "/networkPolicy/egress/apiServerCIDRs"),
        ({"serviceMonitor.interval": "often"}, "/serviceMonitor/interval"),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, dict) else None,
)
def test_the_values_schema_refuses_a_bad_value(sets: dict[str, str], names: str) -> None:
    with pytest.raises(HelmFailed) as failed:
        render(sets=sets)
    assert "values don't meet the specifications of the schema" in str(failed.value)
    assert names in str(failed.value)


@pytest.mark.parametrize("store", ["null", "[]"])
def test_postgresql_with_limited_egress_must_name_the_store(store: str) -> None:
    args = template_args([PRODUCTION])
    with pytest.raises(HelmFailed, match="/networkPolicy/egress"):
        helm(*args, "--set-json", f"networkPolicy.egress.store={store}")


def test_the_settings_schema_is_generated_from_the_services_settings() -> None:
    """values.schema.json's settings maps are what scripts/gen_chart_schema.py writes."""
    spec = importlib.util.spec_from_file_location(
        "gen_chart_schema", ROOT / "scripts" / "gen_chart_schema.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run `make chart-schema`"


def _container(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    (container,) = rendered.pod(kind, name)["containers"]
    return dict(container)


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _settings_file(rendered: Rendered, container: dict[str, Any], tmp_path: Path) -> Path:
    """The ConfigMap key the container's --config names, written to a file."""
    (config,) = [a for a in container["args"] if a.startswith("--config=")]
    path = Path(config.partition("=")[2])
    (cm,) = [
        o
        for o in rendered.all("ConfigMap")
        if path.name in o["data"]
        and o["metadata"]["name"] in {v["configMap"]["name"] for v in _config_volumes(rendered)}
    ]
    out = tmp_path / path.name
    out.write_text(cm["data"][path.name])
    return out


def _config_volumes(rendered: Rendered) -> list[dict[str, Any]]:
    return [
        v
        for w in rendered.workloads()
        for v in w["spec"]["template"]["spec"].get("volumes", [])
        if "configMap" in v
    ]


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment; values from Secrets and the Downward API stand in."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = "sqlite:///:memory:" if e["name"] == "TIDE_DB" else "secret"
        else:
            env[e["name"]] = "from-the-downward-api"
    return env


def _load(
    cls: type[Any],
    rendered: Rendered,
    kind: str,
    name: str,
    tmp_path: Path,
    adjust: Callable[[list[str]], list[str]] = list,
) -> Any:
    """The service's settings from the rendered flags, settings file and environment."""
    from tide.services.common.config import load_settings

    container = _container(rendered, kind, name)
    config = _settings_file(rendered, container, tmp_path)
    args = [f"--config={config}" if a.startswith("--config=") else a for a in container["args"]]
    return load_settings(cls, adjust(_mounted(args, container, tmp_path)), env=_env(container))


def _mounted(args: list[str], container: dict[str, Any], tmp_path: Path) -> list[str]:
    """Flags naming files of the container's mounts (certificates, the token) name a
    stand-in file under ``tmp_path``; each named file must be under a mount."""
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    out = []
    for a in args:
        flag, sep, value = a.partition("=")
        if sep and value.startswith("/var/run/tide/"):
            assert any(value.startswith(m + "/") for m in mounts), (a, mounts)
            stand_in = tmp_path / value.strip("/").replace("/", "_")
            stand_in.write_text("x")
            a = f"{flag}={stand_in}"
        out.append(a)
    return out


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_services_accept_their_rendered_flags_settings_and_environment(
    values: Path, tmp_path: Path
) -> None:
    from tide.services.agent.settings import AgentSettings
    from tide.services.coordinator.settings import CoordinatorSettings
    from tide.services.scaler.settings import ScalerSettings

    rendered = render(values)
    scaler = _load(ScalerSettings, rendered, "Deployment", "tide-scaler", tmp_path)
    coordinator = _load(CoordinatorSettings, rendered, "Deployment", "tide-coordinator", tmp_path)
    agent = _load(AgentSettings, rendered, "DaemonSet", "tide-agent", tmp_path)
    assert (
        "--actuator=kubernetes:in-cluster"
        in _container(rendered, "Deployment", "tide-scaler")["args"]
    )
    assert scaler.actuator == "kubernetes:in-cluster"
    # The watched namespaces reach the actuator and discovery (empty: all).
    watched = yaml.safe_load(values.read_text()).get("scaler", {}).get("watchNamespaces") or []
    assert scaler.namespaces() == tuple(watched)

    # Each service listens where its container port, Service and probes say.
    for settings, kind, name in (
        (scaler, "Deployment", "tide-scaler"),
        (coordinator, "Deployment", "tide-coordinator"),
    ):
        c = _container(rendered, kind, name)
        ports = _ports(c)
        assert settings.listen == f"0.0.0.0:{ports['grpc']}"
        assert settings.metrics_listen == f"0.0.0.0:{ports['metrics']}"
        # The kubelet probes health alone, on its plaintext port.
        assert settings.health_listen == f"0.0.0.0:{ports['health']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == ports["health"]
        assert settings.tls_cert_file and settings.token_review and not settings.insecure
        # SIGTERM: health NOT_SERVING, RPCs drain for grace_period_s, then the flush.
        pod = rendered.pod(kind, name)
        assert pod["terminationGracePeriodSeconds"] >= settings.grace_period_s + 10
    agent_c = _container(rendered, "DaemonSet", "tide-agent")
    assert agent.listen == f"0.0.0.0:{_ports(agent_c)['health']}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert agent_c[probe]["grpc"]["port"] == _ports(agent_c)["health"]

    # Everyone dials the Service of whom they talk to.
    assert agent.scaler == f"tide-scaler.{NAMESPACE}.svc:{_service_port(rendered, 'tide-scaler')}"
    assert scaler.coordinator == (
        f"tide-coordinator.{NAMESPACE}.svc:{_service_port(rendered, 'tide-coordinator')}"
    )
    # ...with the CA and the pod's projected token, whose audience the servers expect.
    for client in (scaler, agent):
        assert client.tls_ca_file and client.token_file and not client.insecure
    assert {
        f"{NAMESPACE}/tide-agent": "agent",
        f"{NAMESPACE}/tide-scaler": "scaler",
    }.items() <= scaler.token_kinds().items()


def _service_port(rendered: Rendered, name: str) -> int:
    (port,) = [
        p["port"] for p in rendered.one("Service", name)["spec"]["ports"] if p["name"] == "grpc"
    ]
    return int(port)


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_every_service_selects_one_workload_and_targets_its_named_ports(values: Path) -> None:
    rendered = render(values)
    for svc in rendered.all("Service"):
        pods = [
            w
            for w in rendered.workloads()
            if selects(
                {"matchLabels": svc["spec"]["selector"]},
                w["spec"]["template"]["metadata"]["labels"],
            )
        ]
        assert len(pods) == 1, svc["metadata"]["name"]
        (container,) = pods[0]["spec"]["template"]["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in _ports(container)


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_every_pod_runs_unprivileged(values: Path) -> None:
    rendered = render(values)
    for w in rendered.workloads():
        pod = w["spec"]["template"]["spec"]
        name = w["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["enableServiceLinks"] is False, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), name
        host_paths = [v for v in pod.get("volumes", []) if "hostPath" in v]
        assert host_paths == [] or name == "tide-agent", name
    # Only those that call the API server hold a token (the coordinator: TokenReview).
    tokens = {
        w["metadata"]["name"]: w["spec"]["template"]["spec"]["automountServiceAccountToken"]
        for w in rendered.workloads()
    }
    assert {n for n, mounted in tokens.items() if mounted} == {
        "tide-scaler",
        "tide-agent",
        "tide-coordinator",
    }


def test_sqlite_gives_each_service_its_own_kept_volume() -> None:
    rendered = render(SMALL)
    claims = {c["metadata"]["name"]: c for c in rendered.all("PersistentVolumeClaim")}
    assert set(claims) == {"tide-scaler-data", "tide-coordinator-data"}
    for claim in claims.values():
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    for name in ("tide-scaler", "tide-coordinator"):
        pod = rendered.pod("Deployment", name)
        (data,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert data["persistentVolumeClaim"]["claimName"] == f"{name}-data"
        (c,) = pod["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == data["name"]]
        db = _env(c)["TIDE_DB"]
        assert db.startswith(f"sqlite:///{mount['mountPath']}/")
        assert rendered.one("Deployment", name)["spec"]["strategy"] == {"type": "Recreate"}
    assert rendered.all("Job") == []  # the services migrate their own files


def test_postgresql_comes_from_the_secret_and_is_migrated_by_a_hook(tmp_path: Path) -> None:
    rendered = render(PRODUCTION)
    assert rendered.all("PersistentVolumeClaim") == []
    values = yaml.safe_load(PRODUCTION.read_text())
    secret = values["store"]["postgresql"]
    (job,) = rendered.all("Job")
    for kind, name in (
        ("Deployment", "tide-scaler"),
        ("Deployment", "tide-coordinator"),
        ("Job", "tide-migrate"),
    ):
        (c,) = rendered.pod(kind, name)["containers"]
        (db,) = [e for e in c["env"] if e["name"] == "TIDE_DB"]
        assert db["valueFrom"]["secretKeyRef"] == {
            "name": secret["existingSecret"],
            "key": secret["urlKey"],
        }
    hooks = job["metadata"]["annotations"]["helm.sh/hook"].split(",")
    assert set(hooks) == {"pre-install", "pre-upgrade"}
    # The Job's command is the CLI's, and it honours the Job's TIDE_DB.
    from typer.testing import CliRunner

    from tide.services.cli.main import app

    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][0] == "tide"
    url = f"sqlite:///{tmp_path / 'migrated.db'}"
    result = CliRunner().invoke(app, c["command"][1:], env={"TIDE_DB": url})
    assert result.exit_code == 0, result.output
    assert "schema at" in result.output
    assert (tmp_path / "migrated.db").exists()


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_disruption_budget_covers_the_scaler_and_the_coordinator_one_at_a_time(
    values: Path,
) -> None:
    rendered = render(values)
    (pdb,) = rendered.all("PodDisruptionBudget")
    covered = {
        w["metadata"]["name"]
        for w in rendered.workloads()
        if selects(pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
    }
    assert covered == {"tide-scaler", "tide-coordinator"}
    # Never minAvailable: with one replica of each it would block every drain.
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]


def test_followers_and_standbys_never_ready_do_not_use_up_the_disruption_budget() -> None:
    # 3 scalers and 2 coordinators: 3 of the 5 pods are never Ready beside their leaders,
    # so the budget allows them plus one leader.
    rendered = render(PRODUCTION, sets={"scaler.replicas": "3", "coordinator.replicas": "2"})
    (pdb,) = rendered.all("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 4


def test_the_service_monitor_scrapes_every_metrics_port() -> None:
    """The ServiceMonitor is a CRD kubernetes-validate has no schema for: checked here."""
    rendered = render(PRODUCTION)
    (sm,) = rendered.all("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert set(endpoint) == {"port", "path", "interval"}
    with_metrics = {
        s["metadata"]["name"]
        for s in rendered.all("Service")
        if any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])
    }
    selected = {
        s["metadata"]["name"]
        for s in rendered.all("Service")
        if selects(sm["spec"]["selector"], s["metadata"]["labels"])
    }
    assert selected == with_metrics == {"tide-scaler", "tide-coordinator", "tide-agent"}
    assert render(SMALL).all("ServiceMonitor") == []


def test_several_scaler_replicas_elect_a_leader_on_the_release_lease(tmp_path: Path) -> None:
    from tide.services.scaler.settings import ScalerSettings

    rendered = render(PRODUCTION, sets={"scaler.replicas": "2"})
    assert kube_schema_errors(rendered.objects, "1.35") == []
    deployment = rendered.one("Deployment", "tide-scaler")
    assert deployment["spec"]["replicas"] == 2
    # Two side by side are safe now (one leads): a rolling update, never both down.
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
    scaler = _load(ScalerSettings, rendered, "Deployment", "tide-scaler", tmp_path)
    assert scaler.leader_election == "kubernetes"
    assert (scaler.lease_name, scaler.lease_namespace) == ("tide-scaler", NAMESPACE)
    assert scaler.lease_kubeconfig == "in-cluster"
    # Errors and followers name the leader by its pod IP (the kubelet expands it).
    port = _ports(_container(rendered, "Deployment", "tide-scaler"))["grpc"]
    assert scaler.advertise_address == f"$(POD_IP):{port}"
    env = _container(rendered, "Deployment", "tide-scaler")["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    # One replica stays as it was: Recreate, no election.
    single = render(PRODUCTION).one("Deployment", "tide-scaler")
    assert (single["spec"]["replicas"], single["spec"]["strategy"]["type"]) == (1, "Recreate")
    assert not any(
        a.startswith("--leader-election")
        for a in _container(render(PRODUCTION), "Deployment", "tide-scaler")["args"]
    )


def test_with_several_scaler_replicas_agents_stream_to_every_one(tmp_path: Path) -> None:
    from tide.services.agent.settings import AgentSettings

    rendered = render(PRODUCTION, sets={"scaler.replicas": "2"})
    peers = rendered.one("Service", "tide-scaler-peers")
    # Headless and listing pods that are not ready: followers are never ready.
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    scaler_pods = rendered.one("Deployment", "tide-scaler")["spec"]["selector"]["matchLabels"]
    assert peers["spec"]["selector"] == scaler_pods
    agent = _load(AgentSettings, rendered, "DaemonSet", "tide-agent", tmp_path)
    assert agent.scaler_fanout
    port = _ports(_container(rendered, "Deployment", "tide-scaler"))["grpc"]
    host = f"tide-scaler-peers.{NAMESPACE}.svc"
    assert agent.scaler == f"{host}:{port}"
    # The agent checks each replica's certificate against the name it resolved.
    cert = rendered.one("Certificate", "tide-scaler")
    assert host in cert["spec"]["dnsNames"]
    # One replica: the Service, one stream, no peers Service.
    single = render(PRODUCTION)
    assert not [s for s in single.all("Service") if s["metadata"]["name"] == "tide-scaler-peers"]
    one = _load(AgentSettings, single, "DaemonSet", "tide-agent", tmp_path)
    assert (one.scaler, one.scaler_fanout) == (f"tide-scaler.{NAMESPACE}.svc:{port}", False)


def test_sharded_scaler_replicas_hold_shards_instead_of_electing(tmp_path: Path) -> None:
    from tide.services.agent.settings import AgentSettings
    from tide.services.scaler.settings import ScalerSettings

    rendered = render(PRODUCTION, sets={"scaler.replicas": "3", "scaler.shards": "8"})
    assert kube_schema_errors(rendered.objects, "1.35") == []
    assert rendered.one("Deployment", "tide-scaler")["spec"]["replicas"] == 3
    scaler = _load(ScalerSettings, rendered, "Deployment", "tide-scaler", tmp_path)
    assert (scaler.shards, scaler.leader_election) == (8, "off")
    # Dialled by pod IP, they check the name the serving certificate carries.
    assert scaler.peer_tls_server_name == "tide-scaler"
    # Peers ship partials to the address each one's member lease names: its pod IP.
    port = _ports(_container(rendered, "Deployment", "tide-scaler"))["grpc"]
    assert scaler.advertise_address == f"$(POD_IP):{port}"
    # No Lease to elect on, so no RBAC for one.
    assert not [r for r in rendered.all("Role") if r["metadata"]["name"].endswith("-election")]
    with pytest.raises(HelmFailed):
        render(PRODUCTION, sets={"scaler.shards": "-1"})
    # Agents stream to one replica, through the Service: a report sent to every replica
    # would be shipped to its job's owner once per replica.
    agent = _load(AgentSettings, rendered, "DaemonSet", "tide-agent", tmp_path)
    assert (agent.scaler, agent.scaler_fanout) == (f"tide-scaler.{NAMESPACE}.svc:{port}", False)
    assert not [s for s in rendered.all("Service") if s["metadata"]["name"] == "tide-scaler-peers"]


def test_several_scaler_replicas_need_a_shared_store() -> None:
    with pytest.raises(HelmFailed, match=r"scaler.replicas > 1 needs store.type postgresql"):
        render(SMALL, sets={"scaler.replicas": "2"})


def test_several_coordinator_replicas_stand_by_on_the_release_lease_row(tmp_path: Path) -> None:
    from tide.services.coordinator.settings import CoordinatorSettings

    rendered = render(PRODUCTION, sets={"coordinator.replicas": "2"})
    assert kube_schema_errors(rendered.objects, "1.35") == []
    deployment = rendered.one("Deployment", "tide-coordinator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    coordinator = _load(CoordinatorSettings, rendered, "Deployment", "tide-coordinator", tmp_path)
    assert (coordinator.leader_election, coordinator.lease_name) == ("sql", "tide-coordinator")
    # Each replica is named by its pod in the lease, and a standby names the leader's IP.
    assert coordinator.owner_id == "$(POD_NAME)"
    port = _ports(_container(rendered, "Deployment", "tide-coordinator"))["grpc"]
    assert coordinator.advertise_address == f"$(POD_IP):{port}"
    env = _container(rendered, "Deployment", "tide-coordinator")["env"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    # Launchers and the scaler keep dialling the Service, which routes to Ready pods:
    # the leader only (a standby's health is NOT_SERVING).
    service = rendered.one("Service", "tide-coordinator")
    assert selects(
        service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"]
    )
    scaler_args = _container(rendered, "Deployment", "tide-scaler")["args"]
    assert any(a.startswith("--coordinator=tide-coordinator.") for a in scaler_args), scaler_args
    single = render(PRODUCTION).one("Deployment", "tide-coordinator")
    assert (single["spec"]["replicas"], single["spec"]["strategy"]["type"]) == (1, "Recreate")
    assert not any(
        a.startswith("--leader-election")
        for a in _container(render(PRODUCTION), "Deployment", "tide-coordinator")["args"]
    )


def test_several_coordinator_replicas_need_a_shared_store() -> None:
    with pytest.raises(HelmFailed, match=r"coordinator.replicas > 1 needs store.type postgresql"):
        render(SMALL, sets={"coordinator.replicas": "2"})
