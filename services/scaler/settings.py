"""Settings of `python -m services.scaler` (flags, TIDE_* env, YAML file).

The default policy's fields are PolicySettings' own defaults (services/scaler/
policy.py writes each once); here they only get their flag and help text.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from dataclasses import dataclass

from services.common.config import CommonSettings, setting
from services.scaler.actuators import parse_actuator
from services.scaler.ingest import IngestSettings
from services.scaler.policy import PolicySettings
from tidebase.errors import ConfigError

_POLICY = PolicySettings()
_INGEST = IngestSettings()

#: The store every Tide service shares when run from one directory (`tide up` uses its own).
DEFAULT_DB = "sqlite:///.tide/tide.db"

#: GIL switch interval of the scaler process, seconds. SQL runs in worker threads
#: so ingestion never waits on the database; with the loop thread busy, each time
#: such a thread wants the GIL back it waits up to this long (default 5 ms), and a
#: transaction takes it back a dozen times: that, not SQL, was most of the decision
#: latency under load (bench/ingest).
SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ScalerSettings(CommonSettings):
    """Settings of `python -m services.scaler`."""

    db: str = setting(
        DEFAULT_DB, "SQLAlchemy URL of the store (SQLite file, its directory made if missing)"
    )
    coordinator: str = setting("", "coordinator HOST:PORT (required)")
    actuator: str = setting(
        "",
        "how pods are started and stopped (required): local:DIR (trainer launchers on this"
        " machine, state under DIR), or kubernetes:in-cluster|KUBECONFIG (PaddleJobs)",
    )
    kube_namespaces: str = setting(
        "",
        "with the kubernetes actuator: the namespaces (comma-separated) whose PaddleJobs"
        " are watched and resized; empty: all",
    )
    total_gpus: int = setting(0, "GPUs the actuator offers; 0 means unknown")
    owner_id: str = setting("", "this scaler's name in the fencing record; default host:pid")
    evaluate_interval_s: float = setting(1.0, "every job is evaluated at least this often")
    rollup_flush_interval_s: float = setting(15.0, "how often finished minutes go to SQL")
    rollup_retention_days: float = setting(
        30.0, "rollups older than this are deleted (checked on every flush)"
    )
    utilization_detail_retention_days: float = setting(
        7.0,
        "each minute's per-second utilization (what `tide whatif` replays) is deleted after"
        " this long; at most rollup_retention_days",
    )
    stale_after_s: float = setting(
        _INGEST.stale_after_s, "a GPU without a sample for this long is stale"
    )
    max_gpus_per_node: int = setting(
        _INGEST.max_gpus_per_node, "reports with more GPUs end their stream"
    )
    max_clock_skew_s: float = setting(
        _INGEST.max_clock_skew_s, "reports further in the future are dropped"
    )
    report_interval_s: float = setting(
        _INGEST.report_interval_s, "asked of agents in acks; 0 keeps theirs"
    )
    scale_up_utilization_pct: float = setting(
        _POLICY.scale_up_utilization_pct, "default policy: see docs/policy.md"
    )
    scale_down_utilization_pct: float = setting(
        _POLICY.scale_down_utilization_pct, "default policy"
    )
    target_utilization_pct: float = setting(_POLICY.target_utilization_pct, "default policy")
    sustain_s: float = setting(_POLICY.sustain_s, "default policy")
    bucket_s: float = setting(_POLICY.bucket_s, "default policy")
    cooldown_s: float = setting(_POLICY.cooldown_s, "default policy")
    phase_timeout_s: float = setting(
        _POLICY.phase_timeout_s, "default policy: each resize phase's deadline"
    )
    min_replicas: int = setting(_POLICY.min_replicas, "default policy")
    max_replicas: int = setting(_POLICY.max_replicas, "default policy")
    min_coverage: float = setting(_POLICY.min_coverage, "default policy")
    max_step: int = setting(_POLICY.max_step, "default policy")
    scale_down_stabilization_s: float = setting(
        _POLICY.scale_down_stabilization_s, "default policy"
    )
    min_scale_up_efficiency: float = setting(
        _POLICY.min_scale_up_efficiency, "default policy: the goodput guard (0 turns it off)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.db:
            raise ConfigError("db: a database URL is required, got ''")
        self.policy()
        self.ingest()
        if not (self.evaluate_interval_s > 0 and math.isfinite(self.evaluate_interval_s)):
            raise ConfigError(f"evaluate_interval_s={self.evaluate_interval_s!r}: must be > 0")
        if not (self.rollup_flush_interval_s > 0):
            raise ConfigError(
                f"rollup_flush_interval_s={self.rollup_flush_interval_s!r}: must be > 0"
            )
        if not (self.rollup_retention_days > 0 and math.isfinite(self.rollup_retention_days)):
            raise ConfigError(f"rollup_retention_days={self.rollup_retention_days!r}: must be > 0")
        detail = self.utilization_detail_retention_days
        if not (0 < detail <= self.rollup_retention_days):
            raise ConfigError(
                f"utilization_detail_retention_days={detail!r}: must be > 0 and at most"
                f" rollup_retention_days={self.rollup_retention_days!r}"
            )
        if self.total_gpus < 0:
            raise ConfigError(f"total_gpus={self.total_gpus!r}: must be >= 0")
        self.check_coordinator()
        self.check_actuator()

    def check_coordinator(self) -> None:
        # A scaler without a real coordinator would record resizes nobody carried out.
        if not self.coordinator:
            raise ConfigError(
                "coordinator: required; pass --coordinator HOST:PORT (the coordinator's"
                " gRPC address, TIDE_COORDINATOR)"
            )
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"coordinator: expected HOST:PORT, got {self.coordinator!r}")

    def check_actuator(self) -> None:
        # No default: an actuator that changes nothing must never be the one a
        # production scaler runs with by accident.
        parse_actuator(self.actuator)

    def policy(self) -> PolicySettings:
        names = {f.name for f in dataclasses.fields(PolicySettings)}
        return PolicySettings(**{n: getattr(self, n) for n in names})

    def ingest(self) -> IngestSettings:
        return IngestSettings(
            max_gpus_per_node=self.max_gpus_per_node,
            max_clock_skew_s=self.max_clock_skew_s,
            stale_after_s=self.stale_after_s,
            report_interval_s=self.report_interval_s,
        )

    def namespaces(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.kube_namespaces.split(",") if n.strip())

    def owner(self) -> str:
        return self.owner_id or f"{socket.gethostname()}:{os.getpid()}"
