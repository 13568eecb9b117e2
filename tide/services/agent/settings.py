"""Agent settings: flags (--interval-s), TIDE_* environment, or a YAML file.

The process-wide ones (settings file, logs, /metrics, the shutdown grace period)
are tide.services.common.config.ProcessSettings', written there once. The agent serves
no API: its ``listen`` is optional (gRPC health for probes), and its TLS files
are a client's, for the connection to the scaler.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from tide.base import grpc_options
from tide.base.errors import ConfigError
from tide.services.common.config import ClientSettings, ProcessSettings, check_hostport, setting

SOURCES = ("nvml", "dcgm", "replay", "synthetic")


def _default_node_name() -> str:
    # The DaemonSet passes spec.nodeName as NODE_NAME (downward API).
    return os.environ.get("NODE_NAME") or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class AgentSettings(ProcessSettings, ClientSettings):
    scaler: str = setting("127.0.0.1:50051", "scaler Telemetry address, HOST:PORT")
    scaler_fanout: bool = setting(
        False,
        "stream to every address --scaler's host resolves to (a headless Service of the"
        " scaler replicas), each with its own buffer, so followers ingest too; not with"
        " a sharded scaler",
    )
    scaler_resolve_interval_s: float = setting(
        30.0, "with --scaler-fanout, how often the replicas' addresses are resolved again"
    )
    node_name: str = setting("", "Kubernetes node name; default $NODE_NAME, then the hostname")
    source: str = setting(
        "nvml",
        "where readings come from: nvml, dcgm (a dcgm-exporter endpoint), replay or synthetic",
    )
    dcgm_exporter_url: str = setting(
        "http://127.0.0.1:9400/metrics",
        "for --source dcgm: the node's dcgm-exporter /metrics (e.g. http://$NODE_IP:9400/metrics)",
    )
    dcgm_timeout_s: float = setting(2.0, "for --source dcgm: timeout of one scrape of the exporter")
    replay_path: str = setting("", "JSONL or CSV trace for --source replay")
    replay_loop: bool = setting(True, "start the replay trace again when it ends")
    synthetic_profile: str = setting(
        "steady:70",
        "for --source synthetic: steady:PCT, ramp:FROM:TO:SECONDS, square:LO:HI:SECONDS",
    )
    synthetic_gpus: int = setting(8, "GPUs the synthetic source pretends to have")
    interval_s: float = setting(1.0, "seconds between two reports (the scaler may change it)")
    buffer_reports: int = setting(
        600, "unacked reports held while the scaler is away; 600 is 10 min at 1 Hz (~250 KB)"
    )
    max_in_flight_reports: int = setting(
        64, "reports written but not acked at once; must be below buffer_reports"
    )
    ack_timeout_s: float = setting(
        30.0, "reconnect when reports are in flight and no ack came for this long"
    )
    stream_max_age_s: float = setting(
        3600.0, "deadline of one Telemetry stream; a new one follows and resends held reports"
    )
    backoff_initial_s: float = setting(0.5, "first reconnect delay (jittered, doubles)")
    backoff_max_s: float = setting(30.0, "largest reconnect delay")
    keepalive_time_s: float = setting(
        grpc_options.KEEPALIVE_TIME_S, "ping the scaler after this long without reads"
    )
    keepalive_timeout_s: float = setting(
        grpc_options.KEEPALIVE_TIMEOUT_S, "a ping unanswered this long marks the connection dead"
    )
    shutdown_flush_s: float = setting(
        5.0, "on SIGTERM, how long to wait for the final report to be acked"
    )
    pod_resources_socket: str = setting(
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        "kubelet PodResources socket; empty disables pod attribution",
    )
    pod_resources_refresh_s: float = setting(5.0, "how often to ask the kubelet who holds GPUs")
    gpu_resource_name: str = setting("nvidia.com/gpu", "extended resource name of GPUs")
    watch_node: bool = setting(True, "watch this Node for cordon and termination taints")
    kubeconfig: str = setting("", "kubeconfig file; empty means in-cluster config")
    watch_timeout_s: int = setting(
        60, "server-side timeout of one Node watch; the client waits 15 s longer"
    )
    insecure: bool = setting(
        False, "stream to the scaler without TLS (local use only); without a CA this is required"
    )
    listen: str = setting(
        "",
        "gRPC health and reflection address HOST:PORT, for Kubernetes gRPC probes; empty: off",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.node_name:
            object.__setattr__(self, "node_name", _default_node_name())
        check_hostport("scaler", self.scaler)
        if self.listen:
            check_hostport("listen", self.listen)
        if self.source not in SOURCES:
            raise ConfigError(f"source: expected one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "dcgm" and not self.dcgm_exporter_url.startswith(("http://", "https://")):
            raise ConfigError(
                "dcgm_exporter_url: an http:// or https:// URL is required with source=dcgm,"
                f" got {self.dcgm_exporter_url!r}"
            )
        if self.source == "replay" and not self.replay_path:
            raise ConfigError("replay_path: required with source=replay, got ''")
        if self.synthetic_gpus < 0:
            raise ConfigError(f"synthetic_gpus: must be >= 0, got {self.synthetic_gpus!r}")
        positive = (
            "interval_s",
            "ack_timeout_s",
            "stream_max_age_s",
            "backoff_initial_s",
            "backoff_max_s",
            "keepalive_time_s",
            "keepalive_timeout_s",
            "pod_resources_refresh_s",
            "scaler_resolve_interval_s",
            "dcgm_timeout_s",
        )
        for name in positive:
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}: must be > 0, got {value!r}")
        if self.shutdown_flush_s < 0:
            raise ConfigError(f"shutdown_flush_s: must be >= 0, got {self.shutdown_flush_s!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(
                f"backoff_max_s: must be >= backoff_initial_s ({self.backoff_initial_s}),"
                f" got {self.backoff_max_s!r}"
            )
        if self.buffer_reports < 2:
            raise ConfigError(f"buffer_reports: must be >= 2, got {self.buffer_reports!r}")
        if not 1 <= self.max_in_flight_reports < self.buffer_reports:
            raise ConfigError(
                f"max_in_flight_reports: must be in 1..{self.buffer_reports - 1},"
                f" got {self.max_in_flight_reports!r}"
            )
        if self.watch_timeout_s < 1:
            raise ConfigError(f"watch_timeout_s: must be >= 1, got {self.watch_timeout_s!r}")
        self.credentials()
        if self.replay_path and not Path(self.replay_path).is_file():
            raise ConfigError(f"replay_path: no such file {self.replay_path!r}")

    def security_problem(self) -> str:
        """Why the agent must not start as configured, or "" (checked at its entry)."""
        if self.tls_ca_file or self.insecure:
            return ""
        return (
            "no TLS to the scaler: pass --tls-ca-file (and --tls-client-cert-file,"
            " --tls-client-key-file or --token-file), or --insecure (local use only)"
        )
