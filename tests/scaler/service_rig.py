"""The rig of the scaler's end-to-end tests in one process (test_service.py and its
siblings): a ScalerCore on a store, the in-memory coordinator and actuator, fake time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.scaler.support import report
from tests.support.poll import eventually
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.store import DecisionState, DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator

T0 = 1_800_000_000.0
FAST = {"bucket_s": 10.0, "sustain_s": 30.0, "cooldown_s": 60.0, "scale_down_stabilization_s": 0.0}
PODS = ["uid-a-0"] * 4 + ["uid-a-1"] * 4
#: A real coordinator and actuator named, as ScalerSettings requires.
REAL: dict[str, Any] = {"coordinator": "127.0.0.1:9", "actuator": "local:/nonexistent"}
#: The same, as a process is given them.
REAL_ENV = {"TIDE_COORDINATOR": REAL["coordinator"], "TIDE_ACTUATOR": REAL["actuator"]}


@dataclass
class Rig:
    core: ScalerCore
    clock: FakeClock
    actuator: InMemoryActuator
    coordinator: InMemoryCoordinator
    store: DecisionStore


def make_rig(
    url: str, clock: FakeClock, owner: str = "s1", coordinator: InMemoryCoordinator | None = None
) -> Rig:
    """``coordinator``: one that outlived an earlier scaler; it now counts this one's pods."""
    actuator = InMemoryActuator(total_gpus=64)
    if coordinator is None:
        coordinator = InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    store = DecisionStore(db.make_engine(url), owner, clock)
    core = ScalerCore(
        store=store,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        ingest=IngestSettings(stagger_slots=False),
    )
    return Rig(core, clock, actuator, coordinator, store)


@pytest.fixture(name="rig")
async def rig_fixture(scaler_db_url: str) -> AsyncIterator[Rig]:
    r = make_rig(scaler_db_url, FakeClock(T0))
    await r.core.start()
    await r.core.upsert_job("ns/a", FAST, gpus_per_replica=4)
    await eventually(lambda: "uid-a-1" in r.core.registry.by_uid)
    yield r
    await r.core.close()
    r.store.engine.dispose()


def feed(rig: Rig, seconds: int, util: float, *, node: str = "n1", start_seq: int = 1) -> int:
    """One report per second of fake time from ``node``; returns the next seq."""
    st = rig.core.ingest.open_stream()
    seq = start_seq
    for _ in range(seconds):
        rig.clock.advance(1.0)
        rig.core.ingest.process(
            st, report(node, seq, t=rig.clock.now(), utils=[util] * 8, pods=PODS)
        )
        seq += 1
    rig.core.ingest.close_stream(st)
    return seq


async def final(rig: Rig, decision_id: int) -> DecisionState:
    for task in list(rig.core.controller.tasks.values()):
        await task
    detail = await rig.store.get_decision(decision_id)
    return detail.decision.state
