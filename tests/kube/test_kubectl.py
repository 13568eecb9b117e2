"""The emulator's fidelity, checked by the real kubectl (tests/support/kubetools.py):
discovery, short names, apply (create, then a merge patch), patch of each type,
selectors, jsonpath output and describe with the object's Events."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.kubetools import kubetools
from tide.services.testing.kube import KubeApiServer

pytestmark = pytest.mark.component

#: kubectl ARGS... [stdin=...] [ok=False]: its stdout, or its stderr when a failure is expected.
Kubectl = Callable[..., str]

JOB = """\
apiVersion: batch.paddlepaddle.org/v1
kind: PaddleJob
metadata:
  name: resnet
  annotations:
    tide.dev/autoscale: "true"
spec:
  worker:
    replicas: {replicas}
    requests: 1
    limits: 4
"""


@pytest.fixture(name="k")
def kubectl(kube: KubeApiServer, tmp_path: Path) -> Kubectl:
    binary = kubetools().kubectl
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")

    def run(*args: str, stdin: str | None = None, ok: bool = True) -> str:
        proc = subprocess.run(
            [str(binary), "--kubeconfig", str(config), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if ok:
            assert proc.returncode == 0, proc.stderr
        return proc.stdout if ok else proc.stderr

    return run


def test_apply_get_patch_and_describe_a_paddlejob(k: Kubectl) -> None:

    assert "created" in k("apply", "-f", "-", stdin=JOB.format(replicas=2))
    assert "configured" in k("apply", "-f", "-", stdin=JOB.format(replicas=3))
    assert k("get", "pdj", "resnet", "-o", "jsonpath={.spec.worker.replicas}") == "3"
    k("patch", "pdj", "resnet", "--type=merge", "-p", '{"spec":{"worker":{"replicas":4}}}')
    k(
        "patch",
        "paddlejobs.batch.paddlepaddle.org",
        "resnet",
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/worker/replicas","value":5}]',
    )
    doc = json.loads(k("get", "pdj", "resnet", "-o", "json"))
    assert doc["spec"]["worker"] == {"replicas": 5, "requests": 1, "limits": 4}
    # apply kept its last-applied record, as on a real server.
    assert "kubectl.kubernetes.io/last-applied-configuration" in doc["metadata"]["annotations"]
    assert doc["metadata"]["generation"] == 4

    k(
        "apply",
        "-f",
        "-",
        stdin=json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": "resnet.1"},
                "involvedObject": {
                    "apiVersion": "batch.paddlepaddle.org/v1",
                    "kind": "PaddleJob",
                    "name": "resnet",
                    "namespace": "default",
                    "uid": doc["metadata"]["uid"],
                },
                "reason": "SuccessfulRescale",
                "message": "New size: 5; reason: all GPUs above target",
                "type": "Normal",
                "source": {"component": "tide-scaler"},
                "count": 1,
            }
        ),
    )
    described = k("describe", "pdj", "resnet")
    assert "Replicas:  5" in described
    assert "SuccessfulRescale" in described and "New size: 5" in described


def test_pods_by_label_and_a_missing_object(k: Kubectl) -> None:

    for name, tier in (("a", "x"), ("b", "y")):
        k(
            "apply",
            "-f",
            "-",
            stdin=json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "labels": {"tier": tier}},
                    "spec": {"containers": [{"name": "c", "image": "busybox"}]},
                }
            ),
        )
    assert k("get", "pods", "-l", "tier=x", "-o", "name").split() == ["pod/a"]
    assert k("get", "pods", "-l", "tier in (x,y)", "-o", "name").split() == ["pod/a", "pod/b"]
    k("label", "pod", "b", "tier=x", "--overwrite")
    assert k("get", "pods", "-l", "tier=x", "-o", "name").split() == ["pod/a", "pod/b"]
    assert "NotFound" in k("get", "pdj", "nope", ok=False)
    assert "tier=x" in k("describe", "pod", "a")
