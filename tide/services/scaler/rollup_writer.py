"""The rollup writer: finished utilization minutes go to SQL; rows past retention go away.

Each minute is written twice: its mean, min and max (``utilization_rollups``,
kept ``rollup_retention_days``) and each of its seconds (``utilization_seconds``,
kept ``detail_retention_days``: what `tide whatif` replays). Final decisions and
their events are kept ``decision_retention_days``.

Ingestion accumulates per-minute rollups in memory (windows.Rollups); the
control loop calls :meth:`RollupWriter.flush` every
``rollup_flush_interval_s``. A failed write keeps its rows for the next flush.
Retention is started from the same flush, at most once per
:data:`RETENTION_EVERY_S`, as a task of its own: it deletes in batches of
``retention_batch_rows``, each its own short transaction in a worker thread,
with a pause between them, so neither the control loop (evaluations, the next
flush) nor ingestion waits for a backlog of old rows to go, and SQLite's one
write lock is never held for longer than one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta

from tide.base.errors import TideError
from tide.services.common.clock import Clock
from tide.services.scaler.store import DecisionStore, RollupRecord
from tide.services.scaler.windows import Rollups
from tide.services.store.db import utc_from_epoch

logger = logging.getLogger(__name__)

#: How often retention deletes old rollups, seconds: an hour is fine-grained
#: against a retention of days, and keeps the DELETE off most flushes.
RETENTION_EVERY_S = 3600.0

#: Pause between two retention batches, seconds: other writers (a decision, a
#: flush) get the database, and on SQLite its write lock, in between.
RETENTION_PAUSE_S = 0.05


class RollupWriter:
    def __init__(
        self,
        store: DecisionStore,
        rollups: Rollups,
        clock: Clock,
        *,
        retention_days: float,
        detail_retention_days: float = 7.0,
        decision_retention_days: float | None = None,
        batch_rows: int = 1000,
    ) -> None:
        self.store = store
        self.rollups = rollups
        self.clock = clock
        self.retention = timedelta(days=retention_days)
        self.detail_retention = timedelta(days=detail_retention_days)
        self.decision_retention = (
            None if decision_retention_days is None else timedelta(days=decision_retention_days)
        )
        self.batch_rows = batch_rows
        self._next_retention_s: float | None = None
        self._task: asyncio.Task[int] | None = None

    async def flush(self, replicas: Mapping[str, int], *, final: bool = False) -> int:
        """Write the finished minutes of the jobs in ``replicas`` (with ``final``, the
        scaler is stopping: the current minute too); returns the rows written."""
        now = self.clock.now() + (120.0 if final else 0.0)
        rows = self.rollups.take_complete(now, dict(replicas))
        records = [
            RollupRecord(
                job_id=r.job_id,
                minute=utc_from_epoch(r.minute_s),
                mean_pct=r.mean_pct,
                min_pct=r.min_pct,
                max_pct=r.max_pct,
                samples=r.samples,
                replicas=r.replicas,
                second_sums=r.second_sums,
                second_counts=r.second_counts,
            )
            for r in rows
            if r.job_id in replicas and r.samples > 0
        ]
        written = 0
        if records:
            try:
                written = await self.store.write_rollups(records)
            except TideError as exc:
                logger.warning("rollups not written (%s); kept for the next flush", exc)
                self.rollups.put_back(rows)
        if not final:
            self.start_retention()
        return written

    def start_retention(self) -> None:
        """Start a retention pass in the background if one is due and none runs."""
        if self._task is not None and not self._task.done():
            return
        mono = self.clock.monotonic()
        if self._next_retention_s is not None and mono < self._next_retention_s:
            return
        self._next_retention_s = mono + RETENTION_EVERY_S
        self._task = asyncio.create_task(self._retention(), name="tide-retention")

    async def settled(self) -> int:
        """Wait for the running retention pass, if any; returns the rows it deleted."""
        if self._task is None:
            return 0
        return await self._task

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _retention(self) -> int:
        now = utc_from_epoch(self.clock.now())
        steps: list[tuple[str, Callable[[datetime, int], Awaitable[int]], datetime]] = [
            (
                "rollups",
                lambda b, n: self.store.delete_rollups_before(b, limit=n),
                now - self.retention,
            ),
            (
                "per-second rows",
                lambda b, n: self.store.delete_seconds_before(b, limit=n),
                now - self.detail_retention,
            ),
        ]
        if self.decision_retention is not None:
            steps.append(
                (
                    "decisions",
                    lambda b, n: self.store.delete_decisions_before(b, limit=n),
                    now - self.decision_retention,
                )
            )
        total = 0
        for what, delete, before in steps:
            deleted = 0
            try:
                while True:
                    n = await delete(before, self.batch_rows)
                    deleted += n
                    if n < self.batch_rows:
                        break
                    await asyncio.sleep(RETENTION_PAUSE_S)
            except TideError as exc:
                logger.warning("retention of %s failed (%s); tried again next time", what, exc)
                self._next_retention_s = None
            if deleted:
                logger.info("retention: %d %s before %s deleted", deleted, what, before)
            total += deleted
        return total
