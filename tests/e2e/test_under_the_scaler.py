"""The job kinds beyond the data-parallel example, grown and shrunk by the scaler itself:
`tide demo`'s control plane (scaler with the local actuator, coordinator, mTLS on every
link), synthetic GPU load driving a grow 2 -> 4 and a shrink 4 -> 2, real launchers and
Paddle workers.

- a fleet script with AdamW's state sharded over the ranks (issue 26): ``tide demo
  --workload sharded``, as a user runs it;
- PaddleFormers' Trainer (issue 28): the tiny-Llama example script, paced so that the run
  lasts the demo (bench/frameworks_paced.py), in the venv that has PaddleFormers.

Each checks what really happened: the decisions the scaler stored, the worlds and sample
ids the workers logged (every sample once per epoch, no step twice), and for the sharded
job the degree each generation's workers sharded their optimizer over.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT
from tide.services.local.demo import Demo, DemoSettings
from tide.services.scaler.actuators.local import JobSpec
from tide.services.testing.parity import sharding_degrees
from tide.v1 import common_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]

# Shorter policy windows than the demo's 10 s: these tests are about the job kinds, and
# tests/local/test_demo.py runs the demo's own timings.
SUSTAIN_S = COOLDOWN_S = 4.0
WINDOWS = ("--sustain-s", str(SUSTAIN_S), "--cooldown-s", str(COOLDOWN_S))


@pytest.mark.timeout(300)
def test_a_fleet_sharded_job_is_grown_and_shrunk_by_the_scaler(tmp_path: Path) -> None:
    state = tmp_path / "tide"
    cmd = [
        sys.executable, "-m", "tide.services.cli", "demo", "--workload", "sharded",
        "--state-dir", str(state), "--plain", "--log-format", "json",
        *WINDOWS,
    ]  # fmt: skip
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-3000:]
    assert "(sharded example) on 2 workers" in out
    assert "decision 2: 2 → 4 (SUSTAINED_HIGH_UTILIZATION) COMPLETED" in out
    assert "decision 3: 4 → 2 (SUSTAINED_LOW_UTILIZATION) COMPLETED" in out
    assert "lost steps: 0" in out
    assert "every sample consumed exactly once" in out and "g1×2, g2×4, g3×2" in out
    # The workers did shard: every rank of each generation over that generation's world.
    degrees = sharding_degrees((state / "pods").rglob("*.log"))
    assert degrees == {
        1: {0: 2, 1: 2},
        2: {r: 4 for r in range(4)},
        3: {0: 2, 1: 2},
    }, degrees


class _PaddleFormersDemo(Demo):
    """The demo with the PaddleFormers example as its job (its data are fixed by the
    script: 256 sequences, a global batch of 8; DemoSettings audits with the same)."""

    def job_spec(self) -> JobSpec:
        paced = ROOT / "bench" / "frameworks_paced.py"
        return JobSpec(
            command=(
                sys.executable, str(paced), "--steps", "1000000",
                "--ckpt-dir", str(self.ckpt_dir.resolve()),
                "--log-dir", str(self.samples_dir.resolve()),
            ),
            env={"TIDE_BENCH_STEP_DELAY_S": "0.05"},
            cwd=str(ROOT),
        )  # fmt: skip


@pytest.mark.paddleformers
@pytest.mark.timeout(300)
async def test_a_paddleformers_trainer_is_grown_and_shrunk_by_the_scaler(
    tmp_path: Path,
) -> None:
    pytest.importorskip("paddleformers")
    state = tmp_path / "tide"
    settings = DemoSettings(
        state_dir=state,
        dataset_size=256,
        global_batch=8,
        log_format="json",
        sustain_s=SUSTAIN_S,
        cooldown_s=COOLDOWN_S,
    )
    lines: list[str] = []
    outcome = await _PaddleFormersDemo(settings, lambda snap: None, lines.append).run(
        asyncio.Event()
    )
    assert outcome.error == "", "\n".join(lines)
    moves = [
        (d.decision.from_replicas, d.decision.to_replicas) for d in outcome.decisions
        if d.decision.state == common_pb2.DECISION_STATE_COMPLETED
    ]  # fmt: skip
    assert moves == [(0, 2), (2, 4), (4, 2)], outcome.decisions
    assert outcome.lost_steps == 0
    assert outcome.audit is not None and outcome.audit.exactly_once, outcome.audit
    assert [w for _, w in outcome.audit.worlds] == [2, 4, 2]
    assert outcome.ok
