"""Per-job utilization windows, GPU freshness and per-minute rollups.

Memory is fixed by the fleet's shape, never by the report rate: a job's window
is a ring of sum/count pairs, one per slot (not a list of samples), a GPU is
one slot in its node's arrays, and a rollup is one accumulator per job and
minute until it is written to SQL.
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tide.services.scaler.policy import WindowView

#: Minutes of rollups a job may hold while the database is unreachable; older
#: ones are dropped (the window itself does not depend on them).
MAX_PENDING_ROLLUP_MINUTES = 120


#: The widest slot of a job's window, seconds. The buckets the policy judges slide by
#: whole slots, so a decision comes at most this long after its sustain condition
#: holds (bench.ingest ``lag_over_sustain_p99_s``), instead of up to a bucket later.
MAX_SLOT_S = 0.5
#: The most slots one job's ring may hold (a very long sustain gets wider slots).
MAX_SLOTS = 8192


def slots_per_bucket(bucket_s: float, buckets: int) -> int:
    """Slots per bucket: slots no wider than MAX_SLOT_S, at most MAX_SLOTS in the ring."""
    k = max(1, math.ceil(bucket_s / MAX_SLOT_S - 1e-9))
    return max(1, min(k, MAX_SLOTS // (buckets + 2)))


class JobWindow:
    """A ring of slots of one job: sum and count of utilization per slot.

    A bucket the policy judges is ``k`` consecutive slots, and the window ends
    at the slot holding "now" (the one being filled included), so the buckets
    slide with time instead of standing on a fixed grid: the condition "every
    bucket of the sustain window above the threshold" is seen as soon as it
    holds. The ring holds the window, one bucket more (late samples) and the
    slot being filled; its memory depends on the policy's shape only.
    """

    __slots__ = (
        "_counts",
        "_gpm",
        "_head",
        "_sm",
        "_sums",
        "_tensor",
        "bucket_s",
        "buckets",
        "k",
        "n",
        "offset_s",
        "slot_s",
    )

    def __init__(self, bucket_s: float, buckets: int, offset_s: float = 0.0) -> None:
        self.bucket_s = bucket_s
        self.buckets = buckets
        self.k = slots_per_bucket(bucket_s, buckets)
        self.slot_s = bucket_s / self.k
        # Slot i spans [offset + i*slot_s, offset + (i+1)*slot_s).
        self.offset_s = offset_s
        self.n = (buckets + 1) * self.k + 1
        self._sums = array("d", bytes(8 * self.n))
        self._counts = array("q", bytes(8 * self.n))
        # GPM activity (tide.v1.GpuSample's SM and tensor activity): of each slot's
        # samples, those that carried it, and the sums of their SM and tensor activity. Absent is not zero: a
        # bucket's GPM mean is over these samples only, and its fraction says how many.
        self._gpm = array("q", bytes(8 * self.n))
        self._sm = array("d", bytes(8 * self.n))
        self._tensor = array("d", bytes(8 * self.n))
        # The newest slot written; the ring holds slots head-n+1 .. head.
        self._head: int | None = None

    def slot_of(self, t: float) -> int:
        return math.floor((t - self.offset_s) / self.slot_s)

    def add(
        self,
        slot_id: int,
        total: float,
        count: int,
        gpm: int = 0,
        sm: float = 0.0,
        tensor: float = 0.0,
    ) -> bool:
        """Add ``count`` samples summing to ``total`` to slot ``slot_id``, ``gpm`` of
        them with GPM activity summing to ``sm`` and ``tensor``.
        Returns False when that slot has already left the ring."""
        n = self.n
        head = self._head
        if head is None or slot_id > head:
            # The slots skipped since the newest one are empty; clear what the ring
            # held there a lap ago (at most the whole ring, once).
            first = slot_id - n + 1 if head is None or slot_id - head >= n else head + 1
            for s in range(first, slot_id + 1):
                i = s % n
                self._sums[i] = 0.0
                self._counts[i] = 0
                self._gpm[i] = 0
                self._sm[i] = 0.0
                self._tensor[i] = 0.0
            self._head = slot_id
        elif slot_id <= head - n:
            return False
        i = slot_id % n
        self._sums[i] += total
        self._counts[i] += count
        if gpm:
            self._gpm[i] += gpm
            self._sm[i] += sm
            self._tensor[i] += tensor
        return True

    @property
    def shape(self) -> tuple[float, int, float]:
        """(bucket_s, buckets, offset_s): two windows of one shape hold the same slots."""
        return self.bucket_s, self.buckets, self.offset_s

    def slots(self) -> dict[int, list[float]]:
        """The slots the ring holds that have samples: slot → [sum, samples, GPM
        samples, SM activity sum, tensor activity sum] (partials.SLOT_WIDTH)."""
        head = self._head
        if head is None:
            return {}
        n = self.n
        out: dict[int, list[float]] = {}
        for s in range(head - n + 1, head + 1):
            count = self._counts[s % n]
            if count:
                i = s % n
                out[s] = [
                    self._sums[i],
                    float(count),
                    float(self._gpm[i]),
                    self._sm[i],
                    self._tensor[i],
                ]
        return out

    def _range(self, lo: int, hi: int) -> tuple[int, int, int] | None:
        """Ring positions of slots lo .. hi-1 (those the ring holds): (a, b, wrap)."""
        head = self._head
        if head is None:
            return None
        n = self.n
        lo = max(lo, head - n + 1)
        hi = min(hi, head + 1)
        if lo >= hi:
            return None
        a = lo % n
        b = a + (hi - lo)
        return (a, b, 0) if b <= n else (a, n, b - n)

    @staticmethod
    def _sum(arr: array[Any], r: tuple[int, int, int]) -> Any:
        a, b, wrap = r
        return sum(arr[a:b]) + (sum(arr[:wrap]) if wrap else 0)

    def _total(self, lo: int, hi: int) -> tuple[float, int]:
        """Sum and count of slots lo .. hi-1 (those the ring holds)."""
        r = self._range(lo, hi)
        if r is None:
            return 0.0, 0
        return self._sum(self._sums, r), self._sum(self._counts, r)

    def means(self, end_slot: int, k: int) -> tuple[float, ...]:
        """Means of the ``k`` buckets ending before slot ``end_slot`` (exclusive), oldest
        first; NaN for a bucket without samples."""
        out = []
        step = self.k
        for i in range(k, 0, -1):
            total, count = self._total(end_slot - i * step, end_slot - (i - 1) * step)
            out.append(total / count if count else math.nan)
        return tuple(out)

    def gpm_means(
        self, end_slot: int, k: int
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Of the same buckets as ``means``: SM activity and tensor activity means over
        the samples that carried GPM (NaN: none did), and the fraction that did (NaN:
        no sample at all)."""
        sm, tensor, frac = [], [], []
        nan = math.nan
        step = self.k
        for i in range(k, 0, -1):
            r = self._range(end_slot - i * step, end_slot - (i - 1) * step)
            count = self._sum(self._counts, r) if r is not None else 0
            g = self._sum(self._gpm, r) if r is not None and count else 0
            frac.append(g / count if count else nan)
            if r is None or not g:
                sm.append(nan)
                tensor.append(nan)
                continue
            sm.append(self._sum(self._sm, r) / g)
            tensor.append(self._sum(self._tensor, r) / g)
        return tuple(sm), tuple(tensor), tuple(frac)

    def view(self, now_s: float, buckets: int, gpus_expected: int, gpus_fresh: int) -> WindowView:
        """The sustain window's buckets, the newest ending with the slot that holds ``now_s``."""
        end = self.slot_of(now_s) + 1
        sm, tensor, frac = self.gpm_means(end, buckets)
        return WindowView(
            bucket_s=self.bucket_s,
            end_s=end * self.slot_s + self.offset_s,
            bucket_means=self.means(end, buckets),
            gpus_expected=gpus_expected,
            gpus_fresh=gpus_fresh,
            sm_active_means=sm,
            tensor_active_means=tensor,
            gpm_fractions=frac,
        )


def stagger_offset(job_id: str, slot_s: float) -> float:
    """A fixed offset of the job's slot grid within one slot width, from its id.

    A job is evaluated when the first sample of a new slot arrives; with every
    grid aligned to the epoch, all jobs would open slots (and evaluate) in the
    same instant."""
    return (zlib.crc32(job_id.encode()) % 1000) / 1000.0 * slot_s


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
    # Per second of the minute: the sum of the samples' utilization and their count
    # (what `tide whatif` replays the job's window from).
    second_sums: tuple[float, ...] = ()
    second_counts: tuple[int, ...] = ()


class _Rollup:
    __slots__ = ("count", "hi", "lo", "sec_counts", "sec_sums", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.lo = math.inf
        self.hi = -math.inf
        self.sec_sums = array("d", bytes(8 * 60))
        self.sec_counts = array("q", bytes(8 * 60))


class Rollups:
    """Per job, per minute: mean, min and max of the samples, and the sum and count of
    each second, until flushed to SQL."""

    def __init__(self) -> None:
        self._acc: dict[str, dict[int, _Rollup]] = {}

    def _slot(self, job_id: str, minute: int) -> _Rollup:
        per_job = self._acc.get(job_id)
        if per_job is None:
            per_job = self._acc[job_id] = {}
        r = per_job.get(minute)
        if r is None:
            if len(per_job) >= MAX_PENDING_ROLLUP_MINUTES:
                del per_job[min(per_job)]
            r = per_job[minute] = _Rollup()
        return r

    def add(self, job_id: str, t: float, total: float, count: int, lo: float, hi: float) -> None:
        """Add ``count`` samples taken at ``t`` (epoch seconds) summing to ``total``."""
        sec = int(t)
        r = self._slot(job_id, sec // 60)
        r.total += total
        r.count += count
        if lo < r.lo:
            r.lo = lo
        if hi > r.hi:
            r.hi = hi
        i = sec % 60
        r.sec_sums[i] += total
        r.sec_counts[i] += count

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
                        tuple(r.sec_sums),
                        tuple(r.sec_counts),
                    )
                )
        return rows

    def put_back(self, rows: Iterable[RollupRow]) -> None:
        """Return rows whose write failed, so the next flush retries them."""
        for row in rows:
            r = self._slot(row.job_id, int(row.minute_s // 60))
            r.total += row.mean_pct * row.samples
            r.count += row.samples
            r.lo = min(r.lo, row.min_pct)
            r.hi = max(r.hi, row.max_pct)
            for i, (total, count) in enumerate(
                zip(row.second_sums, row.second_counts, strict=True)
            ):
                r.sec_sums[i] += total
                r.sec_counts[i] += count

    def drop_job(self, job_id: str) -> None:
        self._acc.pop(job_id, None)

    def pending_minutes(self) -> int:
        return sum(len(v) for v in self._acc.values())
