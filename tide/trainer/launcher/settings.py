"""What one launcher is told: its coordinator, job, pod, command, and how it restarts things."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tide.base.client import channel_target
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.errors import ConfigError
from tide.base.grpc_options import DEFAULT_TIMEOUT_S
from tide.trainer.devices import Backend


@dataclass(frozen=True)
class LauncherSettings:
    coordinator: str
    job_id: str
    command: tuple[str, ...]
    pod_name: str = ""
    # The pod's uid ("": unknown); a pod name comes back with its replacement, a uid does not.
    pod_uid: str = ""
    pod_index: int = 0
    host: str = "127.0.0.1"
    state_dir: str = ""
    launcher_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Fork workers from a process that has imported Paddle (False: fresh processes).
    use_zygote: bool = True
    # Keep a worker forked ahead of time, waiting for the next RENDEZVOUS.
    prewarm: bool = True
    # Modules the zygote imports; None for its default (numpy, paddle, paddle.distributed).
    zygote_preload: str | None = None
    # How long a worker asked to exit gets before SIGKILL, seconds.
    exit_grace_s: float = 1.0
    # Collective backend: auto (nccl when the pod has GPUs, else gloo), nccl or gloo.
    backend: str = "auto"
    # Workers in this pod; 0: one per GPU under nccl, one on CPU (tide/trainer/devices.py).
    workers_per_pod: int = 0
    # Hand state to the pod's next worker in shared memory at a planned resize.
    handover: bool = True
    # On SIGTERM, ask the coordinator for a coordinated leave and wait this long for
    # the DRAIN before stopping anyway, seconds; 0: stop at once (docs/preemption.md).
    # Keep it under the pod's terminationGracePeriodSeconds.
    leave_grace_s: float = 0.0
    # How long a new worker may take to have its group and restore, seconds.
    start_timeout_s: float = 120.0
    # A pod of several workers whose first worker finished training waits this long for the
    # others to end by themselves (each may still write its slice's final checkpoint or the
    # script's own files) before stopping them, seconds.
    finish_wait_s: float = 120.0
    # Overlap mode on GPUs: a PREPARE is nacked (the coordinator falls back) unless each of
    # the pod's GPUs has this much memory free for the prepared worker next to the one that
    # trains, MiB; 0: no check (docs/trainer.md, "Overlap mode").
    prepare_min_free_mib: int = 0
    # The one backoff (tide.base.retry.Backoff) of the directive stream's reconnects, the
    # completion report's retries and the respawn of a dying prewarmed worker, seconds.
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    rpc_timeout_s: float = DEFAULT_TIMEOUT_S
    # How long a launcher whose workers finished keeps reporting it until the coordinator
    # has recorded it (a heartbeat answered only after its commit), seconds. It must outlast
    # a store outage the coordinator rides out: a launcher that exits unheard is silent, and
    # silence reads as a loss (docs/reliability.md, "A job that finishes during an outage").
    final_report_timeout_s: float = 600.0
    # Worker log files kept in the state folder (per local worker), the newest ones; live
    # workers' logs are always kept. A worker that crashes at every start adds one a try.
    worker_logs_kept: int = 10
    # What the launcher presents to the coordinator (its pod's identity).
    credentials: ClientCredentials = NO_CREDENTIALS

    def __post_init__(self) -> None:
        if ":" not in self.coordinator:
            raise ConfigError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        # Or IP:PORT,IP:PORT...: the coordinator's replicas, the leader found by health.
        channel_target(self.coordinator)
        if self.job_id.count("/") != 1 or not all(self.job_id.split("/")):
            raise ConfigError(f"job must be NAMESPACE/NAME, got {self.job_id!r}")
        if not self.command:
            raise ConfigError("command must be given after --, got nothing")
        Backend.parse(self.backend)
        if self.workers_per_pod < 0:
            raise ConfigError(f"workers_per_pod must be >= 0, got {self.workers_per_pod}")
        if self.pod_index < 0:
            raise ConfigError(f"pod_index must be >= 0, got {self.pod_index}")
        if self.prepare_min_free_mib < 0:
            raise ConfigError(
                f"prepare_min_free_mib must be >= 0, got {self.prepare_min_free_mib!r}"
            )
        for name in (
            "exit_grace_s",
            "start_timeout_s",
            "finish_wait_s",
            "backoff_initial_s",
            "rpc_timeout_s",
            "final_report_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_logs_kept < 1:
            raise ConfigError(f"worker_logs_kept must be >= 1, got {self.worker_logs_kept}")
        if not self.leave_grace_s >= 0:
            raise ConfigError(f"leave_grace_s must be >= 0, got {self.leave_grace_s}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(
                f"backoff_max_s must be >= backoff_initial_s, got {self.backoff_max_s}"
            )
