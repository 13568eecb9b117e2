"""The store probe tells a store that did not answer from a process that did not get a
CPU to ask it (tide/services/store/probe.py, STARVED_TIMEOUT_FACTOR)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event

from tide.services.store import db
from tide.services.store import probe as probe_mod
from tide.services.store.probe import StoreProbe

pytestmark = pytest.mark.component

TIMEOUT_S = 0.2
#: SELECT 1 answers after this long: past the timeout, inside three times it.
SLOW_S = 0.5


@pytest.fixture
def slow_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'tide.db'}")

    @event.listens_for(engine, "before_cursor_execute")
    def slow(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement == "SELECT 1":  # the probe's ping (not the BEGIN before it)
            time.sleep(SLOW_S)

    yield engine
    engine.dispose()


async def test_a_probe_thread_that_waited_for_a_cpu_gets_that_time_back(
    slow_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ping's thread was runnable without a CPU for as long as the timeout: the store
    # answered in time for the time the probe could run.
    waited = iter([0.0])
    monkeypatch.setattr(probe_mod, "thread_cpu_wait_s", lambda tid: next(waited, 2 * TIMEOUT_S))
    probe = StoreProbe(slow_engine, timeout_s=TIMEOUT_S)
    assert await probe.probe_once()
    assert probe.ok


async def test_a_probe_that_slept_past_its_timeout_finds_the_store_down(
    slow_engine: Engine,
) -> None:
    # The real run-queue time: the ping's thread slept (as on a partitioned socket).
    probe = StoreProbe(slow_engine, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    assert not await probe.probe_once()
    assert time.monotonic() - t0 < SLOW_S
    assert not probe.ok


async def test_starvation_lengthens_a_timeout_three_times_at_most(
    slow_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited = iter([0.0])
    monkeypatch.setattr(probe_mod, "thread_cpu_wait_s", lambda tid: next(waited, 10.0))
    probe = StoreProbe(slow_engine, timeout_s=0.1)  # 0.3 s at most, the store answers at 0.5
    t0 = time.monotonic()
    assert not await probe.probe_once()
    assert 0.3 <= time.monotonic() - t0 < SLOW_S
