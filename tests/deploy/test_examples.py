"""The example PaddleJobs of deploy/examples: each worker template is a valid Pod
(kubernetes-validate, strict, like the chart's objects), Tide reads them as meant
(opted in, bounds, GPUs, overrides that parse), and the launcher in one of their
pods knows its pod, index, job and coordinator from the environment the kubelet
gives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.chart import KUBE_VERSIONS
from tests.support.procs import ROOT
from tide.services.scaler.kube.paddlejob import (
    KUBEFLOW,
    PADDLE_OPERATOR,
    Kind,
    overrides_from,
    view,
)
from tide.services.scaler.policy import PolicySettings
from tide.services.testing.kube.kubelet import container_env
from tide.trainer.podenv import pod_identity

pytestmark = pytest.mark.component

EXAMPLES = ROOT / "deploy" / "examples"
CASES: dict[str, tuple[Path, Kind]] = {
    "paddle-operator": (EXAMPLES / "paddlejob-paddle-operator.yaml", PADDLE_OPERATOR),
    "kubeflow": (EXAMPLES / "paddlejob-kubeflow.yaml", KUBEFLOW),
}


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


def pod_of(job: dict[str, Any], kind: Kind, index: int) -> dict[str, Any]:
    """The pod the operator makes of worker ``index`` (the stand-in's labels)."""
    template = kind.worker(job)["template"]
    name = f"{job['metadata']['name']}-worker-{index}"
    labels = {"training.kubeflow.org/replica-index": str(index)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": job["metadata"]["namespace"], "labels": labels},
        "spec": template["spec"],
        "status": {"podIP": "10.1.2.3"},
    }


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_each_worker_template_is_a_valid_pod(case: str, version: str) -> None:
    path, kind = CASES[case]
    job = load(path)
    assert job["apiVersion"] == kind.api_version
    pod = pod_of(job, kind, 0)
    pod.pop("status")
    kubernetes_validate.validate(pod, version.rpartition(".")[0], strict=True)


@pytest.mark.parametrize("case", CASES)
def test_tide_reads_each_example_as_meant(case: str) -> None:
    path, kind = CASES[case]
    v = view(kind, load(path))
    assert v.opted_in and not v.has_metrics
    assert (v.replicas, v.min_replicas, v.max_replicas, v.gpus_per_replica) == (2, 2, 8, 1)
    assert not overrides_from(v.annotations, PolicySettings()).errors


@pytest.mark.parametrize("case", CASES)
def test_the_launcher_in_a_pod_knows_who_it_is(case: str) -> None:
    path, kind = CASES[case]
    job = load(path)
    pod = pod_of(job, kind, 5)
    env = container_env(pod, pod["spec"]["containers"][0])
    me = pod_identity(env, "hostname")
    assert (me.pod_name, me.pod_index) == (f"{job['metadata']['name']}-worker-5", 5)
    assert me.job_id == f"ml-research/{job['metadata']['name']}"
    assert env["TIDE_COORDINATOR"] == "tide-coordinator.tide-system.svc:50052"
    assert env["POD_IP"] == "10.1.2.3"
    # The image's entrypoint is the launcher; the args hand it the training command.
    assert pod["spec"]["containers"][0]["args"][0] == "--"


def test_validation_catches_a_typo_in_a_template() -> None:
    path, kind = CASES["paddle-operator"]
    pod = pod_of(load(path), kind, 0)
    pod.pop("status")
    pod["spec"]["containers"][0]["envv"] = pod["spec"]["containers"][0].pop("env")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBE_VERSIONS[-1].rpartition(".")[0], strict=True)
