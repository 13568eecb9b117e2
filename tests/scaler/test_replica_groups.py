"""Replicas in whole groups (``replica_multiple``, issue 26): a job whose model-parallel
group spans several pods only ever runs whole groups. Every rule of the policy that moves
a job (grow, shrink, stabilization, the goodput revert, preemption, the throughput
signal) lands on a multiple, says so where the rounding moved it, and a manual resize to
another size is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide.base.errors import ConfigError, InvalidArgument
from tide.services.scaler.policy import (
    History,
    JobState,
    PolicySettings,
    Reason,
    WindowView,
    decide,
    manual,
)

pytestmark = pytest.mark.unit

NOW = 100_000.0
G2 = PolicySettings(min_replicas=2, max_replicas=12, max_step=4, replica_multiple=2)


def window(mean: float, n: int = 10, gpus: int = 4) -> WindowView:
    return WindowView(
        bucket_s=30.0, end_s=NOW, bucket_means=(mean,) * n, gpus_expected=gpus, gpus_fresh=gpus
    )


@pytest.mark.parametrize("name", ["min_replicas", "max_replicas", "max_step"])
def test_bounds_and_step_must_be_whole_groups(name: str) -> None:
    kw = {"min_replicas": 2, "max_replicas": 8, "max_step": 4, name: 3}
    with pytest.raises(ConfigError, match=f"policy.{name}=3: must be a multiple of"):
        PolicySettings(replica_multiple=2, **kw)


def test_replica_multiple_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="replica_multiple"):
        PolicySettings(replica_multiple=0)


def test_a_grow_rounds_down_to_whole_groups_and_says_so() -> None:
    p = PolicySettings(min_replicas=4, max_replicas=16, max_step=8, replica_multiple=4)
    # ceil(8 x 90 / 60) = 12, a whole number of groups: nothing to say.
    d = decide(JobState("j", 8), window(90), p, History(), NOW)
    assert (d.reason, d.to_replicas) == (Reason.SUSTAINED_HIGH_UTILIZATION, 12)
    assert "whole groups" not in d.message
    # ceil(8 x 95 / 60) = 13 -> 12 (max_step 8 would allow 16).
    d = decide(JobState("j", 8), window(95), p, History(), NOW)
    assert d.to_replicas == 12
    assert "(not 13: replicas move in whole groups of 4)" in d.message


def test_a_grow_takes_at_least_one_whole_group() -> None:
    # ceil(2 x 81 / 60) = 3 -> one more group: 4.
    d = decide(JobState("j", 2), window(81), G2, History(), NOW)
    assert d.to_replicas == 4, d.message


def test_free_gpus_for_less_than_a_group_are_no_capacity() -> None:
    d = decide(JobState("j", 2, free_gpus=1), window(95), G2, History(), NOW)
    assert d.reason is Reason.NO_CAPACITY and not d.resize
    assert "1 free GPU(s) < 2 for a whole group of 2 replicas" in d.message


def test_free_gpus_cap_a_grow_at_whole_groups() -> None:
    # ceil(6 x 99 / 60) = 10; 3 free GPUs fit one more group, not a group and a half.
    d = decide(JobState("j", 6, free_gpus=3), window(99), G2, History(), NOW)
    assert d.to_replicas == 8 and "capped by 3 free GPU(s)" in d.message


def test_a_shrink_rounds_up_to_whole_groups_and_says_so() -> None:
    # ceil(6 x 30 / 60) = 3 -> 4.
    d = decide(JobState("j", 6), window(30), G2, History(), NOW)
    assert (d.reason, d.to_replicas) == (Reason.SUSTAINED_LOW_UTILIZATION, 4)
    assert "(not 3: replicas move in whole groups of 2)" in d.message


def test_a_preemption_takes_the_broken_group_with_it() -> None:
    job = JobState(
        "j", 6, terminating_replicas=1, terminating_node="n1", terminating_pods=frozenset({"p5"})
    )
    d = decide(job, window(60), G2, History(), NOW)
    assert (d.reason, d.to_replicas) == (Reason.NODE_TERMINATION, 4)
    assert "(not 5: replicas move in whole groups of 2)" in d.message


def test_a_preemption_of_the_last_group_is_not_a_planned_shrink() -> None:
    # Nothing whole is left to shrink to: the job loses the group (and restarts from its
    # checkpoint when pods come back), which no decision can prevent.
    job = JobState("j", 2, terminating_replicas=1, terminating_node="n1")
    d = decide(job, window(60), G2, History(), NOW)
    assert d.reason is not Reason.NODE_TERMINATION and not d.resize


def test_the_throughput_signal_grows_by_a_whole_group() -> None:
    p = PolicySettings(
        signal="throughput", min_replicas=2, max_replicas=8, max_step=4, replica_multiple=2
    )
    d = decide(JobState("j", 2), window(60), p, History(throughput=((2, 100.0),)), NOW)
    assert (d.reason, d.to_replicas) == (Reason.THROUGHPUT_GAINING, 4), d.message


def test_a_manual_resize_to_part_of_a_group_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="replicas=5 is not a multiple of the job's"):
        manual(JobState("j", 4), G2, 5, "ops")
    assert manual(JobState("j", 4), G2, 6, "ops").to_replicas == 6


@settings(max_examples=300, deadline=None)
@given(
    m=st.sampled_from([1, 2, 3, 4]),
    groups=st.integers(1, 4),
    mean=st.floats(0, 100),
    free=st.one_of(st.none(), st.integers(0, 20)),
    terminating=st.integers(0, 3),
    signal=st.sampled_from(["utilization", "throughput"]),
    tput=st.lists(st.tuples(st.integers(1, 16), st.floats(1, 1000)), max_size=4),
)
def test_every_resize_lands_on_whole_groups(
    m: int,
    groups: int,
    mean: float,
    free: int | None,
    terminating: int,
    signal: str,
    tput: list[tuple[int, float]],
) -> None:
    p = PolicySettings(
        signal=signal,
        min_replicas=m,
        max_replicas=4 * m,
        max_step=2 * m,
        replica_multiple=m,
        min_scale_up_efficiency=0.5,
    )
    cur = groups * m
    job = JobState("j", cur, free_gpus=free, terminating_replicas=terminating, terminating_node="n")
    hist = History(throughput=tuple(dict(tput).items()))
    d = decide(job, window(mean), p, hist, NOW)
    if d.resize:
        assert d.to_replicas % m == 0, d
        assert p.min_replicas <= d.to_replicas <= p.max_replicas or (
            d.reason is Reason.NODE_TERMINATION
        ), d
