"""The operator and kubelet stand-ins: pods by index from each PaddleJob kind's
replicas (highest indexes removed on a shrink), each operator's naming and labels,
real processes with the Downward API's environment, phases, SIGTERM on deletion."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.poll import wait_for
from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import KUBEFLOW, PADDLE_OPERATOR
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import POD, job_pods, start_operators

pytestmark = pytest.mark.integration  # real processes

# Writes its environment to $OUT/<pod>.json, then waits for SIGTERM and exits 0.
WORKER = (
    "import json, os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "out = os.path.join(os.environ['OUT'], os.environ['POD_NAME'] + '.json')\n"
    "json.dump(dict(os.environ), open(out + '.tmp', 'w')); os.replace(out + '.tmp', out)\n"
    "time.sleep(120)\n"
)


def template(out: Path, gpus: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app": "train"}},
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "trainer",
                    "command": ["python", "-c", WORKER],
                    "env": [
                        {"name": "OUT", "value": str(out)},
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "POD_NAMESPACE",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                        },
                        {
                            "name": "POD_UID",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}},
                        },
                        {
                            "name": "NODE_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                        },
                        {
                            "name": "INDEX",
                            "valueFrom": {
                                "fieldRef": {
                                    "fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"
                                }
                            },
                        },
                    ],
                    "resources": {"limits": {"nvidia.com/gpu": gpus}},
                }
            ]
        },
    }


@pytest.fixture
def cluster(kube: KubeApiServer, tmp_path: Path) -> Iterator[KubeletStandIn]:
    ops = start_operators(kube)
    kubelet = KubeletStandIn(kube, "gpu-node-1", tmp_path / "kubelet", gpus=3).start()
    yield kubelet
    for op in ops:
        op.stop()
    kubelet.stop()


def pods_of(kube: KubeApiServer, uid: str) -> list[tuple[str, str, bool]]:
    return [
        (
            p["metadata"]["name"],
            p.get("status", {}).get("phase", ""),
            bool(p["metadata"].get("deletionTimestamp")),
        )
        for p in job_pods(kube, "default", uid)
    ]


@pytest.mark.parametrize("kind", ["paddle-operator", "kubeflow"])
def test_pods_follow_the_replicas_by_index(
    kind: str, kube: KubeApiServer, cluster: KubeletStandIn, tmp_path: Path
) -> None:
    out = tmp_path / "env"
    out.mkdir()
    if kind == "paddle-operator":
        rtype = PADDLE_OPERATOR
        spec: dict[str, Any] = {"worker": {"replicas": 2, "template": template(out)}}

        def resize(cur: dict[str, Any], n: int) -> dict[str, Any]:
            cur["spec"]["worker"]["replicas"] = n
            return cur
    else:
        rtype = KUBEFLOW
        spec = {"paddleReplicaSpecs": {"Worker": {"replicas": 2, "template": template(out)}}}

        def resize(cur: dict[str, Any], n: int) -> dict[str, Any]:
            cur["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"] = n
            return cur

    job = kube.create(rtype, {"metadata": {"name": "mlp"}, "spec": spec})
    uid = job["metadata"]["uid"]
    running = [("mlp-worker-0", "Running", False), ("mlp-worker-1", "Running", False)]
    wait_for(lambda: pods_of(kube, uid) == running, 20, what="two running pods")

    env = json.loads(
        wait_for(
            lambda: (
                (out / "mlp-worker-1.json").exists() and (out / "mlp-worker-1.json").read_text()
            ),
            20,
        )
    )
    pod = kube.get(POD, "default", "mlp-worker-1")
    assert env["POD_NAME"] == "mlp-worker-1"
    assert env["POD_NAMESPACE"] == "default"
    assert env["POD_UID"] == pod["metadata"]["uid"]
    assert env["NODE_NAME"] == "gpu-node-1"
    labels = pod["metadata"]["labels"]
    assert labels["app"] == "train"  # the template's labels stay
    if kind == "paddle-operator":
        assert labels["paddle-res-name"] == "mlp-worker-1"
        assert labels["paddle-res-type"] == "worker"
        assert env["PADDLE_TRAINER_ID"] == "1"
    else:
        assert labels["training.kubeflow.org/replica-index"] == "1"
        assert labels["training.kubeflow.org/job-name"] == "mlp"
        assert env["INDEX"] == "1"

    # Grow past the node's 3 GPUs: the 4th pod stays Pending.
    kube.update(rtype, "default", "mlp", lambda cur: resize(cur, 4))
    wait_for(
        lambda: [p[1] for p in pods_of(kube, uid)] == ["Running", "Running", "Running", "Pending"],
        20,
        what="three running, one pending",
    )
    # Shrink: the highest indexes go; their processes get SIGTERM and exit 0 (once
    # they have their handler, which they install before writing their file).
    wait_for(lambda: (out / "mlp-worker-2.json").exists(), 20, what="pod 2 started")
    kube.update(rtype, "default", "mlp", lambda cur: resize(cur, 1))
    wait_for(lambda: pods_of(kube, uid) == running[:1], 20, what="one pod left")
    for name in ("mlp-worker-1", "mlp-worker-2"):
        assert cluster.exit_codes[("default", name)] == 0

    # Deleting the job takes its pods (the garbage collector's part).
    kube.delete(rtype, "default", "mlp")
    wait_for(lambda: pods_of(kube, uid) == [], 20, what="no pods")


def test_a_finished_process_sets_the_phase(kube: KubeApiServer, cluster: KubeletStandIn) -> None:
    for name, code in (("ok", 0), ("bad", 3)):
        kube.create(
            POD,
            {
                "metadata": {"name": name},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "image": "x",
                            "command": [sys.executable, "-c", f"raise SystemExit({code})"],
                        }
                    ]
                },
            },
        )
    wait_for(lambda: kube.get(POD, "default", "ok")["status"]["phase"] == "Succeeded", 20)
    wait_for(lambda: kube.get(POD, "default", "bad")["status"]["phase"] == "Failed", 20)
    assert cluster.exit_codes[("default", "bad")] == 3
