"""Readiness apart from liveness, and the store probe that drives readiness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import REGISTRY

from tide.services.common.readiness import LIVENESS, Readiness
from tide.services.store import db
from tide.services.store.probe import StoreProbe
from tide.services.testing.ports import free_port

pytestmark = pytest.mark.component

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthBook:
    """What a service's health servicer was last told, by service name."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}

    async def set(self, name: str, status: int) -> None:
        self.status[name] = status


async def test_a_cause_takes_readiness_down_and_back_and_leaves_liveness() -> None:
    book = HealthBook()
    r = Readiness()
    await r.set_down("store", "connection refused")  # before bind: applied at bind
    await r.bind(book, ["tide.v1.Scaler"])
    assert book.status == {"": NOT_SERVING, "tide.v1.Scaler": NOT_SERVING, LIVENESS: SERVING}
    await r.set_down("coordinator", "unreachable")
    await r.set_up("store")
    assert book.status[""] == NOT_SERVING  # one cause left
    await r.set_up("coordinator")
    assert book.status == {"": SERVING, "tide.v1.Scaler": SERVING, LIVENESS: SERVING}
    assert r.ready


async def test_a_dead_process_fails_liveness_too() -> None:
    book = HealthBook()
    r = Readiness()
    await r.bind(book, [])
    await r.mark_dead("background task run died")
    assert book.status == {"": NOT_SERVING, LIVENESS: NOT_SERVING}


async def test_store_probe_reports_changes_once(tmp_path: Path) -> None:
    changes: list[tuple[bool, str]] = []

    async def record(ok: bool, why: str) -> None:
        changes.append((ok, why))

    down = db.make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    up = db.make_engine(f"sqlite:///{tmp_path / 'tide.db'}")
    try:
        probe = StoreProbe(down)
        probe.listen(record)
        assert probe.ok  # optimistic: the service has just migrated the schema
        assert not await probe.probe_once()
        assert not await probe.probe_once()
        assert len(changes) == 1 and changes[0][0] is False
        assert "OperationalError" in changes[0][1] and not probe.ok

        probe._engine = up  # the store is back
        assert await probe.probe_once()
        await probe.wait_up()
        assert changes[1:] == [(True, "")]
    finally:
        down.dispose()
        up.dispose()


async def test_a_sqlite_store_without_room_on_its_disk_is_down_until_space_returns(
    tmp_path: Path,
) -> None:
    # SELECT 1 answers from a full disk; the probe's statvfs check does not.
    engine = db.make_engine(f"sqlite:///{tmp_path / 'tide.db'}")
    changes: list[tuple[bool, str]] = []

    async def record(ok: bool, why: str) -> None:
        changes.append((ok, why))

    try:
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        probe = StoreProbe(engine, min_free_bytes=free * 2 + 1)
        probe.listen(record)
        before = _sample("tide_store_outages_total", {"cause": "disk_full"})
        assert not await probe.probe_once()
        assert changes[0][0] is False and "bytes free" in changes[0][1]
        assert _sample("tide_store_up", {}) == 0
        assert _sample("tide_store_outages_total", {"cause": "disk_full"}) == before + 1

        probe.min_free_bytes = 1  # space came back
        assert await probe.probe_once()
        assert changes[1:] == [(True, "")]
        assert _sample("tide_store_up", {}) == 1
    finally:
        engine.dispose()


def _sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, name
    return value
