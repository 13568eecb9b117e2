"""The durable checkpoint's progress and lag in the job's status and metrics (issue 25,
item 4): rank 0's launcher reports, with each heartbeat, the newest checkpoint committed to
the durable store, the seconds from its snapshot to that commit and when it committed; the
coordinator carries the newest into JobStatus and the tide_coordinator_durable_checkpoint_*
gauges, whichever member reports it now."""

from __future__ import annotations

import pytest

from tests.coordinator.support import JOB, Env, form
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component


def _gauge(env: Env, name: str) -> float | None:
    value = env.coordinator.metrics.registry.get_sample_value(
        f"tide_coordinator_durable_checkpoint_{name}", {"job_id": JOB}
    )
    return value


async def test_the_newest_durable_checkpoint_and_its_lag_reach_the_status_and_gauges(
    env: Env,
) -> None:
    ls = await form(env, 2)
    st = await env.status()
    assert (st.durable_checkpoint_step, st.durable_checkpoint_lag_s) == (0, 0.0)
    assert not st.HasField("durable_checkpoint_at")
    assert _gauge(env, "lag_seconds") is None
    await env.heartbeat_all(steps=9)
    ls[0].last_checkpoint = 10
    ls[0].last_checkpoint_lag_s = 2.5
    ls[0].last_checkpoint_at = 1_700_000_123.0
    await ls[0].heartbeat(steps=0)
    st = await env.status()
    assert (st.durable_checkpoint_step, st.durable_checkpoint_lag_s) == (10, 2.5)
    assert st.durable_checkpoint_at.seconds == 1_700_000_123
    assert st.last_checkpoint_step == 10
    assert _gauge(env, "step") == 10
    assert _gauge(env, "lag_seconds") == 2.5
    assert _gauge(env, "timestamp_seconds") == 1_700_000_123.0
    # Another member's heartbeat (no durable checkpoint of its own) changes nothing.
    await ls[1].heartbeat()
    assert (await env.status()).durable_checkpoint_step == 10
    assert _gauge(env, "lag_seconds") == 2.5
    # A newer one, which lagged more: the newest counts, not the largest lag.
    ls[0].last_checkpoint, ls[0].last_checkpoint_lag_s = 20, 40.0
    ls[0].last_checkpoint_at = 1_700_000_200.0
    await ls[0].heartbeat(steps=10)
    st = await env.status()
    assert (st.durable_checkpoint_step, st.durable_checkpoint_lag_s) == (20, 40.0)
    assert (_gauge(env, "step"), _gauge(env, "lag_seconds")) == (20, 40.0)


async def test_a_member_that_reports_an_older_one_does_not_move_it_back(env: Env) -> None:
    """A launcher that was rank 0 of an earlier generation keeps reporting the checkpoint
    its worker wrote then; the newest one, from today's rank 0, stays the job's."""
    ls = await form(env, 2)
    ls[1].last_checkpoint, ls[1].last_checkpoint_lag_s = 30, 1.0
    await ls[1].heartbeat()
    ls[0].last_checkpoint, ls[0].last_checkpoint_lag_s = 10, 9.0
    await ls[0].heartbeat()
    st = await env.status()
    assert (st.durable_checkpoint_step, st.durable_checkpoint_lag_s) == (30, 1.0)
    assert _gauge(env, "lag_seconds") == 1.0
    assert [m.phase for m in st.members] == [pb.WORKER_PHASE_RUNNING] * 2
