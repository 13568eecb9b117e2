"""The resize-phase table without gRPC: for each phase and each event, the effects.

Every (phase, event) pair has a case in CASES; test_every_pair_has_a_case fails when
a phase or an event is added without one. Each live phase's cases live with the tests of
its handler room (test_phases_waiting.py, test_phases_barrier.py,
test_phases_rendezvous.py); the final phases' are here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from tests.coordinator.builders import generation, job, resize
from tests.coordinator.phase_support import Case, E, P, Result, _any_ack, _ctx
from tests.coordinator.test_phases_barrier import checkpointing, preparing
from tests.coordinator.test_phases_rendezvous import rendezvous
from tests.coordinator.test_phases_waiting import waiting
from tide.base.errors import ConfigError
from tide.services.coordinator.domain import ResizePhase
from tide.services.coordinator.engine.effects import Effect, Recover
from tide.services.coordinator.engine.membership import check_heartbeat
from tide.services.coordinator.engine.outbox import MAX_PHASE_CHANGES
from tide.services.coordinator.engine.phases import PHASES, ResizeEvent, longest_chain
from tide.services.coordinator.errors import StaleGeneration
from tide.services.coordinator.settings import Tuning

pytestmark = pytest.mark.unit


def final(phase: ResizePhase, event: ResizeEvent) -> Result:
    """A final phase ignores every event; a loss of the generation re-forms it."""
    s = job()
    r = resize(s, phase)
    c, h = _ctx(s), PHASES[phase]
    calls: dict[ResizeEvent, Callable[[], list[Effect]]] = {
        E.ADVANCE: lambda: h.advance(c, r),
        E.DEADLINE: lambda: h.on_deadline(c, r),
        E.MEMBER_LOST: lambda: h.on_loss(c, r, ["m1"], True, "gone"),
        E.ABORT_REQUEST: lambda: h.on_abort_request(c, r, "x"),
        E.JOB_FINISHED: lambda: h.on_job_finished(c, r),
        E.RESTART: lambda: h.on_restart(c, r),
    }
    got = calls.get(event, lambda: h.on_ack(c, r, _any_ack(event)))()
    return got, [Recover("gone")] if event == E.MEMBER_LOST else []


HANDLERS = {
    P.WAITING_FOR_MEMBERS: waiting,
    P.PREPARING: preparing,
    P.CHECKPOINTING: checkpointing,
    P.RENDEZVOUS: rendezvous,
}


def _case(p: ResizePhase, e: ResizeEvent) -> Case:
    handler = HANDLERS.get(p)
    return (lambda: handler(e)) if handler is not None else (lambda: final(p, e))


CASES: dict[tuple[ResizePhase, ResizeEvent], Case] = {
    (p, e): _case(p, e)
    for p, e in itertools.product([*HANDLERS, P.COMPLETED, P.ABORTED, P.FAILED], list(ResizeEvent))
}


def test_every_pair_has_a_case() -> None:
    assert set(CASES) == set(itertools.product(ResizePhase, ResizeEvent))
    assert set(PHASES) == set(ResizePhase)


@pytest.mark.parametrize(
    ("phase", "event"), list(CASES), ids=[f"{p.name}-{e.name}" for p, e in CASES]
)
def test_phase_event(phase: ResizePhase, event: ResizeEvent) -> None:
    got, want = CASES[(phase, event)]()
    assert got == want


def test_the_phase_loop_is_bounded_by_the_longest_path_of_the_table() -> None:
    # WAITING_FOR_MEMBERS -> PREPARING -> CHECKPOINTING -> RENDEZVOUS -> COMPLETED
    assert longest_chain() == MAX_PHASE_CHANGES == 4


@pytest.mark.parametrize(("name", "value"), [("resize_mode", "fast"), ("prepare_fallback", "")])
def test_an_unknown_mode_is_refused_naming_the_value(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}: must be one of .*got '{value}'"):
        Tuning(**{name: value})


@pytest.mark.parametrize(
    ("reported", "named", "stale"),
    [
        (3, 3, False),  # the current one
        (3, 2, False),  # the one before: its RENDEZVOUS of 3 was in flight, or its last word
        (3, 1, True),  # left twice since
        (0, 0, False),  # a newcomer that never ran
    ],
)
def test_a_heartbeat_is_stale_only_for_a_generation_left_twice(
    reported: int, named: int, stale: bool
) -> None:
    s = job()
    for g in (2, 3):
        s.generations[g] = generation(g, ("m0", "m1"))
    m = s.members["m0"]
    m.reported_generation = reported
    if stale:
        with pytest.raises(StaleGeneration, match=f"generation {named}"):
            check_heartbeat(s, m, named)
    else:
        check_heartbeat(s, m, named)


def test_a_standby_that_ran_long_ago_may_report_that_generation() -> None:
    s = job()  # s0 ran in generation 1 only, then waited as a standby through 2 and 3
    s.generations[1] = generation(1, ("m0", "m1", "s0"))
    s.generations[3] = generation(3, ("m0", "m1"))
    s.members["s0"].reported_generation = 1
    check_heartbeat(s, s.members["s0"], 1)
