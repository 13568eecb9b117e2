"""Utilization history: finished minutes go to SQL, minutes past retention go away.

Each minute is written twice: its mean, min and max (``utilization_rollups``,
kept ``rollup_retention_days``) and each of its seconds (``utilization_seconds``,
kept ``detail_retention_days``: what `tide whatif` replays).

Ingestion accumulates per-minute rollups in memory (windows.Rollups); the
control loop calls :meth:`RollupHistory.flush` every
``rollup_flush_interval_s``. A failed write keeps its rows for the next flush.
Retention runs from the same flush, at most once per
:data:`RETENTION_EVERY_S`, so the rollup table stays bounded
(``rollup_retention_days``) without a job of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

from services.common.clock import Clock
from services.scaler.store import DecisionStore, RollupRecord
from services.scaler.windows import Rollups
from services.store.db import utc_from_epoch
from tidebase.errors import TideError

logger = logging.getLogger(__name__)

#: How often retention deletes old rollups, seconds: an hour is fine-grained
#: against a retention of days, and keeps the DELETE off most flushes.
RETENTION_EVERY_S = 3600.0


class RollupHistory:
    def __init__(
        self,
        store: DecisionStore,
        rollups: Rollups,
        clock: Clock,
        *,
        retention_days: float,
        detail_retention_days: float = 7.0,
    ) -> None:
        self.store = store
        self.rollups = rollups
        self.clock = clock
        self.retention = timedelta(days=retention_days)
        self.detail_retention = timedelta(days=detail_retention_days)
        self._next_retention_s: float | None = None

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
            await self.apply_retention()
        return written

    async def apply_retention(self) -> int:
        """Delete rollups (and per-second detail) older than their retention, if due;
        returns how many rows went."""
        mono = self.clock.monotonic()
        if self._next_retention_s is not None and mono < self._next_retention_s:
            return 0
        self._next_retention_s = mono + RETENTION_EVERY_S
        now = utc_from_epoch(self.clock.now())
        before = now - self.retention
        try:
            deleted = await self.store.delete_rollups_before(before)
            deleted += await self.store.delete_seconds_before(now - self.detail_retention)
        except TideError as exc:
            logger.warning("rollup retention failed (%s); tried again next time", exc)
            self._next_retention_s = None
            return 0
        if deleted:
            logger.info("rollup retention: %d row(s) before %s deleted", deleted, before)
        return deleted
