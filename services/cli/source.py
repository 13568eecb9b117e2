"""Where the CLI reads the scaling history from: the scaler over gRPC, or the SQL store offline.

Both sources answer with the API's messages (tide.v1), so every command
renders one shape whatever it read. The offline source exists for the
questions asked when the scaler is down or gone (an incident review, a
`tide demo` state dir): it only reads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Protocol, cast

import grpc
from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

from services.common import errors
from services.common.client import bearer, domain_error, open_channel

logger = logging.getLogger(__name__)

#: ListDecisions page size the CLI asks for; the API caps pages at 1000.
PAGE_SIZE = 500

#: The API's limit on GetDecision.context_minutes.
MAX_CONTEXT_MINUTES = 1440


class HistorySource(Protocol):
    """Read side of the scaler, as the CLI needs it."""

    async def list_jobs(self) -> list[scaler_pb2.Job]: ...

    async def get_job(self, job_id: str) -> scaler_pb2.Job: ...

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        """Every matching decision, newest first (all pages)."""
        ...

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail: ...

    async def utilization(
        self, job_id: str, since: datetime, until: datetime
    ) -> list[scaler_pb2.UtilizationPoint]:
        """Per-minute rollups of ``job_id`` in [since, until), oldest first."""
        ...


def ts_of(dt: datetime | None) -> Timestamp:
    ts = Timestamp()
    if dt is not None:
        ts.FromDatetime(dt.astimezone(UTC))
    return ts


def dt_of(ts: Timestamp) -> datetime | None:
    """None for an unset timestamp (seconds and nanos both 0)."""
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return ts.ToDatetime(tzinfo=UTC)


# --- gRPC -----------------------------------------------------------------------------------


class GrpcScaler:
    """The scaler's API over one channel. Use as ``async with GrpcScaler(...) as s``."""

    def __init__(
        self,
        target: str,
        *,
        token: str = "",
        timeout_s: float = 5.0,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
    ) -> None:
        self._target = target
        self._token = token
        self._timeout_s = timeout_s
        self._tls = (ca_file, cert_file, key_file)
        self._channel: grpc.aio.Channel | None = None
        self._stub: scaler_pb2_grpc.ScalerStub | None = None

    async def __aenter__(self) -> GrpcScaler:
        ca, cert, key = self._tls
        self._channel = open_channel(self._target, ca_file=ca, cert_file=cert, key_file=key)
        self._stub = scaler_pb2_grpc.ScalerStub(self._channel)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> scaler_pb2_grpc.ScalerStub:
        if self._stub is None:
            raise RuntimeError("GrpcScaler used outside 'async with'")
        return self._stub

    async def _call(self, method: Any, request: Any, *, admin: bool = False) -> Any:
        try:
            return await method(
                request,
                timeout=self._timeout_s,
                metadata=bearer(self._token) if admin else None,
                wait_for_ready=False,
            )
        except grpc.aio.AioRpcError as exc:
            err = domain_error(exc)
            if isinstance(err, errors.Unavailable):
                raise errors.Unavailable(
                    f"scaler at {self._target} unreachable: {exc.details()}"
                ) from None
            if isinstance(err, errors.DeadlineExceeded):
                raise errors.DeadlineExceeded(
                    f"scaler at {self._target} did not answer within {self._timeout_s:g} s"
                ) from None
            raise err from None

    async def list_jobs(self) -> list[scaler_pb2.Job]:
        resp = await self._call(self.stub.ListJobs, scaler_pb2.ListJobsRequest())
        return list(resp.jobs)

    async def get_job(self, job_id: str) -> scaler_pb2.Job:
        job: scaler_pb2.Job = await self._call(
            self.stub.GetJob, scaler_pb2.GetJobRequest(job_id=job_id)
        )
        return job

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        out: list[scaler_pb2.Decision] = []
        token = ""
        while True:
            req = scaler_pb2.ListDecisionsRequest(
                job_id=job_id, page_size=PAGE_SIZE, page_token=token
            )
            req.states.extend(cast(Any, states))
            if since is not None:
                req.since.CopyFrom(ts_of(since))
            if until is not None:
                req.until.CopyFrom(ts_of(until))
            resp = await self._call(self.stub.ListDecisions, req)
            out.extend(resp.decisions)
            token = resp.next_page_token
            if not token:
                return out

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail:
        detail: scaler_pb2.DecisionDetail = await self._call(
            self.stub.GetDecision,
            scaler_pb2.GetDecisionRequest(id=decision_id, context_minutes=context_minutes),
        )
        return detail

    async def utilization(
        self, job_id: str, since: datetime, until: datetime
    ) -> list[scaler_pb2.UtilizationPoint]:
        # The API serves rollups only around a decision (GetDecision), so the
        # range is covered from the decisions inside it; minutes far from any
        # decision stay empty. A ListUtilization RPC would remove this detour.
        await self.get_job(job_id)  # NotFound for an unknown job, like the SQL source
        span_min = math.ceil((until - since).total_seconds() / 60)
        context = max(1, min(MAX_CONTEXT_MINUTES, span_min))
        points: dict[datetime, scaler_pb2.UtilizationPoint] = {}
        for d in await self.list_decisions(job_id, since, until, ()):
            detail = await self.get_decision(d.id, context)
            for p in detail.utilization:
                minute = dt_of(p.minute)
                if minute is not None and since - timedelta(minutes=1) < minute < until:
                    points[minute] = p
        return [points[k] for k in sorted(points)]

    async def request_resize(
        self, job_id: str, replicas: int, reason: str, requested_by: str
    ) -> scaler_pb2.Decision:
        decision: scaler_pb2.Decision = await self._call(
            self.stub.RequestResize,
            scaler_pb2.RequestResizeRequest(
                job_id=job_id, replicas=replicas, reason=reason, requested_by=requested_by
            ),
            admin=True,
        )
        return decision

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> scaler_pb2.Job:
        job: scaler_pb2.Job = await self._call(
            self.stub.SetAutoscaling,
            scaler_pb2.SetAutoscalingRequest(job_id=job_id, paused=paused, reason=reason),
            admin=True,
        )
        return job


# --- SQL (offline) --------------------------------------------------------------------------


def enum_value(enum: Any, prefix: str, stored: str) -> Any:
    """The API enum value of a name stored in SQL (``COMPLETED`` or ``DECISION_STATE_COMPLETED``)."""
    name = stored if stored.startswith(prefix) else prefix + stored
    try:
        return int(enum.Value(name))
    except ValueError:
        return 0


def _state(stored: str) -> Any:
    return enum_value(common_pb2.DecisionState, "DECISION_STATE_", stored)


class SqlHistory:
    """Reads the scaler's tables directly; never writes. Use as ``async with``."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._engine: Any = None

    async def __aenter__(self) -> SqlHistory:
        from sqlalchemy import inspect
        from sqlalchemy.exc import DBAPIError

        from services.common import db

        engine = db.make_engine(self._url)
        try:
            tables = set(inspect(engine).get_table_names())
        except DBAPIError as exc:
            engine.dispose()
            raise errors.Unavailable(
                f"database {db._safe(self._url)} unreachable: {exc.orig}"
            ) from None
        if "decisions" not in tables:
            engine.dispose()
            raise errors.NotFound(
                f"database {db._safe(self._url)} has no Tide schema (run `tide db upgrade`)"
            )
        self._engine = engine
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._engine is not None:
            self._engine.dispose()

    def _read(self, fn: Any) -> Any:
        from sqlalchemy.exc import DBAPIError
        from sqlalchemy.orm import Session

        try:
            with Session(self._engine) as session:
                return fn(session)
        except DBAPIError as exc:
            raise errors.Unavailable(f"database read failed: {exc.orig}") from None

    # Row → message converters. Field by field, because the tables are the
    # store's business and may hold more than the API shows.

    @staticmethod
    def _decision(row: Any) -> scaler_pb2.Decision:
        d: Any = scaler_pb2.Decision(
            id=row.id,
            job_id=row.job_id,
            from_replicas=row.from_replicas,
            to_replicas=row.to_replicas,
            reason=enum_value(common_pb2.DecisionReason, "DECISION_REASON_", row.reason),
            message=row.message,
            trigger=enum_value(common_pb2.DecisionTrigger, "DECISION_TRIGGER_", row.trigger),
            state=_state(row.state),
            error=row.error,
            pause_s=row.pause_s,
            lost_steps=row.lost_steps,
            generation=row.generation,
            requested_by=row.requested_by,
        )
        d.created_at.CopyFrom(ts_of(row.created_at))
        d.updated_at.CopyFrom(ts_of(row.updated_at))
        return cast(scaler_pb2.Decision, d)

    @staticmethod
    def _job(row: Any, policy: dict[str, Any]) -> scaler_pb2.Job:
        job = scaler_pb2.Job(
            job_id=row.job_id,
            current_replicas=row.current_replicas,
            generation=row.generation,
            autoscaling_paused=row.autoscaling_paused,
            pause_reason=row.pause_reason,
            gpus_per_replica=row.gpus_per_replica,
        )
        json_format.ParseDict(policy, job.policy, ignore_unknown_fields=True)
        # Bounds live in their own columns; the overrides may not mention them.
        job.policy.min_replicas = row.min_replicas
        job.policy.max_replicas = row.max_replicas
        job.created_at.CopyFrom(ts_of(row.created_at))
        if row.last_resize_ended_at is not None:
            job.last_resize_at.CopyFrom(ts_of(row.last_resize_ended_at))
        return job

    async def list_jobs(self) -> list[scaler_pb2.Job]:
        from sqlalchemy import select

        from services.scaler import models

        def q(s: Any) -> list[scaler_pb2.Job]:
            rows = s.scalars(select(models.Job).order_by(models.Job.job_id)).all()
            active = self._active_decisions(s)
            out = []
            for r in rows:
                job = self._job(r, dict(r.policy_overrides or {}))
                job.active_decision_id = active.get(r.job_id, 0)
                out.append(job)
            return out

        result: list[scaler_pb2.Job] = self._read(q)
        return result

    @staticmethod
    def _active_decisions(s: Any) -> dict[str, int]:
        from sqlalchemy import select

        from services.scaler import models

        final = {"COMPLETED", "ABORTED", "FAILED"}
        rows = s.execute(
            select(models.Decision.job_id, models.Decision.id, models.Decision.state)
            .where(models.Decision.ended_at.is_(None))
            .order_by(models.Decision.id)
        ).all()
        return {
            job_id: did
            for job_id, did, state in rows
            if state.removeprefix("DECISION_STATE_") not in final
        }

    async def get_job(self, job_id: str) -> scaler_pb2.Job:
        for job in await self.list_jobs():
            if job.job_id == job_id:
                return job
        raise errors.NotFound(f"no job {job_id!r} in the store")

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        from sqlalchemy import select

        from services.scaler import models

        def q(s: Any) -> list[scaler_pb2.Decision]:
            stmt = select(models.Decision)
            if job_id:
                stmt = stmt.where(models.Decision.job_id == job_id)
            if since is not None:
                stmt = stmt.where(models.Decision.created_at >= since)
            if until is not None:
                stmt = stmt.where(models.Decision.created_at < until)
            stmt = stmt.order_by(models.Decision.created_at.desc(), models.Decision.id.desc())
            rows = [self._decision(r) for r in s.scalars(stmt).all()]
            # States are filtered here, not in SQL, so both stored spellings match.
            return [d for d in rows if not states or d.state in states]

        result: list[scaler_pb2.Decision] = self._read(q)
        return result

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail:
        from sqlalchemy import select

        from services.scaler import models

        def q(s: Any) -> scaler_pb2.DecisionDetail:
            row = s.get(models.Decision, decision_id)
            if row is None:
                raise errors.NotFound(f"no decision {decision_id} in the store")
            detail = scaler_pb2.DecisionDetail(decision=self._decision(row))
            json_format.ParseDict(
                _inputs_json(row.inputs or {}), detail.inputs, ignore_unknown_fields=True
            )
            events = s.scalars(
                select(models.DecisionEvent)
                .where(models.DecisionEvent.decision_id == decision_id)
                .order_by(models.DecisionEvent.at, models.DecisionEvent.id)
            ).all()
            for e in events:
                ev = detail.events.add(
                    decision_id=decision_id, job_id=row.job_id, state=_state(e.state)
                )
                ev.detail = e.detail
                ev.at.CopyFrom(ts_of(e.at))
            span = timedelta(minutes=context_minutes or 10)
            lo = row.created_at - span
            hi = (row.ended_at or row.updated_at) + span
            detail.utilization.extend(self._rollups(s, row.job_id, lo, hi))
            return detail

        result: scaler_pb2.DecisionDetail = self._read(q)
        return result

    @staticmethod
    def _rollups(
        s: Any, job_id: str, since: datetime, until: datetime
    ) -> list[scaler_pb2.UtilizationPoint]:
        from sqlalchemy import select

        from services.scaler import models

        r = models.UtilizationRollup
        rows = s.scalars(
            select(r)
            .where(r.job_id == job_id, r.minute >= since, r.minute < until)
            .order_by(r.minute)
        ).all()
        out = []
        for row in rows:
            p = scaler_pb2.UtilizationPoint(
                mean_pct=row.mean_pct,
                min_pct=row.min_pct,
                max_pct=row.max_pct,
                samples=row.samples,
                replicas=row.replicas,
            )
            p.minute.CopyFrom(ts_of(row.minute))
            out.append(p)
        return out

    async def utilization(
        self, job_id: str, since: datetime, until: datetime
    ) -> list[scaler_pb2.UtilizationPoint]:
        await self.get_job(job_id)
        # A rollup is keyed by the start of its minute: include the one in progress at `since`.
        lo = since.replace(second=0, microsecond=0)
        result: list[scaler_pb2.UtilizationPoint] = self._read(
            lambda s: self._rollups(s, job_id, lo, until)
        )
        return result


def _inputs_json(stored: dict[str, Any]) -> dict[str, Any]:
    """Stored inputs → DecisionInputs JSON. Window buckets without samples are
    stored as null (JSON has no NaN); the API reports them as NaN."""
    out = dict(stored)
    window = out.get("window")
    if isinstance(window, dict):
        w = dict(window)
        buckets = w.get("bucket_means_pct")
        if isinstance(buckets, list):
            w["bucket_means_pct"] = ["NaN" if b is None else b for b in buckets]
        if w.get("mean_pct", 0) is None:
            w["mean_pct"] = "NaN"
        out["window"] = w
    return out
