"""SQL tables of the coordinator: jobs (its counters), members, generations,
checkpoints, resizes and directives.

Only tide.services.coordinator.sql_store touches these classes; the core works on the
dataclasses of tide.services.coordinator.domain. Any change here needs the matching
change in tide/services/store/migrations/versions/ (0002_coordinator.py, 0007_crash_loop.py;
tests/store compares them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Double, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from tide.services.store.db import Base, UTCDateTime

JOB_ID_LEN = 253
MEMBER_ID_LEN = 300
_JOB_FK = "coordinator_jobs.job_id"


class CoordJob(Base):
    __tablename__ = "coordinator_jobs"

    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger)
    # Last directive number handed out; directive ids stay unique across restarts.
    directive_seq: Mapped[int] = mapped_column(BigInteger)
    lost_steps_total: Mapped[int] = mapped_column(BigInteger)
    # Why the job failed for good (NULL while it has not); migration 0007.
    failure: Mapped[str | None] = mapped_column(Text)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    version: Mapped[int] = mapped_column(Integer)

    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


class CoordMember(Base):
    __tablename__ = "coordinator_members"

    member_id: Mapped[str] = mapped_column(String(MEMBER_ID_LEN), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), ForeignKey(_JOB_FK, ondelete="CASCADE"))
    pod_name: Mapped[str] = mapped_column(String(253))
    pod_index: Mapped[int] = mapped_column(Integer)
    pod_uid: Mapped[str] = mapped_column(String(128))
    host: Mapped[str] = mapped_column(String(255))
    launcher_id: Mapped[str] = mapped_column(String(128))
    free_port: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    rank: Mapped[int | None] = mapped_column(Integer)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime)
    version: Mapped[int] = mapped_column(Integer)

    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012
    __table_args__ = (Index("ix_coordinator_members_job_id", "job_id"),)


class CoordGeneration(Base):
    __tablename__ = "coordinator_generations"

    job_id: Mapped[str] = mapped_column(
        String(JOB_ID_LEN), ForeignKey(_JOB_FK, ondelete="CASCADE"), primary_key=True
    )
    generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    world_size: Mapped[int] = mapped_column(Integer)
    member_ids: Mapped[list[str]] = mapped_column(JSON)
    master_endpoint: Mapped[str] = mapped_column(String(300))
    trainer_endpoints: Mapped[list[str]] = mapped_column(JSON)
    restore_step: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    reason: Mapped[str] = mapped_column(Text)
    decision_id: Mapped[int | None] = mapped_column(BigInteger)
    lost_steps: Mapped[int] = mapped_column(BigInteger)
    # What the generation before reached and what its workers restored; migration 0007.
    reached_step: Mapped[int] = mapped_column(BigInteger, server_default="0")
    restored_step: Mapped[int | None] = mapped_column(BigInteger)


class CoordCheckpoint(Base):
    __tablename__ = "coordinator_checkpoints"

    job_id: Mapped[str] = mapped_column(
        String(JOB_ID_LEN), ForeignKey(_JOB_FK, ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    digest: Mapped[str] = mapped_column(String(128))
    # Promoted when the generation restoring from it is opened; an aborted
    # barrier's checkpoint stays not good.
    good: Mapped[bool] = mapped_column(Boolean)
    write_s: Mapped[float] = mapped_column(Double)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class CoordResize(Base):
    __tablename__ = "coordinator_resizes"

    decision_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    job_id: Mapped[str] = mapped_column(String(JOB_ID_LEN), ForeignKey(_JOB_FK, ondelete="CASCADE"))
    target_world_size: Mapped[int] = mapped_column(Integer)
    min_world_size: Mapped[int] = mapped_column(Integer)
    leaving_pods: Mapped[list[str]] = mapped_column(JSON)
    deadline_s: Mapped[float] = mapped_column(Double)
    phase: Mapped[str] = mapped_column(String(24))
    from_generation: Mapped[int] = mapped_column(BigInteger)
    to_generation: Mapped[int] = mapped_column(BigInteger)
    checkpoint_step: Mapped[int] = mapped_column(BigInteger)
    participants: Mapped[list[str]] = mapped_column(JSON)
    newcomers: Mapped[list[str]] = mapped_column(JSON)
    leaving: Mapped[list[str]] = mapped_column(JSON)
    acked: Mapped[list[str]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    phase_started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    held_at_latest: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rendezvous_sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    checkpoint_digest: Mapped[str] = mapped_column(String(128))
    checkpoint_write_s: Mapped[float] = mapped_column(Double)
    pause_s: Mapped[float] = mapped_column(Double)
    breakdown: Mapped[dict[str, Any]] = mapped_column(JSON)
    message: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer)

    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012
    __table_args__ = (Index("ix_coordinator_resizes_job_id_started_at", "job_id", "started_at"),)


class CoordDirective(Base):
    __tablename__ = "coordinator_directives"

    job_id: Mapped[str] = mapped_column(
        String(JOB_ID_LEN), ForeignKey(_JOB_FK, ondelete="CASCADE"), primary_key=True
    )
    directive_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    member_id: Mapped[str] = mapped_column(String(MEMBER_ID_LEN))
    kind: Mapped[str] = mapped_column(String(16))
    generation: Mapped[int] = mapped_column(BigInteger)
    checkpoint_step: Mapped[int] = mapped_column(BigInteger)
    rendezvous: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    reason: Mapped[str] = mapped_column(Text)
    acked: Mapped[bool] = mapped_column(Boolean)
    ack_ok: Mapped[bool] = mapped_column(Boolean)
    superseded: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (Index("ix_coordinator_directives_job_id_seq", "job_id", "seq"),)
