"""The demo's knobs, validated: what a person sets with `tide demo`'s flags.

Its own room because the flags and their limits change with the CLI, not with how
the demo drives the load or reports; every other module of the demo reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tide.base.errors import ConfigError

# Generous: on two shared cores a worker restart can starve the services for a while.
RPC_TIMEOUT_S = 5.0

# The example jobs the demo can run, by name: the script under tide/trainer/examples/. Both take
# the same flags (train_mlp.py's), so the demo's data settings and sample audit hold for each.
WORKLOADS: Final = {
    # Pure data parallel: every rank holds the whole model and optimizer.
    "mlp": "train_mlp.py",
    # A fleet script (fleet.init, distributed_model/optimizer): AdamW's state sharded over
    # the ranks, resharded at each resize (docs/sharded.md).
    "sharded": "train_sharded.py",
}


@dataclass(frozen=True)
class DemoSettings:
    state_dir: Path = Path(".tide")
    start_replicas: int = 2
    max_replicas: int = 4
    warm_pct: float = 60.0
    high_pct: float = 95.0
    low_pct: float = 15.0
    sustain_s: float = 10.0
    bucket_s: float = 2.0
    cooldown_s: float = 10.0
    # Stay this long in each phase after it reached its goal (a longer demo).
    hold_s: float = 0.0
    # High/low cycles.
    cycles: int = 1
    # The whole run gives up after this long, seconds.
    timeout_s: float = 170.0
    # Training: a stand-in for heavier compute per step keeps the CPUs shared.
    step_delay_s: float = 0.05
    dataset_size: int = 4096
    global_batch: int = 64
    seed: int = 0
    poll_interval_s: float = 0.5
    chart: Path | None = None
    # Format of the services' and launchers' logs under STATE_DIR/logs.
    log_format: str = "text"
    # mTLS on every link (False: --insecure) and an optional admin token file; UpSettings'.
    tls: bool = True
    admin_token_file: Path | None = None
    # Which example job runs: a key of WORKLOADS.
    workload: str = "mlp"

    def __post_init__(self) -> None:
        if not 1 <= self.start_replicas < self.max_replicas <= 16:
            raise ConfigError(
                f"start_replicas/max_replicas: need 1 <= start < max <= 16, got"
                f" {self.start_replicas}/{self.max_replicas}"
            )
        if not self.low_pct < 40 < self.warm_pct < 80 < self.high_pct <= 100:
            raise ConfigError(
                "low_pct/warm_pct/high_pct: need low < 40 < warm < 80 < high <= 100, got"
                f" {self.low_pct}/{self.warm_pct}/{self.high_pct}"
            )
        for name in ("sustain_s", "bucket_s", "timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("cooldown_s", "hold_s", "step_delay_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.workload not in WORKLOADS:
            raise ConfigError(f"workload: one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.cycles < 1:
            raise ConfigError(f"cycles: must be >= 1, got {self.cycles}")
        if not 1 <= self.global_batch <= self.dataset_size:
            raise ConfigError(
                f"global_batch: must be 1..dataset_size ({self.dataset_size}),"
                f" got {self.global_batch}"
            )

    @property
    def chart_path(self) -> Path:
        return self.chart or self.state_dir / "demo.png"
