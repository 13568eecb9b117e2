"""The demo's set-up: the control plane it starts, the job it registers, the policy.

Its own room because these are the processes and flags the demo asks for (the
services' timings, the example trainer's command line, the scaler's windows), which
change with the services and the trainer, not with the scenario or the report.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tide import trainer
from tide.services.local.demo.settings import WORKLOADS, DemoSettings
from tide.services.local.up import UpSettings
from tide.services.scaler.actuators.local import JobSpec
from tide.v1 import scaler_pb2

ROOT = Path(trainer.__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "tide" / "trainer" / "examples"


def up_settings(s: DemoSettings) -> UpSettings:
    return UpSettings(
        state_dir=s.state_dir,
        scaler_listen="127.0.0.1:0",
        coordinator_listen="127.0.0.1:0",
        total_gpus=s.max_replicas,
        log_level="INFO",
        log_format=s.log_format,
        tls=s.tls,
        admin_token_file=s.admin_token_file,
        # Fast evaluation and short staleness, so the short windows act promptly.
        scaler_flags=(
            "--evaluate-interval-s",
            "0.5",
            "--rollup-flush-interval-s",
            "5",
            "--stale-after-s",
            "5",
        ),
        # Heartbeats every second and a short checkpoint lead keep the pause small.
        coordinator_flags=(
            "--heartbeat-interval-s",
            "1",
            "--checkpoint-lead-s",
            "1.5",
            "--heartbeat-timeout-s",
            "60",
        ),
    )


def job_spec(s: DemoSettings, samples_dir: Path, ckpt_dir: Path) -> JobSpec:
    """The example trainer's command line, checkpointing and logging its samples under the given dirs."""
    return JobSpec(
        command=(
            sys.executable,
            str(EXAMPLES / WORKLOADS[s.workload]),
            "--dataset-size",
            str(s.dataset_size),
            "--global-batch",
            str(s.global_batch),
            "--seed",
            str(s.seed),
            "--steps",
            "10000000",
            "--ckpt-dir",
            str(ckpt_dir.resolve()),
            "--ckpt-every-steps",
            "50",
            "--keep",
            "3",
            "--log-dir",
            str(samples_dir.resolve()),
            "--step-delay-s",
            str(s.step_delay_s),
        ),
        cwd=str(ROOT),
        gpus_per_replica=1,
    )


def policy(s: DemoSettings) -> scaler_pb2.Policy:
    return scaler_pb2.Policy(
        sustain_s=s.sustain_s,
        bucket_s=s.bucket_s,
        cooldown_s=s.cooldown_s,
        scale_down_stabilization_s=0.0,
        min_replicas=s.start_replicas,
        max_replicas=s.max_replicas,
        max_step=s.max_replicas,
        phase_timeout_s=60.0,
        # The demo shows the resize, on CPUs shared with whatever else runs here, where
        # 4 workers are often no faster than 2: the goodput guard would rightly revert
        # the grow (SLOWER_AFTER_SCALE_UP) before the low phase shrinks it.
        min_scale_up_efficiency=0.0,
    )
