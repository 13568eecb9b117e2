"""The leader lease in SQL: one row per lease name, taken when it has expired.

The same compare-and-set as a Kubernetes Lease, in one transaction: the row is
read under a write lock (``FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on
SQLite), then renewed by its holder, taken over once expired, or left alone.
Times are the callers' clocks: replicas on different machines must agree
within a fraction of the lease (NTP does; the lease is seconds long), and the
fencing epoch of every job, not the lease, is what refuses a stale writer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.scaler.store.rows import aware
from services.store.models.scaler import LeaderLease
from tidebase.errors import InvalidArgument

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    name: str
    holder: str
    address: str
    epoch: int
    acquired_at: datetime
    expires_at: datetime

    def held_by(self, holder: str) -> bool:
        return self.holder == holder


def _record(row: LeaderLease) -> LeaseRecord:
    return LeaseRecord(
        name=row.name,
        holder=row.holder,
        address=row.address,
        epoch=int(row.epoch),
        acquired_at=row.acquired_at,
        expires_at=row.expires_at,
    )


def try_lease(
    session: Session,
    name: str,
    holder: str,
    address: str,
    *,
    duration_s: float,
    now: datetime,
) -> LeaseRecord:
    """Renew the lease if ``holder`` has it, take it if it expired (or never
    existed); returns the lease as it stands after, whoever holds it."""
    aware("now", now)
    if not holder:
        raise InvalidArgument("lease holder must not be empty")
    if not duration_s > 0:
        raise InvalidArgument(f"lease duration_s must be > 0, got {duration_s!r}")
    expires = now + timedelta(seconds=duration_s)
    row = session.scalars(
        select(LeaderLease).where(LeaderLease.name == name).with_for_update()
    ).one_or_none()
    if row is None:
        row = LeaderLease(
            name=name,
            holder=holder,
            address=address,
            epoch=1,
            acquired_at=now,
            renewed_at=now,
            expires_at=expires,
        )
        session.add(row)
        session.flush()
        logger.info("%s: lease %s taken (epoch 1)", holder, name)
        return _record(row)
    if row.holder == holder and row.expires_at > now:
        row.renewed_at, row.expires_at, row.address = now, expires, address
        session.flush()
        return _record(row)
    if row.expires_at <= now:
        previous = row.holder
        row.holder, row.address = holder, address
        row.epoch = row.epoch + 1
        row.acquired_at, row.renewed_at, row.expires_at = now, now, expires
        session.flush()
        logger.info("%s: lease %s taken from %s (epoch %d)", holder, name, previous, int(row.epoch))
    return _record(row)


def release_lease(session: Session, name: str, holder: str, *, now: datetime) -> bool:
    """Let the lease go at once (a clean shutdown), if ``holder`` has it."""
    aware("now", now)
    row = session.scalars(
        select(LeaderLease).where(LeaderLease.name == name).with_for_update()
    ).one_or_none()
    if row is None or row.holder != holder or row.expires_at <= now:
        return False
    row.expires_at = now
    session.flush()
    return True


def read_lease(session: Session, name: str) -> LeaseRecord | None:
    row = session.get(LeaderLease, name)
    return _record(row) if row is not None else None


def live_leases(session: Session, prefix: str, *, now: datetime) -> list[LeaseRecord]:
    """The unexpired leases whose name starts with ``prefix`` (the shard leases' live
    replicas, services/scaler/shards.py), by name."""
    aware("now", now)
    rows = session.scalars(
        select(LeaderLease)
        .where(LeaderLease.name.startswith(prefix, autoescape=True), LeaderLease.expires_at > now)
        .order_by(LeaderLease.name)
    )
    return [_record(r) for r in rows]
