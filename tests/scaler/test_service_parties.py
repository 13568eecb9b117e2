"""The control loop when a party cannot be reached: the coordinator reattached, the
actuator retried and applied once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.scaler.service_rig import FAST, T0, Rig, final
from tide.base.errors import Unavailable
from tide.services.scaler.coordination import Progress, ResizeSpec
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.store import DecisionState, DecisionStore
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator, ReplicaChange
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator

pytestmark = pytest.mark.component


class FlakyCoordinator(InMemoryCoordinator):
    """Unreachable for the first ``failures`` Resize calls, then itself again."""

    def __init__(self, failures: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.failures = failures

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:  # type: ignore[override]
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable("coordinator restarting")
        async for p in super().resize(spec):
            yield p


async def test_unreachable_coordinator_is_reattached(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    actuator = InMemoryActuator()
    coordinator = FlakyCoordinator(3)
    follow_actuator(coordinator, actuator)
    store = DecisionStore(db.make_engine(scaler_db_url), "s", clock)
    core = ScalerCore(store=store, actuator=actuator, coordinator=coordinator, clock=clock)
    await core.start()
    await core.upsert_job("ns/a", FAST)
    dec = await core.request_resize("ns/a", 1 + 2, "x", "t")
    task = core.controller.tasks[dec.id]
    while not task.done():
        clock.advance(1.0)  # the controller waits on the clock between attempts
        await asyncio.sleep(0.01)
    assert (await task) is not None
    assert (
        await final(Rig(core, clock, actuator, coordinator, store), dec.id)
        is DecisionState.COMPLETED
    )
    assert len(coordinator.calls) == 1 and coordinator.failures == 0
    await core.close()
    store.engine.dispose()


class FlakyActuator(InMemoryActuator):
    """Its API server out of reach for the first ``failures`` replica changes."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable("Kubernetes API unreachable: ReadTimeoutError")
        await super().set_replicas(job_id, replicas, decision_id=decision_id)


async def test_an_unreachable_actuator_is_retried_and_applied_once(scaler_db_url: str) -> None:
    """T07's decision: it waits while the API server is out of reach (no FAILED, nothing
    applied), then the change is made once."""
    clock = FakeClock(T0)
    actuator = FlakyActuator(3)
    coordinator = InMemoryCoordinator()
    follow_actuator(coordinator, actuator)
    store = DecisionStore(db.make_engine(scaler_db_url), "s", clock)
    core = ScalerCore(store=store, actuator=actuator, coordinator=coordinator, clock=clock)
    await core.start()
    await core.upsert_job("ns/a", FAST)
    dec = await core.request_resize("ns/a", 3, "x", "t")
    task = core.controller.tasks[dec.id]
    while not task.done():
        clock.advance(1.0)  # the controller waits on the clock between attempts
        await asyncio.sleep(0.01)
    rig = Rig(core, clock, actuator, coordinator, store)
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    assert actuator.failures == 0
    assert [c for c in actuator.changes if c.decision_id == dec.id] == [
        ReplicaChange("ns/a", 2, 3, dec.id)
    ]
    await core.close()
    store.engine.dispose()
