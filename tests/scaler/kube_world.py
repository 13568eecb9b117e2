"""A small emulated cluster for the scaler's Kubernetes tests: the API server, both
operators, one GPU node's kubelet, PaddleJobs of either kind."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import KUBEFLOW, PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import job_pods, start_operators

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def worker(replicas: int, gpus: int = 1, command: list[str] | None = None) -> dict[str, Any]:
    container = {
        "name": "worker",
        "image": "trainer",
        "command": command or SLEEPER,
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
    }
    return {"replicas": replicas, "template": {"spec": {"containers": [container]}}}


def paddle_operator_job(
    name: str, replicas: int, lo: int = 1, hi: int = 8, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "annotations": {"tide.dev/autoscale": "true", **(annotations or {})},
        },
        "spec": {"worker": {**worker(replicas), "requests": lo, "limits": hi}},
    }


def kubeflow_job(
    name: str, replicas: int, lo: int = 1, hi: int = 8, metrics: bool = False
) -> dict[str, Any]:
    elastic: dict[str, Any] = {"minReplicas": lo, "maxReplicas": hi}
    if metrics:
        elastic["metrics"] = [{"type": "Resource", "resource": {"name": "cpu"}}]
    return {
        "metadata": {"name": name, "annotations": {"tide.dev/autoscale": "true"}},
        "spec": {"paddleReplicaSpecs": {"Worker": worker(replicas)}, "elasticPolicy": elastic},
    }


@dataclass
class Cluster:
    api: KubeApiServer
    kubelet: KubeletStandIn
    kubeconfig: Path

    def live_pods(self, rtype: Any, ns: str, name: str) -> list[str]:
        uid = self.api.get(rtype, ns, name)["metadata"]["uid"]
        return [
            p["metadata"]["name"]
            for p in job_pods(self.api, ns, uid)
            if not p["metadata"].get("deletionTimestamp")
        ]


@contextmanager
def cluster(tmp_path: Path, gpus: int = 8) -> Iterator[Cluster]:
    with KubeApiServer() as api:
        install_paddlejob_crds(api)
        ops = start_operators(api)
        kubelet = KubeletStandIn(api, "gpu-node-1", tmp_path / "kubelet", gpus=gpus).start()
        try:
            yield Cluster(api, kubelet, api.write_kubeconfig(tmp_path / "kubeconfig"))
        finally:
            for op in ops:
                op.stop()
            kubelet.stop()


__all__ = [
    "KUBEFLOW",
    "PADDLE_OPERATOR",
    "Cluster",
    "cluster",
    "kubeflow_job",
    "paddle_operator_job",
]
