"""The trainers users already have, end to end (issue 28): PaddleFormers' Trainer through a
grow and a shrink under a coordinator, against a fixed run; a stock-launch-style command
line (``python -m tide.trainer.launch --master ... --nnodes ... train.py``) training a job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.frameworks import DATASET, GLOBAL_BATCH, TIDE, live
from bench.parity import rel_diff
from tests.e2e.checks import check_exactly_once, final_losses
from tide.services.testing.localjob import ROOT, LocalJob, reference_run
from tide.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]
STEPS = 30


@pytest.mark.paddleformers
@pytest.mark.timeout(300)
async def test_a_paddleformers_trainer_follows_a_fixed_run_through_a_grow_and_a_shrink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("paddleformers")
    monkeypatch.setenv("TIDE_BENCH_STEP_DELAY_S", "0.1")
    resized, lost = await live(tmp_path / "live", STEPS, (1, 2, 1))
    assert lost == 0
    assert sorted(final_losses(resized)) == list(range(1, STEPS + 1))
    check_exactly_once(resized, DATASET, STEPS, DATASET // GLOBAL_BATCH)
    fixed = reference_run(tmp_path / "fixed", ["--steps", str(STEPS)], 2, example=str(TIDE))
    assert rel_diff(resized, fixed) <= 1e-5


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(180)
async def test_a_paddle_launch_command_line_trains_a_job(tmp_path: Path) -> None:
    job = LocalJob(tmp_path / "job", [])
    job.start_coordinator()
    script = ROOT / "tide" / "trainer" / "integrations" / "examples" / "train_dp_tide.py"
    cmd = [sys.executable, "-m", "tide.trainer.launch", "--master", f"127.0.0.1:{job.port}"]
    cmd += ["--nnodes", "1:2", "--nproc_per_node", "1", "--job_id", job.job_id]
    cmd += ["--log_dir", str(tmp_path / "logs"), "--elastic_level", "1", str(script)]
    cmd += ["--epochs", "1", "--ckpt-dir", str(tmp_path / "ckpt")]
    pod = _start(cmd)
    try:
        await job.wait_standby(1)
        assert (await job.resize(1))[-1].phase == pb.RESIZE_PHASE_COMPLETED
        assert pod.wait(timeout=120) == 0
        st = await job.wait_status(lambda s: s.finished, 30, "the job finished")
        assert st.step == 8  # 1 epoch of 256 samples in global batches of 32
        assert list((tmp_path / "logs").iterdir()), "--log_dir got the workers' logs"
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait()
        await job.close()
