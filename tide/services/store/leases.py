"""The leader lease in SQL: one row per lease name, taken when it has expired.

Shared by the scaler's replicas (tide/services/scaler/leases.py) and the
coordinator's (tide/services/coordinator/__main__.py); :class:`SqlLease` is the
:class:`~tide.services.store.leader.LeaseBackend` over a session factory, and
:func:`check_fence` is the coordinator's fencing token, read in its write
transactions.

The same compare-and-set as a Kubernetes Lease, in one transaction: the row is
read under a write lock (``FOR UPDATE`` on PostgreSQL, ``BEGIN IMMEDIATE`` on
SQLite), then renewed by its holder, taken over once expired, or left alone.
Times are the callers' clocks: replicas on different machines must agree
within a fraction of the lease (NTP does; the lease is seconds long), and the
fencing epoch of every job, not the lease, is what refuses a stale writer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tide.base.errors import Conflict, InvalidArgument
from tide.services.store.db import unit_of_work
from tide.services.store.models.scaler import LeaderLease

logger = logging.getLogger(__name__)


def aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be timezone-aware, got naive {value.isoformat()}")
    return value


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
    replicas, tide/services/scaler/leases.py), by name."""
    aware("now", now)
    rows = session.scalars(
        select(LeaderLease)
        .where(LeaderLease.name.startswith(prefix, autoescape=True), LeaderLease.expires_at > now)
        .order_by(LeaderLease.name)
    )
    return [_record(r) for r in rows]


class StaleLeader(Conflict):
    """A write fenced by a lease its writer no longer holds: another replica took the
    lease (a new epoch) while this one was paused or cut off."""


@dataclass(frozen=True)
class Fence:
    """The lease a leader's writes are fenced by: refused unless the lease row still
    names ``holder`` at ``epoch``."""

    name: str
    holder: str
    epoch: int


def check_fence(session: Session, fence: Fence) -> None:
    """Raise :class:`StaleLeader` unless ``fence`` still holds, in the caller's write
    transaction. The row is read ``FOR SHARE`` on PostgreSQL: a takeover (``FOR UPDATE``
    in :func:`try_lease`) waits for the write to commit, and a write that starts after
    the takeover reads the new holder. SQLite's write transactions are serial anyway.

    An expired lease nobody took yet still passes: until another replica leads, the
    holder's writes are the only ones."""
    row = session.scalars(
        select(LeaderLease).where(LeaderLease.name == fence.name).with_for_update(read=True)
    ).one_or_none()
    if row is None or row.holder != fence.holder or int(row.epoch) != fence.epoch:
        now = f"{row.holder} (epoch {int(row.epoch)})" if row is not None else "nobody's"
        raise StaleLeader(
            f"lease {fence.name} is now {now}, not {fence.holder} (epoch {fence.epoch}): "
            "this replica no longer leads and its write is refused"
        )


class SqlLease:
    """A :class:`~tide.services.store.leader.LeaseBackend` on the lease row of the store
    (the scaler's :class:`~tide.services.scaler.store.DecisionStore` is another)."""

    def __init__(
        self, factory: sessionmaker[Session], owner_id: str, now: Callable[[], datetime]
    ) -> None:
        if not owner_id:
            raise InvalidArgument("lease owner_id must not be empty")
        self._factory = factory
        self.owner_id = owner_id
        self._now = now

    async def try_lease(self, name: str, address: str, *, duration_s: float) -> LeaseRecord:
        now = self._now()
        return await asyncio.to_thread(
            unit_of_work,
            self._factory,
            lambda s: try_lease(s, name, self.owner_id, address, duration_s=duration_s, now=now),
            what=f"lease {name}",
        )

    async def release_lease(self, name: str) -> bool:
        now = self._now()
        return await asyncio.to_thread(
            unit_of_work,
            self._factory,
            lambda s: release_lease(s, name, self.owner_id, now=now),
            what=f"release lease {name}",
        )
