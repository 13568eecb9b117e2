"""What ingestion keeps per node and per stream, its settings, why it refuses a stream
or a report (:class:`Rejection`), and how a report's samples sum per job (:func:`fold`).
tide/services/scaler/ingest.py is the hot path over them."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from tide.base.errors import AlreadyExists, ConfigError, InvalidArgument
from tide.services.scaler.windows import NodeGpus

_INF = math.inf


class Rejection(enum.Enum):
    """Why a sample, a report or a stream was refused (the metric's ``reason`` label)."""

    NON_FINITE = "non_finite"
    UTILIZATION_OUT_OF_RANGE = "utilization_out_of_range"
    MEMORY_USED_EXCEEDS_TOTAL = "memory_used_exceeds_total"
    GPU_INDEX_OUT_OF_RANGE = "gpu_index_out_of_range"
    DUPLICATE_GPU_INDEX = "duplicate_gpu_index"
    TIMESTAMP_MISSING = "timestamp_missing"
    TIMESTAMP_IN_FUTURE = "timestamp_in_future"
    TIMESTAMP_OUT_OF_ORDER = "timestamp_out_of_order"
    TIMESTAMP_TOO_OLD = "timestamp_too_old"
    TOO_MANY_GPUS = "too_many_gpus"
    MISSING_IDENTITY = "missing_identity"
    BAD_SEQUENCE = "bad_sequence"
    NODE_CHANGED = "node_changed"
    MALFORMED = "malformed"
    DUPLICATE_STREAM = "duplicate_stream"

    @property
    def scope(self) -> str:
        """What was refused: one ``sample``, a whole ``report``, or the ``stream``."""
        return _SCOPES[self]


_SCOPES: dict[Rejection, str] = {
    **dict.fromkeys(
        (
            Rejection.NON_FINITE,
            Rejection.UTILIZATION_OUT_OF_RANGE,
            Rejection.MEMORY_USED_EXCEEDS_TOTAL,
            Rejection.GPU_INDEX_OUT_OF_RANGE,
            Rejection.DUPLICATE_GPU_INDEX,
        ),
        "sample",
    ),
    **dict.fromkeys(
        (
            Rejection.TIMESTAMP_MISSING,
            Rejection.TIMESTAMP_IN_FUTURE,
            Rejection.TIMESTAMP_OUT_OF_ORDER,
            Rejection.TIMESTAMP_TOO_OLD,
        ),
        "report",
    ),
    **dict.fromkeys(
        (
            Rejection.TOO_MANY_GPUS,
            Rejection.MISSING_IDENTITY,
            Rejection.BAD_SEQUENCE,
            Rejection.NODE_CHANGED,
            Rejection.MALFORMED,
            Rejection.DUPLICATE_STREAM,
        ),
        "stream",
    ),
}


class InvalidStream(InvalidArgument):
    """The stream itself is broken (identity, sequence, impossible GPU count): it ends."""

    def __init__(self, reason: Rejection, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class StreamConflict(AlreadyExists):
    """Another live stream speaks for the node under another boot id: two agents claim
    one node. Refused, counted and logged, also in insecure mode; never merged."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{Rejection.DUPLICATE_STREAM.value}: {message}")
        self.reason = Rejection.DUPLICATE_STREAM


@dataclass(frozen=True)
class IngestSettings:
    max_gpus_per_node: int = 64
    # Agent clocks run ahead of ours by at most this; a report further in the future is dropped.
    max_clock_skew_s: float = 5.0
    # A report sampled longer ago than this is dropped: an agent's buffer holds minutes,
    # never days, and an old report would become history dated in the past.
    max_report_age_s: float = 900.0
    # A GPU without a sample for this long is stale: it no longer counts as covered.
    stale_after_s: float = 10.0
    # Out-of-order sequence numbers remembered above the contiguous ack; past
    # this the missing reports are given up as lost.
    reorder_limit: int = 256
    # Asked of agents in every ack; 0 leaves the agent's own period.
    report_interval_s: float = 0.0
    # Offset each job's slot grid by a fraction of a slot (see windows.stagger_offset).
    stagger_slots: bool = True
    # A telemetry stream with no report for this long is closed (UNAVAILABLE): an
    # agent reports every few seconds, and one that holds a stream open without
    # reporting only holds a slot (reliability catalog T23). 0 keeps streams open.
    stream_idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_gpus_per_node <= 4096:
            raise ConfigError(f"max_gpus_per_node={self.max_gpus_per_node!r}: must be 1..4096")
        if not (self.max_clock_skew_s >= 0 and math.isfinite(self.max_clock_skew_s)):
            raise ConfigError(f"max_clock_skew_s={self.max_clock_skew_s!r}: must be >= 0")
        if not (self.max_report_age_s > 0 and math.isfinite(self.max_report_age_s)):
            raise ConfigError(f"max_report_age_s={self.max_report_age_s!r}: must be > 0")
        if not (self.stale_after_s > 0 and math.isfinite(self.stale_after_s)):
            raise ConfigError(f"stale_after_s={self.stale_after_s!r}: must be > 0")
        if self.reorder_limit < 1:
            raise ConfigError(f"reorder_limit={self.reorder_limit!r}: must be >= 1")
        if not (self.report_interval_s >= 0 and math.isfinite(self.report_interval_s)):
            raise ConfigError(f"report_interval_s={self.report_interval_s!r}: must be >= 0")
        if not (self.stream_idle_timeout_s >= 0 and math.isfinite(self.stream_idle_timeout_s)):
            raise ConfigError(f"stream_idle_timeout_s={self.stream_idle_timeout_s!r}: must be >= 0")


class NodeState:
    """What the scaler knows of one node: sequence state of its current boot,
    its GPUs' latest samples, and any notice it announced."""

    __slots__ = (
        "acked",
        "boot_id",
        "gpus",
        "last_sampled_s",
        "max_seen",
        "name",
        "notice",
        "notice_deadline_s",
        "pending",
        "pods",
        "streams",
    )

    def __init__(self, name: str, boot_id: str, first_seq: int) -> None:
        self.name = name
        self.gpus = NodeGpus(name, 0)
        self.pods: list[str] = []
        self.notice = 0
        self.notice_deadline_s: float | None = None
        self.streams = 0
        self.reset(boot_id, first_seq)

    def reset(self, boot_id: str, first_seq: int) -> None:
        # A scaler that first hears of a boot mid-way (its own restart) takes
        # the first report as the start: it cannot know what came before.
        self.boot_id = boot_id
        self.acked = first_seq - 1
        self.max_seen = first_seq - 1
        self.pending: set[int] = set()
        self.last_sampled_s = -_INF


class StreamState:
    """Per-stream identity: a stream speaks for exactly one node."""

    __slots__ = ("node",)

    def __init__(self) -> None:
        self.node: NodeState | None = None


WindowShape = Callable[[str], tuple[float, int]]


def fold(acc: dict[str | None, list[float]], job: object, run: tuple[float, ...]) -> None:
    """Add one run of a job's samples (sum, count, min, max, GPM count, SM and tensor
    sums) to its sums of the report."""
    key = cast("str | None", job)
    a = acc.get(key)
    if a is None:
        acc[key] = list(run)
        return
    tot, cnt, lo, hi, ngc, sms, tes = run
    a[0] += tot
    a[1] += cnt
    if lo < a[2]:
        a[2] = lo
    if hi > a[3]:
        a[3] = hi
    a[4] += ngc
    a[5] += sms
    a[6] += tes
