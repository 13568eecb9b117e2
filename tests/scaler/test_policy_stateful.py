"""Hypothesis stateful test: whatever the load does, the policy never flaps and
never leaves the job's bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tide.services.scaler.policy import History, JobState, PolicySettings, WindowView, decide

pytestmark = pytest.mark.unit

BUCKET_S = 30.0


class PolicyMachine(RuleBasedStateMachine):
    """Drives decide() bucket by bucket with a load that reacts to the replica count
    (utilization = demand / replicas), records every resize and checks the invariants."""

    @initialize(
        lo=st.integers(1, 4),
        span=st.integers(0, 8),
        sustain_buckets=st.integers(1, 10),
        cooldown_buckets=st.integers(0, 12),
        stab_buckets=st.integers(0, 6),
        max_step=st.integers(1, 4),
        up=st.floats(60, 95),
        gap=st.floats(10, 50),
    )
    def setup(
        self,
        lo: int,
        span: int,
        sustain_buckets: int,
        cooldown_buckets: int,
        stab_buckets: int,
        max_step: int,
        up: float,
        gap: float,
    ) -> None:
        down = up - gap
        self.policy = PolicySettings(
            scale_up_utilization_pct=up,
            scale_down_utilization_pct=down,
            target_utilization_pct=(up + down) / 2,
            sustain_s=sustain_buckets * BUCKET_S,
            bucket_s=BUCKET_S,
            cooldown_s=cooldown_buckets * BUCKET_S,
            scale_down_stabilization_s=stab_buckets * BUCKET_S,
            min_replicas=lo,
            max_replicas=lo + span,
            max_step=max_step,
        )
        self.now = 1_000_000 * BUCKET_S
        self.replicas = lo
        self.means: list[float] = []
        self.resizes: list[tuple[float, int]] = []  # (decided at, direction)
        self.in_progress_until: float | None = None
        self.last_end: float | None = None
        self.last_dir = 0
        self.recs: list[tuple[float, int]] = []
        self.fresh_fraction = 1.0

    @rule(
        demand=st.floats(0, 1000),
        buckets=st.integers(1, 15),
        jitter=st.floats(0, 15),
        resize_buckets=st.integers(0, 3),
    )
    def run(self, demand: float, buckets: int, jitter: float, resize_buckets: int) -> None:
        for i in range(buckets):
            util = min(100.0, max(0.0, demand / self.replicas + (jitter if i % 2 else -jitter)))
            self.means.append(util)
            self.means = self.means[-20:]
            self.now += BUCKET_S
            self.step(resize_buckets)

    @rule(fraction=st.sampled_from([0.0, 0.5, 0.85, 1.0]))
    def agents_come_and_go(self, fraction: float) -> None:
        self.fresh_fraction = fraction

    @rule(buckets=st.integers(1, 5))
    def silence(self, buckets: int) -> None:
        for _ in range(buckets):
            self.means.append(math.nan)
            self.means = self.means[-20:]
            self.now += BUCKET_S
            self.step(0)

    def step(self, resize_buckets: int) -> None:
        if self.in_progress_until is not None and self.now >= self.in_progress_until:
            self.last_end = self.in_progress_until
            self.in_progress_until = None
        expected = self.replicas
        view = WindowView(
            bucket_s=BUCKET_S,
            end_s=self.now,
            bucket_means=tuple(self.means),
            gpus_expected=expected,
            gpus_fresh=math.floor(expected * self.fresh_fraction),
        )
        job = JobState("ns/j", self.replicas, resize_in_progress=self.in_progress_until is not None)
        hist = History(self.last_end, self.last_dir, tuple(self.recs))
        d = decide(job, view, self.policy, hist, self.now)
        if d.recommendation is not None:
            self.recs.append((self.now, d.recommendation))
            horizon = self.now - self.policy.scale_down_stabilization_s
            self.recs = [r for r in self.recs if r[0] >= horizon]
        if d.resize:
            self.resizes.append((self.now, d.direction))
            self.replicas = d.to_replicas
            self.last_dir = d.direction
            self.in_progress_until = self.now + resize_buckets * BUCKET_S
            if resize_buckets == 0:
                self.last_end = self.now
                self.in_progress_until = None

    @invariant()
    def within_bounds(self) -> None:
        if hasattr(self, "policy"):
            assert self.policy.min_replicas <= self.replicas <= self.policy.max_replicas

    @invariant()
    def no_flapping(self) -> None:
        if not hasattr(self, "policy"):
            return
        limit = self.policy.cooldown_s + self.policy.sustain_s
        for (t1, d1), (t2, d2) in zip(self.resizes, self.resizes[1:], strict=False):
            if d1 != d2:
                assert t2 - t1 >= limit, (t1, d1, t2, d2, limit)


PolicyMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=30, deadline=None, derandomize=True
)
test_policy_never_flaps = PolicyMachine.TestCase
