"""The durable checkpoint's progress and lag in the job's status, with real launchers and
Paddle workers (issue 25, item 4): rank 0 writes each checkpoint to the durable store in the
background (a resize's barrier checkpoint after the pause, from memory), reports its lag
(snapshot to commit) to its launcher, and the heartbeats carry it to the coordinator's
JobStatus. tests/coordinator/test_durable_status.py covers the gauges."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tide.services.testing.localjob import LocalJob
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

STEPS = 100
TRAIN = [
    "--steps", str(STEPS), "--dataset-size", "400", "--global-batch", "32",
    "--step-delay-s", "0.05", "--ckpt-every-steps", "25",
]  # fmt: skip


@pytest.mark.timeout(240)
async def test_the_durable_checkpoint_and_its_lag_reach_the_job_status(tmp_path: Path) -> None:
    job = LocalJob(tmp_path / "job", TRAIN)
    job.start_coordinator()
    try:
        for i in range(3):
            job.add_pod(i)
        await job.wait_standby(3, timeout_s=120)
        started = time.time()
        assert (await job.resize(2))[-1].phase == pb.RESIZE_PHASE_COMPLETED
        st = await job.wait_status(lambda s: s.step >= 10, 60, "10 steps")
        assert st.durable_checkpoint_step == 0 and not st.HasField("durable_checkpoint_at")
        final = (await job.resize(3))[-1]
        assert final.phase == pb.RESIZE_PHASE_COMPLETED, final.message
        at = final.checkpoint_step
        # The barrier's checkpoint went to the new generation from memory; its durable copy
        # commits after the pause and is reported then.
        st = await job.wait_status(
            lambda s: s.durable_checkpoint_step >= at, 60, f"step {at} durable"
        )
        assert st.durable_checkpoint_lag_s > 0
        assert started <= st.durable_checkpoint_at.ToSeconds() <= time.time()
        st = await job.wait_status(lambda s: s.finished, 120, "the job finished")
        # The final checkpoint, written by session.finish(), is the job's last durable one.
        assert (st.step, st.durable_checkpoint_step, st.last_checkpoint_step) == (STEPS,) * 3
        assert st.durable_checkpoint_lag_s > 0
    finally:
        await job.close()
