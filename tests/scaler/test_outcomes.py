"""What the scaler records is what happened: a too-late abort's real outcome, the
in-memory coordinator saying so, only ACTIVE members' GPUs, rollup retention,
and a production binary that refuses to start without a real coordinator."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.scaler.support import report
from tests.support.procs import ROOT
from tide.base.errors import ConfigError, Unavailable
from tide.services.scaler import store as repo
from tide.services.scaler.actuators import owner_epoch
from tide.services.scaler.coordination import Phase, Progress, ResizeSpec
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.members import Member
from tide.services.scaler.rollup_writer import RETENTION_EVERY_S, RollupWriter
from tide.services.scaler.store import DecisionState, DecisionStore, RollupRecord
from tide.services.scaler.windows import Rollups
from tide.services.store import db
from tide.services.testing.actuators import InMemoryActuator, ReplicaChange
from tide.services.testing.clock import FakeClock
from tide.services.testing.coordinator import NOTHING_MOVED, InMemoryCoordinator, follow_actuator
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import coordinator_pb2 as cpb

pytestmark = pytest.mark.component

T0 = 1_800_000_000.0
JOB = "ns/a"


class LateAbortCoordinator(InMemoryCoordinator):
    """Its Resize stream never gets through; AbortResize answers "too late", and
    meanwhile the resize went ahead with ``world`` members (fewer than asked)."""

    def __init__(self, world: int, abort_answer: Phase) -> None:
        super().__init__()
        self.world = world
        self.abort_answer = abort_answer
        self.aborts = 0

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:  # type: ignore[override]
        raise Unavailable("coordinator unreachable")
        yield  # pragma: no cover  (an async generator)

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase:
        self.aborts += 1
        self.set_job(job_id, self.world, generation=7)
        return self.abort_answer


async def _core(url: str, clock: FakeClock, coordinator: InMemoryCoordinator) -> ScalerCore:
    actuator = InMemoryActuator()
    follow_actuator(coordinator, actuator)
    core = ScalerCore(
        store=DecisionStore(db.make_engine(url), "s", clock),
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        ingest=IngestSettings(stagger_slots=False),
    )
    await core.start()
    # A short phase deadline: the controller gives up after 3 x it + 30 s of fake time.
    await core.upsert_job(JOB, {"phase_timeout_s": 1.0})
    return core


async def _drive(core: ScalerCore, clock: FakeClock, decision_id: int) -> None:
    task = core.controller.tasks[decision_id]
    while not task.done():
        clock.advance(1.0)  # the controller waits on the clock between attempts
        await asyncio.sleep(0.001)
    await task


@pytest.mark.parametrize("answer", [Phase.COMPLETED, Phase.RENDEZVOUS])
async def test_a_too_late_abort_records_the_real_world_size(
    scaler_db_url: str, answer: Phase
) -> None:
    """Asked 2 -> 4, the coordinator went ahead with 3: the replicas come down to 3
    and the decision records 3 and the real generation, not a made-up full grow."""
    clock = FakeClock(T0)
    coordinator = LateAbortCoordinator(world=3, abort_answer=answer)
    core = await _core(scaler_db_url, clock, coordinator)
    actuator = core.actuator
    assert isinstance(actuator, InMemoryActuator)
    d = await core.request_resize(JOB, 4, "grow", "t")
    await _drive(core, clock, d.id)
    rec = (await core.store.get_decision(d.id)).decision
    assert rec.state is DecisionState.COMPLETED and coordinator.aborts == 1
    assert (rec.to_replicas, rec.generation) == (3, 7)
    assert actuator.changes == [ReplicaChange(JOB, 2, 4, d.id), ReplicaChange(JOB, 4, 3, d.id)]
    assert core.jobs[JOB].current_replicas == 3
    await core.close()
    core.store.engine.dispose()


class ReattachCoordinator(LateAbortCoordinator):
    """Unreachable until the abort; then Resize, re-attached by decision id, streams
    the resize's own final progress (generation 5), which differs from what the
    job's status would say (generation 7)."""

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:  # type: ignore[override]
        if not self.aborts:
            raise Unavailable("coordinator unreachable")
        yield Progress(spec.decision_id, Phase.RENDEZVOUS, generation=5, world_size=3)
        yield Progress(spec.decision_id, Phase.COMPLETED, generation=5, world_size=3)


async def test_a_too_late_abort_prefers_the_resizes_own_final_progress(
    scaler_db_url: str,
) -> None:
    """After a too-late abort the scaler re-attaches to the resize: its final
    progress is the outcome; the job's status is only the fallback."""
    clock = FakeClock(T0)
    coordinator = ReattachCoordinator(world=3, abort_answer=Phase.RENDEZVOUS)
    core = await _core(scaler_db_url, clock, coordinator)
    actuator = core.actuator
    assert isinstance(actuator, InMemoryActuator)
    d = await core.request_resize(JOB, 4, "grow", "t")
    await _drive(core, clock, d.id)
    rec = (await core.store.get_decision(d.id)).decision
    assert rec.state is DecisionState.COMPLETED and coordinator.aborts == 1
    assert (rec.to_replicas, rec.generation) == (3, 5)
    assert actuator.changes == [ReplicaChange(JOB, 2, 4, d.id), ReplicaChange(JOB, 4, 3, d.id)]
    await core.close()
    core.store.engine.dispose()


async def test_every_in_memory_outcome_says_nothing_moved(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    coordinator = InMemoryCoordinator()
    core = await _core(scaler_db_url, clock, coordinator)
    grow = await core.request_resize(JOB, 3, "grow", "t")
    await core.controller.tasks[grow.id]
    coordinator.fail_at[JOB] = Phase.CHECKPOINTING
    aborted = await core.request_resize(JOB, 4, "grow again", "t")
    await core.controller.tasks[aborted.id]
    done = await core.store.get_decision(grow.id)
    assert done.decision.state is DecisionState.COMPLETED
    assert NOTHING_MOVED in done.events[-1].detail
    # Nothing paused: no made-up pause either.
    assert done.decision.pause_s == 0.0
    failed = (await core.store.get_decision(aborted.id)).decision
    assert failed.state is DecisionState.ABORTED and NOTHING_MOVED in failed.error
    await core.close()
    core.store.engine.dispose()


class EpochRecordingActuator(InMemoryActuator):
    """Records the owner epoch each change is made under (owner_epoch())."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int | None] = []

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        self.epochs.append(owner_epoch())
        await super().set_replicas(job_id, replicas, decision_id=decision_id)


async def test_the_actuator_is_told_the_jobs_owner_epoch_with_each_change(
    scaler_db_url: str,
) -> None:
    """The Kubernetes actuator fences the PaddleJob by it (docs/reliability.md)."""
    clock = FakeClock(T0)
    coordinator = InMemoryCoordinator()
    core = await _core(scaler_db_url, clock, coordinator)
    recording = EpochRecordingActuator()
    core.controller.actuator = recording
    follow_actuator(coordinator, recording)
    for to in (3, 2):  # a grow, then a shrink (remove_pods falls back to set_replicas)
        d = await core.request_resize(JOB, to, "t", "t")
        await core.controller.tasks[d.id]
    epoch = core.store.epochs[JOB]
    assert epoch >= 1
    assert recording.epochs == [epoch, epoch]
    await core.close()
    core.store.engine.dispose()


async def test_a_shrink_has_no_draining_phase_and_abort_in_rendezvous_is_too_late() -> None:
    coordinator = InMemoryCoordinator(step_s=0.05)
    coordinator.set_job(JOB, 4)
    spec = ResizeSpec(decision_id=1, job_id=JOB, target_world_size=2, deadline_s=5.0)
    phases = [p.phase async for p in coordinator.resize(spec)]
    assert phases == [Phase.CHECKPOINTING, Phase.RENDEZVOUS, Phase.COMPLETED]
    spec2 = ResizeSpec(decision_id=2, job_id=JOB, target_world_size=1, deadline_s=5.0)
    stream = coordinator.resize(spec2)
    async for p in stream:
        if p.phase is Phase.RENDEZVOUS:
            assert await coordinator.abort_resize(2, JOB, "late") is Phase.RENDEZVOUS
            break
    final = [p async for p in coordinator.resize(spec2)][-1]
    assert final.phase is Phase.COMPLETED and coordinator.job(JOB) == (3, 1)


def test_only_active_members_gpus_count_toward_the_window() -> None:
    clock = FakeClock(T0)
    reg = InMemoryMemberRegistry()
    reg.set_members(
        JOB,
        [Member("a-0", "a-0"), Member("a-1", "a-1", active=False), Member("a-2", "a-2", False)],
    )
    engine = Ingest(IngestSettings(stagger_slots=False), reg, clock)
    st = engine.open_stream()
    pods = ["a-0"] * 4 + ["a-1"] * 2 + ["a-2"] * 2
    engine.process(st, report(seq=1, t=T0, utils=[80.0] * 4 + [0.0] * 4, pods=pods))
    # The standby newcomer (a-1) and the draining leaver (a-2) idle at 0 %: not the job's.
    assert engine.fresh_gpus(T0) == {JOB: 4}
    assert engine.window_view(JOB, T0, 4, 4).bucket_means[-1] == 80.0
    assert reg.member_count(JOB) == 1


async def test_rollup_retention_runs_from_the_flush(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    store = DecisionStore(db.make_engine(scaler_db_url), "s", clock)
    await store.upsert_job(JOB, min_replicas=1, max_replicas=2)
    now = db.utc_from_epoch(T0).replace(second=0, microsecond=0)
    old, recent = now - timedelta(days=31), now - timedelta(days=29)
    rows = [RollupRecord(JOB, m, 50.0, 40.0, 60.0, 10, 2) for m in (old, recent)]
    await store.write_rollups(rows)
    history = RollupWriter(store, Rollups(), clock, retention_days=30.0)
    assert await history.flush({JOB: 2}) == 0
    await history.settled()
    left = await store.rollups_between(JOB, old - timedelta(days=1), now)
    assert [r.minute for r in left] == [recent]
    # Not again before RETENTION_EVERY_S, then it is.
    await store.write_rollups([RollupRecord(JOB, old, 50.0, 40.0, 60.0, 10, 2)])
    await history.flush({JOB: 2})
    await history.settled()
    assert len(await store.rollups_between(JOB, old - timedelta(days=1), now)) == 2
    clock.advance(RETENTION_EVERY_S)
    await history.flush({JOB: 2})
    await history.settled()
    left = await store.rollups_between(JOB, old - timedelta(days=1), now)
    assert [r.minute for r in left] == [recent]
    store.engine.dispose()


async def test_per_second_detail_has_its_own_shorter_retention(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    store = DecisionStore(db.make_engine(scaler_db_url), "s", clock)
    now = db.utc_from_epoch(T0).replace(second=0, microsecond=0)
    counts = (1,) + (0,) * 59
    sums = (50.0,) + (0.0,) * 59
    rows = [
        RollupRecord(JOB, now - timedelta(days=d), 50.0, 50.0, 50.0, 1, 2, sums, counts)
        for d in (8, 6)
    ]
    await store.write_rollups(rows)
    history = RollupWriter(store, Rollups(), clock, retention_days=30.0, detail_retention_days=7)
    await history.flush({JOB: 2})
    await history.settled()
    assert len(await store.rollups_between(JOB, now - timedelta(days=9), now)) == 2
    kept = await store.seconds_between(JOB, now - timedelta(days=9), now)
    assert list(kept) == [now - timedelta(days=6)]
    store.engine.dispose()


class HeldStore(DecisionStore):
    """Its rollup deletes wait for ``go``: a retention pass that takes as long as we like."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.go = asyncio.Event()
        self.batches = 0

    async def delete_rollups_before(self, before: Any, *, limit: int | None = None) -> int:
        await self.go.wait()
        self.batches += 1
        return await super().delete_rollups_before(before, limit=limit)


async def test_retention_deletes_in_batches_beside_the_flush(scaler_db_url: str) -> None:
    clock = FakeClock(T0)
    store = HeldStore(db.make_engine(scaler_db_url), "s", clock)
    await store.upsert_job(JOB, min_replicas=1, max_replicas=2)
    epoch = await store.acquire(JOB)
    now = db.utc_from_epoch(T0).replace(second=0, microsecond=0)
    old = [now - timedelta(days=40, minutes=m) for m in range(5)]
    await store.write_rollups([RollupRecord(JOB, m, 50.0, 40.0, 60.0, 10, 2) for m in old])
    # Five old final decisions, one old decision still running, one recent final one.
    with db.session_scope(store.factory) as s:
        for i in range(7):
            days = 1 if i == 6 else 200
            at = now - timedelta(days=days, seconds=-i)
            d = repo.create_decision(
                s,
                job_id=JOB,
                from_replicas=1,
                to_replicas=2,
                reason="MANUAL",
                trigger="MANUAL",
                message="",
                inputs={},
                epoch=epoch,
                now=at,
                exclusive=False,
            )
            if i != 5:
                repo.transition_decision(
                    s, d.id, DecisionState.ABORTED, detail="", epoch=epoch, now=at
                )
    history = RollupWriter(
        store, Rollups(), clock, retention_days=30.0, decision_retention_days=180.0, batch_rows=2
    )
    # The flush returns while retention waits on the database.
    await history.flush({JOB: 2})
    assert history._task is not None and not history._task.done()
    store.go.set()
    assert await history.settled() == 5 + 5
    assert store.batches == 3  # 2 + 2 + 1 rows
    assert await store.rollups_between(JOB, now - timedelta(days=41), now) == []
    left = (await store.list_decisions(job_id=JOB, page_size=10)).decisions
    assert [(d.state, d.created_at < now - timedelta(days=180)) for d in left] == [
        (DecisionState.ABORTED, False),
        (DecisionState.PENDING, True),
    ]
    store.engine.dispose()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "coordinator: required; pass --coordinator HOST:PORT"),
        (["--coordinator", "127.0.0.1:9"], "pass --actuator local:DIR"),
        (["--coordinator", "127.0.0.1:9", "--actuator", "memory"], "expected local:DIR"),
    ],
)
def test_the_production_scaler_needs_a_real_coordinator_and_actuator(
    args: list[str], says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tide.services.scaler", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaler: ") and says in lines[0], lines


def test_the_test_entry_point_accepts_the_doubles_and_nothing_else(tmp_path: Path) -> None:
    from tide.services.testing.scaler import TestScalerSettings

    assert TestScalerSettings(coordinator="memory", actuator="memory").coordinator == "memory"
    TestScalerSettings(coordinator="memory", actuator=f"file:{tmp_path / 'log'}")
    TestScalerSettings(coordinator="127.0.0.1:9", actuator=f"local:{tmp_path}")
    with pytest.raises(ConfigError, match="--coordinator HOST:PORT is required"):
        TestScalerSettings(coordinator="memory", actuator=f"local:{tmp_path}")
    with pytest.raises(ConfigError, match="expected memory, file:PATH or local:DIR"):
        TestScalerSettings(coordinator="memory", actuator="file:")
    with pytest.raises(ConfigError, match="coordinator: required"):
        TestScalerSettings(actuator="memory")


def test_every_resize_phase_the_coordinator_can_send_is_known() -> None:
    # A phase added to the proto and not here failed every scaler-driven resize that
    # reached it (overlap mode's PREPARING did).
    sent = [v for v in cpb.ResizePhase.values() if v != cpb.RESIZE_PHASE_UNSPECIFIED]
    assert sorted(p.value for p in Phase) == sorted(sent)
