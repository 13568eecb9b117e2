"""What the agent observes, as plain values: GPU readings and node notices.

Sources and watchers produce these; only ``report.py`` turns them into
protobuf, so the sampling side never depends on the wire format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class HealthFlag(enum.IntFlag):
    """Mirrors tide.v1.GpuHealthFlag bit for bit."""

    OK = 0
    XID = 1
    ECC_UNCORRECTABLE = 2
    NVML_ERROR = 4
    LOST = 8


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpmActivity:
    """SM, tensor and DRAM activity of one GPU over the last interval, percent 0..100
    each (tide.v1.GpuSample's GPM fields). NVML GPM reads all four or none; a field
    a dcgm-exporter endpoint does not publish is None: not measured, never zero."""

    sm_active_pct: float | None
    sm_occupancy_pct: float | None
    tensor_active_pct: float | None
    dram_active_pct: float | None


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one instant. A GPU whose readings failed keeps its index and
    UUID, carries zeros and says so in ``health``: it is never left out."""

    index: int
    uuid: str
    utilization_pct: float = 0.0
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    power_w: float = 0.0
    temperature_c: float = 0.0
    health: HealthFlag = HealthFlag.OK
    processes: tuple[GpuProcess, ...] = ()
    #: None where the GPU cannot measure it (no GPM) or the interval is not yet
    #: complete: not measured, never zero.
    gpm: GpmActivity | None = None
    #: Why ``health`` is not OK, for logs ("utilization: GPU is lost").
    error: str = ""


class NoticeKind(enum.Enum):
    """Mirrors tide.v1.NodeEvent.Kind."""

    CORDONED = 1
    UNCORDONED = 2
    TERMINATION_NOTICE = 3
    AGENT_SHUTDOWN = 4


@dataclass(frozen=True)
class NodeNotice:
    kind: NoticeKind
    observed_at: float
    detail: str = ""
    #: Epoch seconds when the node is expected to go; None when unknown.
    deadline: float | None = None


@dataclass(frozen=True)
class PodOwner:
    namespace: str
    name: str
    container: str = ""
    uid: str = ""


@dataclass
class Sample:
    """Everything one sampling tick produced."""

    sampled_at: float
    gpus: list[GpuReading]
    gpu_capacity: int
    notices: list[NodeNotice] = field(default_factory=list)
