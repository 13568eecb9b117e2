"""Per-minute utilization rollups: merge-on-write, range reads, retention."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Delete, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from tide.base.errors import FailedPrecondition, InvalidArgument
from tide.services.scaler.store.records import RollupRecord
from tide.services.scaler.store.rows import (
    ROLLUPS,
    SECONDS,
    aware,
    check_limit,
    rollup_record,
    validate_job_id,
)
from tide.services.store.models.scaler import UtilizationRollup, UtilizationSeconds


def _validate_rollup(r: RollupRecord) -> None:
    validate_job_id(r.job_id)
    aware("minute", r.minute)
    if r.minute.second or r.minute.microsecond:
        raise InvalidArgument(
            f"rollup of job {r.job_id}: minute must be the start of a minute, "
            f"got {r.minute.isoformat()}"
        )
    values = (r.mean_pct, r.min_pct, r.max_pct)
    if not all(math.isfinite(v) and 0.0 <= v <= 100.0 for v in values):
        raise InvalidArgument(
            f"rollup of job {r.job_id} at {r.minute.isoformat()}: percentages must be "
            f"finite in 0..100, got mean={r.mean_pct} min={r.min_pct} max={r.max_pct}"
        )
    if not (r.min_pct <= r.mean_pct <= r.max_pct):
        raise InvalidArgument(
            f"rollup of job {r.job_id} at {r.minute.isoformat()}: need min <= mean <= max, "
            f"got {r.min_pct} / {r.mean_pct} / {r.max_pct}"
        )
    if r.samples < 1:
        raise InvalidArgument(f"rollup of job {r.job_id}: samples must be >= 1, got {r.samples}")
    if r.replicas < 0:
        raise InvalidArgument(f"rollup of job {r.job_id}: replicas must be >= 0, got {r.replicas}")
    if r.second_counts or r.second_sums:
        if len(r.second_counts) != 60 or len(r.second_sums) != 60:
            raise InvalidArgument(
                f"rollup of job {r.job_id}: per-second detail needs 60 sums and 60 counts, "
                f"got {len(r.second_sums)} and {len(r.second_counts)}"
            )
        if sum(r.second_counts) != r.samples or min(r.second_counts) < 0:
            raise InvalidArgument(
                f"rollup of job {r.job_id}: per-second counts must be >= 0 and add up to "
                f"samples={r.samples}, got {sum(r.second_counts)}"
            )


def merge_rollups(a: RollupRecord, b: RollupRecord) -> RollupRecord:
    """Two partial rollups of the same job and minute as one; ``b`` is the later write."""
    samples = a.samples + b.samples
    return RollupRecord(
        job_id=a.job_id,
        minute=a.minute,
        mean_pct=(a.mean_pct * a.samples + b.mean_pct * b.samples) / samples,
        min_pct=min(a.min_pct, b.min_pct),
        max_pct=max(a.max_pct, b.max_pct),
        samples=samples,
        replicas=b.replicas,
    )


def write_rollups(session: Session, rows: Iterable[RollupRecord]) -> int:
    """Add per-minute rollups; a minute already stored merges with the new part.

    Each write carries the samples that arrived since the previous write of
    that minute (a delta, not a running total): means combine weighted by
    samples, min and max widen, replicas take the newest value. Returns the
    number of (job, minute) rows written.
    """
    rows = list(rows)
    merged: dict[tuple[str, datetime], RollupRecord] = {}
    for r in rows:
        _validate_rollup(r)
        key = (r.job_id, r.minute)
        merged[key] = merge_rollups(merged[key], r) if key in merged else r
    if not merged:
        return 0
    values = [
        {
            "job_id": r.job_id,
            "minute": r.minute,
            "mean_pct": r.mean_pct,
            "min_pct": r.min_pct,
            "max_pct": r.max_pct,
            "samples": r.samples,
            "replicas": r.replicas,
        }
        for r in merged.values()
    ]
    table = ROLLUPS
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        pg_stmt = postgresql.insert(table)
        ex = pg_stmt.excluded
        least, greatest = "least", "greatest"
        base: Any = pg_stmt
    elif dialect == "sqlite":
        lite_stmt = sqlite.insert(table)
        ex = lite_stmt.excluded
        # SQLite's multi-argument min()/max() are scalar, like LEAST/GREATEST.
        least, greatest = "min", "max"
        base = lite_stmt
    else:
        raise FailedPrecondition(f"rollup upsert is not implemented for {dialect}")
    c = table.c
    total = c.samples + ex.samples
    stmt = base.on_conflict_do_update(
        index_elements=[c.job_id, c.minute],
        set_={
            "mean_pct": (c.mean_pct * c.samples + ex.mean_pct * ex.samples) / total,
            "min_pct": getattr(func, least)(c.min_pct, ex.min_pct),
            "max_pct": getattr(func, greatest)(c.max_pct, ex.max_pct),
            "samples": total,
            "replicas": ex.replicas,
        },
    )
    session.connection().execute(stmt, values)
    # Each part of a minute is its own row here; readers add them up (seconds_between).
    detail = [
        {
            "job_id": r.job_id,
            "minute": r.minute,
            "sums": list(r.second_sums),
            "counts": list(r.second_counts),
        }
        for r in rows
        if r.second_counts
    ]
    if detail:
        session.connection().execute(SECONDS.insert(), detail)
    return len(values)


def rollups_between(
    session: Session, job_id: str, t0: datetime, t1: datetime
) -> list[RollupRecord]:
    """The job's rollups with t0 <= minute < t1, oldest first."""
    aware("t0", t0)
    aware("t1", t1)
    rows = session.scalars(
        select(UtilizationRollup)
        .where(
            UtilizationRollup.job_id == job_id,
            UtilizationRollup.minute >= t0,
            UtilizationRollup.minute < t1,
        )
        .order_by(UtilizationRollup.minute)
    )
    return [rollup_record(r) for r in rows]


def seconds_between(
    session: Session, job_id: str, t0: datetime, t1: datetime
) -> dict[datetime, tuple[tuple[float, ...], tuple[int, ...]]]:
    """Per minute with t0 <= minute < t1, the per-second sums and counts of the job
    (the parts of a minute added up); minutes without detail are absent."""
    aware("t0", t0)
    aware("t1", t1)
    rows = session.scalars(
        select(UtilizationSeconds)
        .where(
            UtilizationSeconds.job_id == job_id,
            UtilizationSeconds.minute >= t0,
            UtilizationSeconds.minute < t1,
        )
        .order_by(UtilizationSeconds.minute, UtilizationSeconds.id)
    )
    out: dict[datetime, tuple[list[float], list[int]]] = {}
    for row in rows:
        minute = row.minute
        have = out.get(minute)
        if have is None:
            out[minute] = (list(row.sums), list(row.counts))
            continue
        for i in range(60):
            have[0][i] += row.sums[i]
            have[1][i] += row.counts[i]
    return {m: (tuple(s), tuple(c)) for m, (s, c) in out.items()}


def delete_seconds_before(session: Session, before: datetime, *, limit: int | None = None) -> int:
    """Retention of the per-second detail: rows of minutes before ``before``, at most
    ``limit`` of them (oldest first) when given; returns how many went."""
    aware("before", before)
    table = SECONDS
    old = table.c.minute < before
    if limit is None:
        return _deleted(session, table.delete().where(old))
    check_limit(limit)
    ids = select(table.c.id).where(old).order_by(table.c.minute, table.c.id).limit(limit)
    return _deleted(session, table.delete().where(table.c.id.in_(ids.scalar_subquery())))


def delete_rollups_before(session: Session, before: datetime, *, limit: int | None = None) -> int:
    """Retention: drop rollups older than ``before``, at most ``limit`` of them (oldest
    first, off the minute index) when given; returns how many."""
    aware("before", before)
    table = ROLLUPS
    old = table.c.minute < before
    if limit is None:
        return _deleted(session, table.delete().where(old))
    check_limit(limit)
    keys = select(table.c.job_id, table.c.minute).where(old).order_by(table.c.minute).limit(limit)
    return _deleted(session, table.delete().where(tuple_(table.c.job_id, table.c.minute).in_(keys)))


def _deleted(session: Session, stmt: Delete) -> int:
    result = session.connection().execute(stmt)
    assert isinstance(result, CursorResult)
    return result.rowcount
