"""The scaler copies its CA into each namespace holding an opted-in PaddleJob
(tide/services/scaler/kube/trust.py): created, rewritten when the CA changes, never written
over a ConfigMap that is not Tide's. Against the API-server emulator."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.scaler.kube_world import PADDLE_OPERATOR, paddle_operator_job
from tests.support.poll import eventually
from tide.base.errors import TideError
from tide.services.scaler.kube.discovery import Discovery
from tide.services.scaler.kube.events import EventRecorder
from tide.services.scaler.kube.trust import KEY, TrustBundle
from tide.services.scaler.policy import PolicySettings
from tide.services.testing.kube import KubeApiServer
from tide.services.testing.kube.crds import install_paddlejob_crds

pytestmark = pytest.mark.component

CM = ("", "v1", "configmaps")


@pytest.fixture
async def kube() -> AsyncIterator[tuple[KubeApiServer, client.ApiClient]]:
    with KubeApiServer() as api:
        install_paddlejob_crds(api)
        for ns in ("ml", "research", "x", "other"):
            api.create(api.rtype("", "v1", "namespaces"), {"metadata": {"name": ns}})
        cfg = client.Configuration()
        cfg.host = api.host
        with client.ApiClient(cfg) as c:
            yield api, c


def data(api: KubeApiServer, ns: str, name: str = "tide-ca") -> dict[str, str] | None:
    try:
        return dict(api.get(api.rtype(*CM), ns, name).get("data") or {})
    except Exception:
        return None


async def test_the_ca_follows_its_file_into_each_namespace(
    kube: tuple[KubeApiServer, client.ApiClient], tmp_path: Path
) -> None:
    api, c = kube
    ca = tmp_path / "ca.crt"
    ca.write_text("CA-1\n")
    trust = TrustBundle(c, "tide-ca", str(ca))
    await trust.ensure(["ml", "ml", "research"])
    assert data(api, "ml") == {KEY: "CA-1\n"} and data(api, "research") == {KEY: "CA-1\n"}
    ca.write_text("CA-2\n")  # a rotated CA
    await trust.ensure(["ml"])
    assert data(api, "ml") == {KEY: "CA-2\n"}

    api.create(api.rtype(*CM), {"metadata": {"name": "tide-ca", "namespace": "x"}, "data": {}})
    await trust.ensure(["x"])
    assert data(api, "x") == {}  # someone else's: left alone


async def test_a_ca_file_mid_swap_keeps_the_last_ca_and_raises_nothing(
    kube: tuple[KubeApiServer, client.ApiClient], tmp_path: Path
) -> None:
    api, c = kube
    ca = tmp_path / "ca.crt"
    trust = TrustBundle(c, "tide-ca", str(ca))
    await trust.ensure(["ml"])  # no file yet: nothing copied, discovery goes on
    assert data(api, "ml") is None
    ca.write_text("CA-1\n")
    await trust.ensure(["ml"])
    ca.unlink()  # a Secret's symlink swap, caught in between
    await trust.ensure(["ml", "research"])
    assert data(api, "research") == {KEY: "CA-1\n"}


async def test_discovery_puts_it_where_an_opted_in_paddlejob_is(
    kube: tuple[KubeApiServer, client.ApiClient], tmp_path: Path
) -> None:
    api, c = kube
    ca = tmp_path / "ca.crt"
    ca.write_text("CA\n")

    class Sink:
        def __init__(self) -> None:
            self.jobs: dict[str, object] = {}
            self.defaults = PolicySettings()

        async def upsert_job(self, job_id: str, *args: object, **kwargs: object) -> None:
            raise TideError("not this test's")  # discovery logs it and goes on

    recorder = EventRecorder(c)
    trust = TrustBundle(c, "tide-ca", str(ca))
    discovery = Discovery(c, Sink(), recorder, watch_timeout_s=5, trust=trust)  # type: ignore[arg-type]
    job = paddle_operator_job("a", 1, lo=1, hi=2)
    job["metadata"]["namespace"] = "ml"
    quiet = paddle_operator_job("b", 1)
    quiet["metadata"]["annotations"] = {}
    quiet["metadata"]["namespace"] = "other"
    api.create(PADDLE_OPERATOR, job)
    api.create(PADDLE_OPERATOR, quiet)
    for _, r in discovery.jobs:
        r.start()
    for r in discovery.hpas:
        r.start()
    try:
        await eventually(lambda: all(r.synced.is_set() for _, r in discovery.jobs), 10)
        await eventually(lambda: all(r.synced.is_set() for r in discovery.hpas), 10)
        await discovery.resync()
    finally:
        for _, r in discovery.jobs:
            r.stop()
        for r in discovery.hpas:
            r.stop()
        recorder.close()
    assert data(api, "ml") == {KEY: "CA\n"}
    assert data(api, "other") is None
