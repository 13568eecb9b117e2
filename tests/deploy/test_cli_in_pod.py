"""`kubectl exec deploy/tide-scaler -- tide ...`: the CLI with exactly the environment
the chart renders for the scaler's container works against a scaler whose certificate
names only its Service, and so does a port-forward with --tls-server-name (bench/install.py
measures the same)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.install import cli_checks
from tests.support.kubetools import kubetools

pytestmark = pytest.mark.integration


def test_the_cli_in_the_scaler_pod_and_through_a_port_forward(tmp_path: Path) -> None:
    kubetools()  # the helm that renders the pod's environment (.venv/kubetools/helm)
    out = cli_checks(tmp_path)
    assert out == {
        "cli_in_pod_rc": 0,
        "cli_port_forward_rc": 0,
        "cli_port_forward_without_name_rc": 2,
        "cli_port_forward_without_name_says_tls": 1,
    }
