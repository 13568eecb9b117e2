"""The barrier deadline of a preemption, planned from the node's notice (pure)."""

from __future__ import annotations

import pytest

from tide.services.scaler.preemption import (
    DEFAULT_CHECKPOINT_S,
    MIN_BARRIER_S,
    PlanReason,
    plan_notice,
)

pytestmark = pytest.mark.unit

NOW = 1000.0


def test_no_deadline_keeps_the_phase_timeout() -> None:
    p = plan_notice(60.0, None, NOW, 0.5)
    assert (p.barrier_deadline_s, p.reason) == (60.0, PlanReason.PHASE_TIMEOUT)


def test_a_far_deadline_keeps_the_phase_timeout() -> None:
    p = plan_notice(60.0, NOW + 120.0, NOW, 0.5)
    assert (p.barrier_deadline_s, p.reason) == (60.0, PlanReason.PHASE_TIMEOUT)


def test_a_near_deadline_less_a_margin_of_two_checkpoints() -> None:
    """The issue's case: the node goes in 30 s, the policy's 60 s would outlive it."""
    p = plan_notice(60.0, NOW + 30.0, NOW, 3.0)
    assert p.reason is PlanReason.NOTICE
    assert p.margin_s == 6.0 and p.barrier_deadline_s == pytest.approx(24.0)
    assert "30.0s left" in p.message


def test_an_unmeasured_checkpoint_is_assumed_long_and_a_fast_one_keeps_a_floor() -> None:
    assert plan_notice(60.0, NOW + 20.0, NOW, None).margin_s == 2 * DEFAULT_CHECKPOINT_S
    assert plan_notice(60.0, NOW + 20.0, NOW, 0.01).margin_s == 2.0


def test_too_little_time_puts_the_checkpoint_first() -> None:
    p = plan_notice(60.0, NOW + 4.0, NOW, 2.0)
    assert p.reason is PlanReason.CHECKPOINT_FIRST
    # All the time left: aborting the barrier before the node goes would lose more.
    assert p.barrier_deadline_s == pytest.approx(4.0)
    late = plan_notice(60.0, NOW - 5.0, NOW, 2.0)
    assert (late.reason, late.barrier_deadline_s) == (PlanReason.CHECKPOINT_FIRST, MIN_BARRIER_S)
