"""Settings of `python -m tide.services.scaler` (flags, TIDE_* env, YAML file).

The default policy is one grouped setting (``policy``, a PolicySettings: each of its
fields a flag of its own, its default written once in tide/services/scaler/policy_model.py).
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from tide.base.client import channel_target
from tide.base.errors import ConfigError
from tide.services.common.config import ClientSettings, CommonSettings, setting, setting_group
from tide.services.scaler.actuators import parse_actuator
from tide.services.scaler.ingest import IngestSettings
from tide.services.scaler.kube.client import IN_CLUSTER
from tide.services.scaler.leases import LEASE_NAME, SHARDS_MAX, LeaseSettings, ShardSettings
from tide.services.scaler.policy import PolicySettings

_POLICY = PolicySettings()
_INGEST = IngestSettings()
_LEASE = LeaseSettings()

#: How replicas elect their leader: not at all, a lease row in the store, a Kubernetes Lease.
LEADER_ELECTIONS = ("off", "sql", "kubernetes")

#: The store every Tide service shares when run from one directory (`tide up` uses its own).
DEFAULT_DB = "sqlite:///.tide/tide.db"


@dataclass(frozen=True)
class ScalerSettings(CommonSettings, ClientSettings):
    """Settings of `python -m tide.services.scaler`. The client settings (tls_ca_file,
    tls_client_cert_file, ...) are what it presents to the coordinator."""

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
    trust_configmap: str = setting(
        "",
        "with the kubernetes actuator and tls_ca_file: copy that CA (key ca.crt) into a"
        " ConfigMap of this name in every namespace holding an opted-in PaddleJob, for its"
        " launchers to mount; empty: none",
    )
    total_gpus: int = setting(0, "GPUs the actuator offers; 0 means unknown")
    local_ca_dir: str = setting(
        "",
        "local actuator: a CA directory (ca.pem, ca-key.pem) that issues each local pod's"
        " launcher certificate; empty: launchers dial the coordinator without TLS",
    )
    owner_id: str = setting("", "this scaler's name in the fencing record; default host:pid")
    evaluate_interval_s: float = setting(1.0, "every job is evaluated at least this often")
    reconcile_interval_s: float = setting(
        30.0,
        "compare each job's size with the actuator's replicas and the coordinator's"
        " world size this often (and at start, and on taking the lead)",
    )
    leader_election: str = setting(
        "off",
        "off (one replica); sql: replicas elect a leader through a lease row in the store;"
        " kubernetes: through a coordination.k8s.io/v1 Lease",
    )
    lease_name: str = setting(
        LEASE_NAME, "leader election: the lease's name (one per set of replicas)"
    )
    lease_namespace: str = setting(
        "", "leader election kubernetes: the Lease's namespace (required; the chart: its own)"
    )
    lease_kubeconfig: str = setting(
        IN_CLUSTER,
        "leader election kubernetes: in-cluster (the pod's ServiceAccount) or a kubeconfig path",
    )
    lease_duration_s: float = setting(
        _LEASE.duration_s, "leader election: a lease not renewed for this long can be taken"
    )
    lease_renew_s: float = setting(
        _LEASE.renew_s, "leader election: how often the leader renews and a follower tries"
    )
    advertise_address: str = setting(
        "",
        "HOST:PORT other replicas and errors name for this one (where sharded replicas ship"
        " partials); default: listen, with the port it bound",
    )
    shards: int = setting(
        0,
        "0: one replica decides for every job (alone or elected, --leader-election); N:"
        " replicas share the jobs over N shard leases in the store (lease_duration_s,"
        " lease_renew_s), every replica ingests and decides for its shards; not with"
        " --leader-election",
    )
    peer_tls_server_name: str = setting(
        "",
        "sharded, with TLS (tls_ca_file): the name other replicas' serving certificate"
        " carries, checked when dialling them by address (the chart: the scaler Service's"
        " name); empty: the address's host",
    )
    partials_ship_interval_s: float = setting(
        1.0,
        "sharded: how often partial aggregates of jobs owned elsewhere are shipped to their"
        " owner (also the deadline of each shipment)",
    )
    rollup_flush_interval_s: float = setting(15.0, "how often finished minutes go to SQL")
    rollup_retention_days: float = setting(
        30.0, "rollups older than this are deleted (checked on every flush)"
    )
    utilization_detail_retention_days: float = setting(
        7.0,
        "each minute's per-second utilization (what `tide whatif` replays) is deleted after"
        " this long; at most rollup_retention_days",
    )
    decision_retention_days: float = setting(
        180.0,
        "final decisions and their events older than this are deleted (a decision that is"
        " not final is kept whatever its age)",
    )
    retention_batch_rows: int = setting(
        1000, "retention deletes at most this many rows per transaction"
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
    max_report_age_s: float = setting(
        _INGEST.max_report_age_s,
        "reports sampled longer ago than this are dropped (an agent buffers minutes, not days)",
    )
    report_interval_s: float = setting(
        _INGEST.report_interval_s, "asked of agents in acks; 0 keeps theirs"
    )
    stream_idle_timeout_s: float = setting(
        _INGEST.stream_idle_timeout_s,
        "a telemetry stream with no report for this long is closed; 0 keeps it open",
    )
    #: The default policy, one grouped setting: each of PolicySettings' fields is a
    #: flag, env variable and file key of its own (``--cooldown-s``, TIDE_COOLDOWN_S).
    policy: PolicySettings = setting_group(_POLICY, "default policy")  # noqa: RUF009 (a field())

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.db:
            raise ConfigError("db: a database URL is required, got ''")
        self.ingest()
        if not (self.evaluate_interval_s > 0 and math.isfinite(self.evaluate_interval_s)):
            raise ConfigError(f"evaluate_interval_s={self.evaluate_interval_s!r}: must be > 0")
        if not (self.reconcile_interval_s > 0 and math.isfinite(self.reconcile_interval_s)):
            raise ConfigError(f"reconcile_interval_s={self.reconcile_interval_s!r}: must be > 0")
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
        decisions = self.decision_retention_days
        if not (decisions > 0 and math.isfinite(decisions)):
            raise ConfigError(f"decision_retention_days={decisions!r}: must be > 0")
        if self.retention_batch_rows < 1:
            raise ConfigError(f"retention_batch_rows={self.retention_batch_rows!r}: must be >= 1")
        if self.total_gpus < 0:
            raise ConfigError(f"total_gpus={self.total_gpus!r}: must be >= 0")
        if self.leader_election not in LEADER_ELECTIONS:
            raise ConfigError(
                f"leader_election: expected off, sql or kubernetes, got {self.leader_election!r}"
            )
        if not self.lease_name:
            raise ConfigError("lease_name: must not be empty, got ''")
        if self.leader_election == "kubernetes" and not self.lease_namespace:
            raise ConfigError("lease_namespace: required with --leader-election kubernetes, got ''")
        if not self.lease_kubeconfig:
            raise ConfigError("lease_kubeconfig: expected in-cluster or a path, got ''")
        self.lease()
        if not 0 <= self.shards <= SHARDS_MAX:
            raise ConfigError(f"shards={self.shards!r}: must be 0 (off) or 1..{SHARDS_MAX}")
        if self.shards and self.leader_election != "off":
            # Shard leases are per-shard leaders already: a leader over them would
            # decide nothing the shards do not, and leave one replica doing it all.
            raise ConfigError(
                f"shards={self.shards!r} with leader_election={self.leader_election!r}:"
                " choose one (sharded replicas each lead their own shards)"
            )
        ship = self.partials_ship_interval_s
        if not (0 < ship <= 60 and math.isfinite(ship)):
            raise ConfigError(f"partials_ship_interval_s={ship!r}: must be in (0, 60]")
        if self.shards:
            self.sharding()
        self.check_coordinator()
        self.check_actuator()
        self.credentials()

    def lease(self) -> LeaseSettings:
        return LeaseSettings(duration_s=self.lease_duration_s, renew_s=self.lease_renew_s)

    def sharding(self) -> ShardSettings:
        return ShardSettings(
            shards=self.shards, duration_s=self.lease_duration_s, renew_s=self.lease_renew_s
        )

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
        # Or IP:PORT,IP:PORT...: the coordinator's replicas, the leader found by health.
        channel_target(self.coordinator)

    def check_actuator(self) -> None:
        # No default: an actuator that changes nothing must never be the one a
        # production scaler runs with by accident.
        parse_actuator(self.actuator)
        if self.trust_configmap and not self.tls_ca_file:
            raise ConfigError("trust_configmap: needs tls_ca_file, the CA it copies")

    def ingest(self) -> IngestSettings:
        return IngestSettings(
            max_gpus_per_node=self.max_gpus_per_node,
            max_clock_skew_s=self.max_clock_skew_s,
            max_report_age_s=self.max_report_age_s,
            stale_after_s=self.stale_after_s,
            report_interval_s=self.report_interval_s,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
        )

    def namespaces(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.kube_namespaces.split(",") if n.strip())

    def owner(self) -> str:
        return self.owner_id or f"{socket.gethostname()}:{os.getpid()}"
