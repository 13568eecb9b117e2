"""Fixtures of the Kubernetes tests: the emulator, a client on it, the stand-ins."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import install_paddlejob_crds


@pytest.fixture
def kube() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api:
        install_paddlejob_crds(api)
        yield api


@pytest.fixture
def kclient(kube: KubeApiServer) -> Iterator[client.ApiClient]:
    cfg = client.Configuration()
    cfg.host = kube.host
    with client.ApiClient(cfg) as api:
        yield api
