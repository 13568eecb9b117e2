"""Helpers every repository module shares: row -> record conversions, validation,
flushes that turn a lost optimistic-lock race into StaleWrite."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import Row, Table, Update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from tide.base.errors import InvalidArgument
from tide.services.scaler.store.records import (
    DecisionEventRecord,
    DecisionRecord,
    DecisionState,
    JobRecord,
    RollupRecord,
)
from tide.services.store.db import json_dumps
from tide.services.store.failures import StaleWrite
from tide.services.store.models.scaler import (
    JOB_ID_LEN,
    Decision,
    DecisionEvent,
    Job,
    UtilizationRollup,
    UtilizationSeconds,
)

# Core handles for the UPDATEs that must not go through the ORM's version check.
JOBS: Final = cast(Table, Job.__table__)
DECISIONS: Final = cast(Table, Decision.__table__)
ROLLUPS: Final = cast(Table, UtilizationRollup.__table__)
SECONDS: Final = cast(Table, UtilizationSeconds.__table__)


def job_record(row: Job) -> JobRecord:
    return JobRecord(
        job_id=row.job_id,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        current_replicas=row.current_replicas,
        gpus_per_replica=row.gpus_per_replica,
        policy_overrides=dict(row.policy_overrides),
        autoscaling_paused=row.autoscaling_paused,
        pause_reason=row.pause_reason,
        paused_at=row.paused_at,
        generation=row.generation,
        last_resize_ended_at=row.last_resize_ended_at,
        owner_epoch=row.owner_epoch,
        owner_id=row.owner_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        version=row.version,
    )


def decision_record(row: Decision | Row[Any], *, with_inputs: bool = True) -> DecisionRecord:
    """The record of an ORM row or of a plain row of the same columns (pages)."""
    return DecisionRecord(
        id=row.id,
        job_id=row.job_id,
        from_replicas=row.from_replicas,
        to_replicas=row.to_replicas,
        reason=row.reason,
        trigger=row.trigger,
        message=row.message,
        inputs=dict(row.inputs) if with_inputs else {},
        state=DecisionState(row.state),
        error=row.error,
        pause_s=row.pause_s,
        lost_steps=row.lost_steps,
        generation=row.generation,
        requested_by=row.requested_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        ended_at=row.ended_at,
        version=row.version,
    )


def event_record(row: DecisionEvent) -> DecisionEventRecord:
    return DecisionEventRecord(
        id=row.id,
        decision_id=row.decision_id,
        state=DecisionState(row.state),
        at=row.at,
        detail=row.detail,
    )


def rollup_record(row: UtilizationRollup) -> RollupRecord:
    return RollupRecord(
        job_id=row.job_id,
        minute=row.minute,
        mean_pct=row.mean_pct,
        min_pct=row.min_pct,
        max_pct=row.max_pct,
        samples=row.samples,
        replicas=row.replicas,
    )


def validate_job_id(job_id: str) -> None:
    """A job id is "namespace/name", both parts non-empty, no further slash."""
    parts = job_id.split("/")
    if len(parts) != 2 or not all(parts) or len(job_id) > JOB_ID_LEN:
        raise InvalidArgument(
            f"job_id must be 'namespace/name' of at most {JOB_ID_LEN} chars, got {job_id!r}"
        )
    if any(c.isspace() for c in job_id):
        raise InvalidArgument(f"job_id must not contain whitespace, got {job_id!r}")


def check_limit(limit: int) -> None:
    """A batch bound of a bounded delete (retention): at least one row."""
    if limit < 1:
        raise InvalidArgument(f"limit must be >= 1, got {limit}")


def aware(name: str, value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be timezone-aware, got naive {value.isoformat()}")
    return value


def json_copy(value: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The value as it will read back from the database (NaN becomes null, tuples lists)."""
    try:
        copied: dict[str, Any] = json.loads(json_dumps(dict(value)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} is not JSON-serialisable: {exc}") from exc
    return copied


def flush(session: Session, what: str) -> None:
    try:
        session.flush()
    except StaleDataError as exc:
        raise StaleWrite(f"{what}: a concurrent writer changed the row first") from exc


def execute(session: Session, stmt: Update) -> int:
    """Run a Core UPDATE on the session's connection; returns the matched row count."""
    result = session.connection().execute(stmt)
    assert isinstance(result, CursorResult)
    return result.rowcount
