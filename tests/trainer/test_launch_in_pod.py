"""The launcher as a PaddleJob worker's entrypoint, run by the stand-in kubelet: it
takes its identity from the Downward API, and the pod's deletion (SIGTERM) ends it
cleanly, exit 0, even before any coordinator answered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.poll import wait_for
from tests.support.procs import ROOT
from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import PADDLE_OPERATOR, install_paddlejob_crds
from tide.services.testing.kube.kubelet import KubeletStandIn
from tide.services.testing.kube.operators import POD, start_operators

pytestmark = pytest.mark.integration


def test_sigterm_from_the_pod_deletion_exits_0(tmp_path: Path) -> None:
    with KubeApiServer() as api:
        install_paddlejob_crds(api)
        ops = start_operators(api)
        kubelet = KubeletStandIn(
            api,
            "n1",
            tmp_path / "kubelet",
            images={"tide-trainer": [sys.executable, "-m", "tide.trainer.launch"]},
            cwd=ROOT,
        ).start()
        try:
            env = [
                # Nobody listens there: the launcher keeps retrying until it is stopped.
                {"name": "TIDE_COORDINATOR", "value": "127.0.0.1:9"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {
                    "name": "POD_NAMESPACE",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                },
            ]
            container = {
                "name": "worker",
                "image": "tide-trainer",
                "args": ["--no-zygote", "--no-prewarm", "--", "python", "-c", "pass"],
                "env": env,
            }
            api.create(
                PADDLE_OPERATOR,
                {
                    "metadata": {"name": "mlp"},
                    "spec": {
                        "worker": {"replicas": 1, "template": {"spec": {"containers": [container]}}}
                    },
                },
            )
            log = tmp_path / "kubelet" / "default_mlp-worker-0.log"
            # Its first lines name the job it found from the environment.
            wait_for(
                lambda: log.exists() and "default/mlp" in log.read_text(),
                30,
                what="the launcher's log",
            )
            api.update(
                PADDLE_OPERATOR,
                "default",
                "mlp",
                lambda j: {**j, "spec": {"worker": {**j["spec"]["worker"], "replicas": 0}}},
            )
            wait_for(lambda: not api.list(POD)[0], 30, what="the pod gone")
            assert kubelet.exit_codes[("default", "mlp-worker-0")] == 0, log.read_text()
        finally:
            for op in ops:
                op.stop()
            kubelet.stop()
