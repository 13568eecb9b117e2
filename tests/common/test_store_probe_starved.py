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

TIMEOUT_S = 0.5
#: SELECT 1 answers after this long: past the timeout, well inside three times it (1.5 s),
#: so that a ping thread late to wake on a loaded machine still answers inside it.
SLOW_S = 0.8
#: A store that answers after the longest a starved probe waits (3 x TIMEOUT_S), with room
#: for the probe itself to run late: a thread's real run-queue time on a loaded machine
#: lengthens the timeout by up to that much.
NEVER_IN_TIME_S = 2.5


def _slow_engine(path: Path, seconds: float) -> Engine:
    engine = db.make_engine(f"sqlite:///{path / 'tide.db'}")

    @event.listens_for(engine, "before_cursor_execute")
    def slow(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement == "SELECT 1":  # the probe's ping (not the BEGIN before it)
            time.sleep(seconds)

    return engine


@pytest.fixture
def slow_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = _slow_engine(tmp_path, SLOW_S)
    yield engine
    engine.dispose()


@pytest.fixture
def dead_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = _slow_engine(tmp_path, NEVER_IN_TIME_S)
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
    dead_engine: Engine,
) -> None:
    # The real run-queue time: the ping's thread slept (as on a partitioned socket). On a
    # loaded machine it also waited for a CPU, which lengthens the timeout up to 3 x.
    probe = StoreProbe(dead_engine, timeout_s=TIMEOUT_S)
    t0 = time.monotonic()
    assert not await probe.probe_once()
    assert time.monotonic() - t0 < NEVER_IN_TIME_S
    assert not probe.ok


async def test_starvation_lengthens_a_timeout_three_times_at_most(
    dead_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited = iter([0.0])
    monkeypatch.setattr(probe_mod, "thread_cpu_wait_s", lambda tid: next(waited, 10.0))
    probe = StoreProbe(dead_engine, timeout_s=TIMEOUT_S)  # 1.5 s at most, not 10.5
    t0 = time.monotonic()
    assert not await probe.probe_once()
    assert 3 * TIMEOUT_S <= time.monotonic() - t0 < NEVER_IN_TIME_S
