"""The chart's own pods, run for real (issue 32): `helm template` of values-small.yaml
applied with the real kubectl to the API server emulator (HTTPS, bearer tokens
required, TokenReview served), cert-manager's stand-in issuing the Certificates, and
the stand-in kubelet running every Deployment and DaemonSet pod in its sandbox with
its rendered command, env, Secrets, ConfigMaps and projected tokens at their mount
paths (services/testing/kube/chartrun.py). Every link is TLS: the services refuse to
start on a missing certificate, and become Ready only when serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testing.kube.chartrun import ChartRun
from services.testing.kube.sandbox import Sandboxes
from tests.support.kubetools import kubetools

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(not Sandboxes.available(), reason="pod sandboxes need root and unshare")
def test_the_charts_pods_start_with_security_on(tmp_path: Path) -> None:
    tools = kubetools()
    run = ChartRun(tmp_path, tools.helm, tools.kubectl)
    out = run.run(timeout_s=50.0, example=False)
    assert out.error == "", f"{out.error} (logs in {tmp_path / 'logs'})"
    assert sorted(out.rendered_pods) == [
        "DaemonSet/tide-agent",
        "Deployment/tide-coordinator",
        "Deployment/tide-scaler",
    ]
    # One pod per Deployment replica and one agent on the one GPU node, all Ready.
    assert out.pods_started == 3
