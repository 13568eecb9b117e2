"""Recovery rules and the outbox without gRPC: what a loss re-forms, what a last word
adds, and that a directive is visible only once the unit it depends on is committed."""

from __future__ import annotations

import logging

import pytest

from tests.coordinator.builders import generation, job, resize
from tide.base.errors import Unavailable
from tide.services.coordinator.domain import (
    Checkpoint,
    DirectiveKind,
    MemberState,
    ResizePhase,
    WorkerPhase,
)
from tide.services.coordinator.engine import Coordinator
from tide.services.coordinator.engine import effects as fx
from tide.services.coordinator.engine.membership import heartbeat
from tide.services.coordinator.engine.messages import HeartbeatInput, RegisterInput
from tide.services.coordinator.engine.outbox import Outbox
from tide.services.coordinator.engine.recovery import late_progress, overdue, plan_recovery
from tide.services.coordinator.engine.state import JobState
from tide.services.coordinator.metrics import CoordinatorMetrics
from tide.services.coordinator.settings import Tuning
from tide.services.coordinator.store import MemoryStore, Unit
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.unit

TUNING = Tuning(heartbeat_timeout_s=30.0)


def _good(s: JobState, step: int) -> None:
    s.checkpoints.append(Checkpoint("ns/j", step, 1, "d", True, 0.0, 0.0))


def test_a_loss_re_forms_the_survivors_from_the_newest_good_checkpoint() -> None:
    s = job()
    _good(s, 6)
    s.members["m1"].state, s.members["m1"].rank = MemberState.GONE, None
    # Generation 1 ran longer than restart_reset_after_s: the first re-form in a row.
    plan = plan_recovery(s, TUNING, "gone", now=TUNING.restart_reset_after_s)
    delay = TUNING.restart_backoff_initial_s
    assert plan.effects == [
        fx.OpenGeneration(("m0",), 6, "recovery: gone", 30.0 + delay, start_delay_s=delay),
        # Where g reached: the lost steps are counted from it once g+1 says what it restored.
        fx.RecordReached(2, 10),
    ]
    assert (plan.survivors, plan.restore_step, plan.reached_step, plan.restarts) == (1, 6, 10, 1)


def test_a_loss_of_everyone_clears_the_ranks_and_forms_nothing() -> None:
    s = job(standby=0)
    for m in s.members.values():
        m.state, m.rank = MemberState.GONE, None
    assert plan_recovery(s, TUNING, "gone", now=0.0).effects == [fx.ClearRanks()]


@pytest.mark.parametrize(
    ("step", "decision_id", "raised"),
    [(12, None, True), (10, None, False), (12, 7, False)],
    ids=["past-what-was-heard", "nothing-new", "g+1-of-a-resize"],
)
def test_a_last_word_raises_only_a_recoverys_reached_step(
    step: int, decision_id: int | None, raised: bool
) -> None:
    s = job()
    g2 = generation(2, ("m0",), decision_id=decision_id)
    g2.restore_step, g2.reached_step = 6, 10  # the recovery heard of step 10
    s.generations[2] = g2
    got = late_progress(s, "m0", 1, step)
    assert got == (fx.RecordReached(2, step, last_word_of="m0") if raised else None)


def _outbox(s: JobState, store: MemoryStore) -> Outbox:
    log = logging.LoggerAdapter(logging.getLogger("test"), {})
    return Outbox(s, store, FakeClock(), TUNING, CoordinatorMetrics(), log)


class RecordingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.saved: list[Unit] = []

    def save(self, unit: Unit) -> None:
        self.saved.append(unit)
        super().save(unit)


class FailingStore(MemoryStore):
    def save(self, unit: Unit) -> None:
        raise OSError("disk gone")


def test_a_directive_is_visible_only_after_its_unit_is_committed() -> None:
    s, store = job(), MemoryStore()
    out = _outbox(s, store)
    out.apply([fx.Send("m0", DirectiveKind.HOLD, 1, "why", 5.0)])
    assert s.pending_directives("m0") == []  # queued, not yet durable
    out.commit()
    (d,) = s.pending_directives("m0")
    assert (d.directive_id, d.kind, s.job.directive_seq) == ("d1", DirectiveKind.HOLD, 1)
    (snap,) = store.load_all()
    assert [x.directive_id for x in snap.directives] == ["d1"] and snap.job.directive_seq == 1


def test_a_failed_commit_sends_nothing_and_marks_the_job_for_a_reload() -> None:
    s = job()
    out = _outbox(s, FailingStore())
    out.apply([fx.Send("m0", DirectiveKind.HOLD, 1, "why", 5.0)])
    with pytest.raises(Unavailable, match="disk gone"):
        out.commit()
    assert out.broken and s.pending_directives("m0") == []


def test_the_unit_holds_exactly_what_the_effects_changed() -> None:
    s, store = job(), RecordingStore()
    r = resize(s, ResizePhase.WAITING_FOR_MEMBERS)
    out = _outbox(s, store)
    out.apply([fx.Abort(r.decision_id, "no")])
    out.commit()
    (unit,) = store.saved
    assert unit.resizes == [r] and r.phase == ResizePhase.ABORTED
    assert (unit.job, unit.members, unit.directives) == (None, [], [])


def test_a_directive_past_its_deadline_names_its_member_once() -> None:
    s, store = job(), MemoryStore()
    out = _outbox(s, store)
    out.apply(
        [
            fx.Send("m0", DirectiveKind.HOLD, 1, "a", 5.0),
            fx.Send("m0", DirectiveKind.RESUME, 1, "b", 5.0),
            fx.Send("m1", DirectiveKind.HOLD, 1, "c", 50.0),
        ]
    )
    out.commit()
    now = next(iter(s.directives.values())).created_at
    assert overdue(s, now + 10.0) == ("m0",)


def test_a_step_rate_starts_from_the_first_running_heartbeat_of_a_generation() -> None:
    s = job()
    s.job.generation = 2
    s.generations[2] = generation(2, ("m0", "m1"))
    m = s.members["m0"]
    m.steps_per_s = 9.0  # what generation 1 ran at

    def beat(phase: WorkerPhase, step: int, mono: float) -> float:
        heartbeat(s, HeartbeatInput("m0", 2, phase, step), 0.0, mono)
        return m.steps_per_s

    # The new worker is starting (step 0), then reports its restored step: neither counts.
    assert beat(WorkerPhase.STARTING, 0, 100.0) == 9.0
    assert beat(WorkerPhase.STARTING, 33, 100.5) == 9.0
    assert beat(WorkerPhase.RUNNING, 34, 100.7) == 9.0  # the anchor
    # 9 steps in 1 s, not 43 steps since the step-0 report.
    assert beat(WorkerPhase.RUNNING, 43, 101.7) == pytest.approx(9.0)
    assert beat(WorkerPhase.RUNNING, 55, 102.7) == pytest.approx(12.0)


def _register(c: Coordinator, pod: str) -> str:
    return c.register(
        RegisterInput(
            job_id="ns/standby",
            pod_name=pod,
            pod_index=0,
            host="127.0.0.1",
            launcher_id=f"l-{pod}",
            free_port=40000,
        )
    ).member_id


def test_a_standby_serves_nothing_until_it_takes_over_the_stored_jobs() -> None:
    store = MemoryStore()
    leader = Coordinator(store, FakeClock(), TUNING)
    member = _register(leader, "p-0")
    beat = HeartbeatInput(member_id=member, generation=0, phase=WorkerPhase.IDLE)

    standby = Coordinator(store, FakeClock(), TUNING)
    standby.standby = "following a at 10.0.0.1:50052 (lease epoch 1)"
    # UNAVAILABLE (retry), never NOT_FOUND (which makes a launcher register anew).
    for call in (
        lambda: standby.heartbeat(beat),
        lambda: standby.member_pod(member),
        lambda: _register(standby, "p-1"),
        lambda: standby.job("ns/standby"),
    ):
        with pytest.raises(Unavailable, match=r"following a at 10\.0\.0\.1:50052"):
            call()
    commits = store.commits
    standby.tick()
    assert store.commits == commits and standby.jobs == {}

    standby.take_over()
    assert standby.member_pod(member) == ("ns/standby", "p-0")
    standby.heartbeat(beat)
    # Woken past its lease before its elector noticed: it refuses and ticks nothing.
    standby.may_act = lambda: False
    with pytest.raises(Unavailable, match="lease ran out"):
        standby.heartbeat(beat)
    commits = store.commits
    standby.tick(stalled_s=1000.0)
    assert store.commits == commits
