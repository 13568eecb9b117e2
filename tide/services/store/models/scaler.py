"""SQL tables of the scaler: jobs, decisions, their state changes, per-minute utilization.

Only tide.services.scaler.store touches these classes; everything else gets the
frozen records that repo returns. Each column is described in docs/store.md.
Any change here needs a migration in tide/services/store/migrations/versions/
(tests/store checks that the two agree).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from tide.services.store.db import Base, UTCDateTime

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a bigint identity.
BigIntPk = BigInteger().with_variant(Integer(), "sqlite")

JOB_ID_LEN = 253  # "namespace/name": a namespace is <= 63 chars, a name <= 189 here.

#: Decision states that are not final, and the SQL predicate of the partial index over
#: them. A query uses that index only if it repeats the predicate word for word (SQLite
#: matches partial indexes on identical terms), so both are built from this one tuple.
OPEN_STATES = ("PENDING", "PREPARING", "ACTUATING")
OPEN_PREDICATE = "state IN ({})".format(", ".join(f"'{s}'" for s in OPEN_STATES))


class Job(Base):
    __tablename__ = "jobs"

    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    min_replicas: Mapped[int] = mapped_column(Integer)
    max_replicas: Mapped[int] = mapped_column(Integer)
    current_replicas: Mapped[int] = mapped_column(Integer)
    gpus_per_replica: Mapped[int] = mapped_column(Integer)
    # Only the fields the operator set; the scaler merges them over its defaults.
    policy_overrides: Mapped[dict[str, Any]] = mapped_column(JSON)
    autoscaling_paused: Mapped[bool] = mapped_column()
    pause_reason: Mapped[str] = mapped_column(Text)
    paused_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    generation: Mapped[int] = mapped_column(BigInteger)
    last_resize_ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # Fencing: the scaler that last took the job holds owner_epoch; every
    # decision write is conditional on it in the same transaction.
    owner_epoch: Mapped[int] = mapped_column(BigInteger)
    owner_id: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    version: Mapped[int] = mapped_column(Integer)

    # SQLAlchemy reads this per class; DeclarativeBase types it as an instance attribute.
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


class Decision(Base):
    __tablename__ = "decisions"

    id: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(
        String(JOB_ID_LEN), ForeignKey("jobs.job_id", ondelete="CASCADE")
    )
    from_replicas: Mapped[int] = mapped_column(Integer)
    to_replicas: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(64))
    trigger: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    inputs: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16))
    error: Mapped[str] = mapped_column(Text)
    pause_s: Mapped[float] = mapped_column()
    lost_steps: Mapped[int] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(BigInteger)
    requested_by: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    version: Mapped[int] = mapped_column(Integer)

    # SQLAlchemy reads this per class; DeclarativeBase types it as an instance attribute.
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012
    __table_args__ = (
        Index("ix_decisions_job_id_created_at", "job_id", "created_at"),
        # History across all jobs pages by (created_at, id).
        Index("ix_decisions_created_at_id", "created_at", "id"),
        # The few decisions not final yet: the exclusivity check and start-up read only these.
        Index(
            "ix_decisions_open",
            "job_id",
            "created_at",
            "id",
            sqlite_where=text(OPEN_PREDICATE),
            postgresql_where=text(OPEN_PREDICATE),
        ),
    )


class DecisionEvent(Base):
    __tablename__ = "decision_events"

    id: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    decision_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("decisions.id", ondelete="CASCADE")
    )
    state: Mapped[str] = mapped_column(String(16))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    detail: Mapped[str] = mapped_column(Text)
    # The job's owner epoch the writer held (0 for rows from before 0006): an audit
    # of fencing, since a job's events must never go back to an older epoch.
    owner_epoch: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (Index("ix_decision_events_decision_id_at", "decision_id", "at"),)


class LeaderLease(Base):
    """Who leads among the scaler replicas (leader election without Kubernetes)."""

    __tablename__ = "leader_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    address: Mapped[str] = mapped_column(String(255))
    # Incremented at every change of holder: a fencing token for the lease itself.
    epoch: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class UtilizationRollup(Base):
    __tablename__ = "utilization_rollups"

    # No foreign key: telemetry of a job may arrive before (or after) its row in jobs.
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    mean_pct: Mapped[float] = mapped_column()
    min_pct: Mapped[float] = mapped_column()
    max_pct: Mapped[float] = mapped_column()
    samples: Mapped[int] = mapped_column(BigInteger)
    replicas: Mapped[int] = mapped_column(Integer)

    # The primary key starts with job_id; reads across jobs and retention go by minute.
    __table_args__ = (Index("ix_utilization_rollups_minute", "minute"),)


class UtilizationSeconds(Base):
    """Each second of one minute of a job's utilization: what `tide whatif` replays.

    Insert-only: a minute written in parts (late reports) has one row per part, and
    readers add the parts up. Kept for fewer days than the minutes
    (``utilization_detail_retention_days``): a row is 60 sums and 60 counts."""

    __tablename__ = "utilization_seconds"

    id: Mapped[int] = mapped_column(BigIntPk, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN))
    minute: Mapped[datetime] = mapped_column(UTCDateTime)
    # Per second of the minute: the sum of the samples' utilization (percent) and their count.
    sums: Mapped[list[float]] = mapped_column(JSON)
    counts: Mapped[list[int]] = mapped_column(JSON)

    __table_args__ = (
        Index("ix_utilization_seconds_job_id_minute", "job_id", "minute"),
        Index("ix_utilization_seconds_minute", "minute"),
    )
