"""Per-job utilization windows, GPU freshness and per-minute rollups.

Memory is fixed by the fleet's shape, never by the report rate: a job's window
is a ring of sum/count pairs, one per bucket (not a list of samples), a GPU is
one slot in its node's arrays, and a rollup is one accumulator per job and
minute until it is written to SQL.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from services.scaler.policy import WindowView

#: Minutes of rollups a job may hold while the database is unreachable; older
#: ones are dropped (the window itself does not depend on them).
MAX_PENDING_ROLLUP_MINUTES = 120


class JobWindow:
    """A ring of buckets of one job: sum and count of utilization per bucket."""

    __slots__ = ("_counts", "_ids", "_sums", "bucket_s", "n", "offset_s")

    def __init__(self, bucket_s: float, buckets: int, offset_s: float = 0.0) -> None:
        self.bucket_s = bucket_s
        # Bucket i spans [offset + i*bucket_s, offset + (i+1)*bucket_s).
        self.offset_s = offset_s
        # Two spare slots: the bucket being filled and one late bucket.
        self.n = buckets + 2
        self._ids = [-1] * self.n
        self._sums = [0.0] * self.n
        self._counts = [0] * self.n

    def bucket_of(self, t: float) -> int:
        return math.floor((t - self.offset_s) / self.bucket_s)

    def add(self, bucket_id: int, total: float, count: int) -> bool:
        """Add ``count`` samples summing to ``total`` to bucket ``bucket_id``.
        Returns False when that bucket has already left the ring."""
        slot = bucket_id % self.n
        have = self._ids[slot]
        if have != bucket_id:
            if have > bucket_id:
                return False
            self._ids[slot] = bucket_id
            self._sums[slot] = total
            self._counts[slot] = count
            return True
        self._sums[slot] += total
        self._counts[slot] += count
        return True

    def means(self, end_bucket: int, k: int) -> tuple[float, ...]:
        """Means of the ``k`` buckets before ``end_bucket`` (exclusive), oldest first;
        NaN for a bucket without samples."""
        out = []
        for b in range(end_bucket - k, end_bucket):
            slot = b % self.n
            c = self._counts[slot]
            out.append(self._sums[slot] / c if self._ids[slot] == b and c else math.nan)
        return tuple(out)

    def view(self, now_s: float, buckets: int, gpus_expected: int, gpus_fresh: int) -> WindowView:
        """The complete buckets of the sustain window ending at the boundary before ``now_s``."""
        end = self.bucket_of(now_s)
        k = min(buckets, self.n - 1)
        return WindowView(
            bucket_s=self.bucket_s,
            end_s=end * self.bucket_s + self.offset_s,
            bucket_means=self.means(end, k),
            gpus_expected=gpus_expected,
            gpus_fresh=gpus_fresh,
        )


def stagger_offset(job_id: str, bucket_s: float) -> float:
    """A fixed offset of the job's bucket grid within one bucket width, from its id.

    With every grid aligned to the epoch, the buckets of all jobs close in the
    same instant and their decisions queue for the one SQLite writer; spread
    out, each is committed on its own (bench/ingest decision latency)."""
    return (zlib.crc32(job_id.encode()) % 1000) / 1000.0 * bucket_s


class NodeGpus:
    """The latest sample of each GPU of one node, as parallel arrays (no per-sample objects)."""

    __slots__ = ("job", "last_report_s", "node", "seen_s", "util")

    def __init__(self, node: str, capacity: int) -> None:
        self.node = node
        self.util = [math.nan] * capacity
        self.seen_s = [-math.inf] * capacity
        self.job: list[str | None] = [None] * capacity
        self.last_report_s = -math.inf

    def grow(self, capacity: int) -> None:
        extra = capacity - len(self.util)
        if extra > 0:
            self.util.extend([math.nan] * extra)
            self.seen_s.extend([-math.inf] * extra)
            self.job.extend([None] * extra)


@dataclass
class RollupRow:
    job_id: str
    minute_s: float
    mean_pct: float
    min_pct: float
    max_pct: float
    samples: int
    replicas: int


class _Rollup:
    __slots__ = ("count", "hi", "lo", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.lo = math.inf
        self.hi = -math.inf


class Rollups:
    """Per job, per minute: mean, min and max of the samples, until flushed to SQL."""

    def __init__(self) -> None:
        self._acc: dict[str, dict[int, _Rollup]] = {}

    def add(self, job_id: str, minute: int, total: float, count: int, lo: float, hi: float) -> None:
        per_job = self._acc.get(job_id)
        if per_job is None:
            per_job = self._acc[job_id] = {}
        r = per_job.get(minute)
        if r is None:
            if len(per_job) >= MAX_PENDING_ROLLUP_MINUTES:
                del per_job[min(per_job)]
            r = per_job[minute] = _Rollup()
        r.total += total
        r.count += count
        if lo < r.lo:
            r.lo = lo
        if hi > r.hi:
            r.hi = hi

    def take_complete(
        self, now_s: float, replicas_of: dict[str, int], grace_s: float = 5.0
    ) -> list[RollupRow]:
        """Remove and return the minutes that ended at least ``grace_s`` ago
        (late reports of a minute still land in it during the grace)."""
        cutoff = math.floor((now_s - grace_s) / 60.0)
        rows: list[RollupRow] = []
        for job_id, per_job in self._acc.items():
            for minute in sorted(m for m in per_job if m < cutoff):
                r = per_job.pop(minute)
                rows.append(
                    RollupRow(
                        job_id,
                        minute * 60.0,
                        r.total / r.count if r.count else math.nan,
                        r.lo,
                        r.hi,
                        r.count,
                        replicas_of.get(job_id, 0),
                    )
                )
        return rows

    def put_back(self, rows: Iterable[RollupRow]) -> None:
        """Return rows whose write failed, so the next flush retries them."""
        for row in rows:
            minute = int(row.minute_s // 60)
            self.add(
                row.job_id,
                minute,
                row.mean_pct * row.samples,
                row.samples,
                row.min_pct,
                row.max_pct,
            )

    def drop_job(self, job_id: str) -> None:
        self._acc.pop(job_id, None)

    def pending_minutes(self) -> int:
        return sum(len(v) for v in self._acc.values())
