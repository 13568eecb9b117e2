"""The lifecycles' tables and the pure rules, case by case."""

from __future__ import annotations

import dataclasses

import pytest

from tide.base.errors import ConfigError
from tide.base.lifecycle import InvalidTransition
from tide.services.coordinator.domain import (
    MEMBER_TRANSITIONS,
    RESIZE_TRANSITIONS,
    Breakdown,
    Member,
    MemberState,
    Resize,
    ResizePhase,
    StepRate,
    choose_checkpoint_step,
    choose_leaving,
    measure_pause,
    rank_order,
    rendezvous_for,
    transition_member,
    transition_resize,
)
from tide.services.coordinator.settings import DEFAULT_DB, CoordinatorSettings, Tuning

pytestmark = pytest.mark.unit

M = MemberState
R = ResizePhase


def _member(index: int, rank: int | None = None, state: MemberState = M.ACTIVE) -> Member:
    return Member(
        member_id=f"m{index}",
        job_id="ns/j",
        pod_name=f"p-{index}",
        pod_index=index,
        pod_uid="",
        host=f"h{index}",
        launcher_id=f"l{index}",
        free_port=1000 + index,
        state=state,
        registered_at=0.0,
        rank=rank,
    )


def _resize(phase: ResizePhase) -> Resize:
    return Resize(
        decision_id=1,
        job_id="ns/j",
        target_world_size=2,
        min_world_size=2,
        leaving_pods=(),
        deadline_s=10.0,
        phase=phase,
        from_generation=1,
        started_at=0.0,
        phase_started_at=0.0,
    )


MEMBER_CASES = [
    (M.STANDBY, M.ACTIVE, True),
    (M.STANDBY, M.GONE, True),
    (M.STANDBY, M.DRAINING, False),
    (M.ACTIVE, M.DRAINING, True),
    (M.ACTIVE, M.GONE, True),
    (M.ACTIVE, M.STANDBY, True),
    (M.DRAINING, M.GONE, True),
    (M.DRAINING, M.ACTIVE, False),
    (M.GONE, M.STANDBY, False),
    (M.GONE, M.ACTIVE, False),
]


@pytest.mark.parametrize(
    ("old", "new", "allowed"), MEMBER_CASES, ids=[f"{a.name}->{b.name}" for a, b, _ in MEMBER_CASES]
)
def test_member_transitions(old: MemberState, new: MemberState, allowed: bool) -> None:
    m = _member(0, state=old)
    if allowed:
        transition_member(m, new)
        assert m.state == new
    else:
        with pytest.raises(InvalidTransition, match=f"{old.name} -> {new.name}"):
            transition_member(m, new)
        assert m.state == old


RESIZE_CASES = [
    (R.WAITING_FOR_MEMBERS, R.CHECKPOINTING, True),
    (R.WAITING_FOR_MEMBERS, R.RENDEZVOUS, True),
    (R.WAITING_FOR_MEMBERS, R.PREPARING, True),
    (R.PREPARING, R.CHECKPOINTING, True),
    (R.PREPARING, R.ABORTED, True),
    # Never past the barrier without one: g's state must be held before g+1 runs.
    (R.PREPARING, R.RENDEZVOUS, False),
    (R.CHECKPOINTING, R.PREPARING, False),
    (R.CHECKPOINTING, R.RENDEZVOUS, True),
    (R.CHECKPOINTING, R.ABORTED, True),
    (R.CHECKPOINTING, R.COMPLETED, False),
    (R.RENDEZVOUS, R.COMPLETED, True),
    (R.RENDEZVOUS, R.FAILED, True),
    # Leavers are exiting and g+1 is forming: the old generation cannot resume.
    (R.RENDEZVOUS, R.ABORTED, False),
    (R.COMPLETED, R.ABORTED, False),
    (R.ABORTED, R.CHECKPOINTING, False),
    (R.FAILED, R.RENDEZVOUS, False),
]


@pytest.mark.parametrize(
    ("old", "new", "allowed"), RESIZE_CASES, ids=[f"{a.name}->{b.name}" for a, b, _ in RESIZE_CASES]
)
def test_resize_transitions(old: ResizePhase, new: ResizePhase, allowed: bool) -> None:
    r = _resize(old)
    if allowed:
        transition_resize(r, new, at=5.0)
        assert (r.phase, r.phase_started_at) == (new, 5.0)
        assert r.finished_at == (5.0 if new.final else 0.0)
    else:
        with pytest.raises(InvalidTransition):
            transition_resize(r, new, at=5.0)
        assert r.phase == old


def test_every_phase_reaches_a_final_phase() -> None:
    # "Never in limbo": from every phase some path leads to COMPLETED, ABORTED or FAILED.
    for start in ResizePhase:
        seen, todo = {start}, [start]
        while todo:
            for nxt in RESIZE_TRANSITIONS.allowed(todo.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert any(p.final for p in seen), start
    assert RESIZE_TRANSITIONS.final_states == {p for p in ResizePhase if p.final}
    assert MEMBER_TRANSITIONS.final_states == {M.GONE}


def test_a_shrink_has_no_phase_of_its_own() -> None:
    # The leavers drain inside RENDEZVOUS; the proto's DRAINING value is not a phase.
    assert "DRAINING" not in ResizePhase.__members__


def test_a_legacy_draining_row_loads_as_a_barrier_the_restart_rules_abort() -> None:
    """A row an older coordinator stored in DRAINING must not strand its stayers at
    the barrier: it loads as CHECKPOINTING, whose restart rule aborts it (resuming
    the stayers; tests/coordinator/test_phases_barrier.py covers that rule)."""
    from tide.services.coordinator.sql_store import _phase

    assert _phase("DRAINING") is ResizePhase.CHECKPOINTING
    assert all(_phase(p.name) is p for p in ResizePhase)


@pytest.mark.parametrize(
    ("steps", "rates", "min_lead", "lead_s", "expected"),
    [
        ([10, 12], [0.0, 0.0], 2, 6.0, 14),  # no rate known: the minimum lead
        ([10, 12], [2.0, 3.0], 2, 6.0, 30),  # fastest rate 3/s over 6 s: 18 ahead
        ([100], [0.1], 3, 6.0, 103),  # slow job: the minimum wins
        ([], [], 2, 6.0, 2),  # nobody reported yet
    ],
    ids=["no-rate", "fastest-rate", "slow", "empty"],
)
def test_checkpoint_step_is_ahead_of_every_member(
    steps: list[int], rates: list[float], min_lead: int, lead_s: float, expected: int
) -> None:
    got = choose_checkpoint_step(steps, rates, min_lead_steps=min_lead, lead_s=lead_s)
    assert got == expected


def test_step_rate_is_measured_over_a_window_not_between_two_close_heartbeats() -> None:
    rate = StepRate()
    assert rate.observe(1, 10, 100.0) == 0.0  # the anchor
    # A phase change reported 10 ms after a heartbeat, one step later: not 100 steps/s.
    assert rate.observe(1, 11, 100.01) == 0.0
    assert rate.observe(1, 22, 101.0) == pytest.approx(12.0)
    assert rate.observe(1, 23, 101.01) == pytest.approx(12.0)
    # A new generation restarts from a checkpoint: the rate carries, the span does not.
    assert rate.observe(2, 15, 130.0) == pytest.approx(12.0)
    assert rate.observe(2, 25, 131.0) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("n_leave", "named", "expected"),
    [
        (1, (), ["p-3"]),
        (2, (), ["p-3", "p-2"]),
        (1, ("p-0",), ["p-0"]),
        (2, ("p-1",), ["p-1", "p-3"]),
        (1, ("p-0", "p-1"), ["p-1"]),  # more named than leave: highest named first
        (0, ("p-0",), []),
    ],
)
def test_choose_leaving(n_leave: int, named: tuple[str, ...], expected: list[str]) -> None:
    actives = [_member(i, rank=i) for i in range(4)]
    assert [m.pod_name for m in choose_leaving(actives, n_leave, named)] == expected


def test_choose_leaving_matches_a_named_uid() -> None:
    """The agent names a pod by its uid where the launcher sent one (docs/preemption.md)."""
    actives = [dataclasses.replace(_member(i, rank=i), pod_uid=f"u{i}") for i in range(4)]
    assert [m.pod_name for m in choose_leaving(actives, 1, ("u1",))] == ["p-1"]
    assert [m.pod_name for m in choose_leaving(actives, 2, ("u0", "p-2"))] == ["p-2", "p-0"]


def test_rank_order_keeps_stayers_order_then_newcomers_by_index() -> None:
    stayers = [_member(5, rank=1), _member(2, rank=0), _member(9, rank=3)]
    newcomers = [_member(7, state=M.STANDBY), _member(4, state=M.STANDBY)]
    order = rank_order(stayers, newcomers)
    assert [m.pod_index for m in order] == [2, 5, 9, 4, 7]
    infos = rendezvous_for(order, generation=4, restore_step=30)
    assert [i.rank for i in infos] == [0, 1, 2, 3, 4]
    assert {i.master_endpoint for i in infos} == {"h2:1002"}
    assert infos[3].trainer_endpoints[3] == "h4:1004"
    assert {(i.generation, i.world_size, i.restore_step) for i in infos} == {(4, 5, 30)}


def test_pause_runs_from_last_hold_to_last_first_step() -> None:
    pause, b = measure_pause(
        held_at_latest=100.0,
        checkpoint_write_s=0.3,
        rendezvous_sent_at=100.5,
        first_steps_at=[102.0, 102.6],
        startups=[Breakdown(worker_restart_s=0.02, group_init_s=0.4, restore_s=0.1)] * 2,
    )
    assert pause == pytest.approx(2.6)
    assert b.barrier_s == pytest.approx(0.2)
    assert (b.checkpoint_write_s, b.group_init_s) == (0.3, 0.4)
    assert measure_pause(
        held_at_latest=0.0,
        checkpoint_write_s=0.0,
        rendezvous_sent_at=1.0,
        first_steps_at=[2.0],
        startups=[],
    ) == (0.0, Breakdown())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"heartbeat_timeout_s": 0.0}, "heartbeat_timeout_s"),
        ({"phase_timeout_s": 0.0}, "phase_timeout_s"),
        ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s"),
        ({"heartbeat_interval_s": 60.0, "heartbeat_timeout_s": 30.0}, "heartbeat_interval_s"),
        ({"checkpoint_min_lead_steps": 0}, "checkpoint_min_lead_steps"),
        ({"checkpoint_lead_s": -1.0}, "checkpoint_lead_s"),
        ({"tick_interval_s": 0.0}, "tick_interval_s"),
    ],
)
def test_bad_tuning_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Tuning(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        CoordinatorSettings(**kwargs)  # type: ignore[arg-type]


def test_a_checkpoint_lead_not_above_the_heartbeat_interval_is_flagged() -> None:
    assert Tuning().lead_problem() == ""  # defaults: 6 s lead, 5 s interval
    problem = Tuning(checkpoint_lead_s=5.0, heartbeat_interval_s=5.0).lead_problem()
    assert "checkpoint_lead_s (5.0)" in problem and "heartbeat_interval_s (5.0)" in problem


def test_settings_build_the_tuning_from_their_fields_and_share_its_defaults() -> None:
    settings = CoordinatorSettings(heartbeat_timeout_s=20.0, phase_timeout_s=90.0)
    assert settings.tuning() == Tuning(heartbeat_timeout_s=20.0, phase_timeout_s=90.0)
    assert CoordinatorSettings().tuning() == Tuning()


def test_the_default_store_is_the_readme_one() -> None:
    assert CoordinatorSettings().db == DEFAULT_DB == "sqlite:///.tide/tide.db"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"leader_election": "kubernetes"}, "leader_election"),
        ({"lease_name": ""}, "lease_name"),
        ({"lease_duration_s": 0.0}, "lease_duration_s"),
        ({"lease_duration_s": 2.0, "lease_renew_s": 2.0}, "lease_renew_s"),
    ],
)
def test_leader_election_settings_name_their_bad_value(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        CoordinatorSettings(**kwargs)  # type: ignore[arg-type]


def test_replicas_elect_on_the_coordinators_own_lease() -> None:
    s = CoordinatorSettings(leader_election="sql", owner_id="c-0")
    assert (s.lease_name, s.owner()) == ("tide-coordinator", "c-0")
    assert s.lease().duration_s == s.lease_duration_s
