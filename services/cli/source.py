"""Where the CLI reads the scaling history from: the scaler over gRPC, or the SQL store offline.

Both sources answer with the API's messages (tide.v1), so every command
renders one shape whatever it read. The offline source exists for the
questions asked when the scaler is down or gone (an incident review, a
`tide demo` state dir): it only reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Protocol, cast

import grpc
from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp
from tide.v1 import common_pb2, scaler_pb2, scaler_pb2_grpc

from tidebase import errors
from tidebase.client import bearer, domain_error, open_channel

logger = logging.getLogger(__name__)

#: ListDecisions page size the CLI asks for; the API caps pages at 1000.
PAGE_SIZE = 500

#: The API's limit on GetDecision.context_minutes.
MAX_CONTEXT_MINUTES = 1440

#: The longest range one ListUtilization call may span (the API's bound: a week of minutes).
UTILIZATION_CHUNK = timedelta(days=7)


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
        # A rollup is keyed by the start of its minute: include the one in progress at
        # `since`, as the SQL source does. The API answers at most a week per call.
        lo = since.replace(second=0, microsecond=0)
        points: list[scaler_pb2.UtilizationPoint] = []
        while True:
            hi = min(until, lo + UTILIZATION_CHUNK)
            resp = await self._call(
                self.stub.ListUtilization,
                scaler_pb2.ListUtilizationRequest(job_id=job_id, since=ts_of(lo), until=ts_of(hi)),
            )
            points.extend(resp.points)
            if hi >= until:
                return points
            lo = hi

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
    """Reads the scaler's tables through services.scaler.repo; never writes. Use as ``async with``."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._factory: Any = None
        self._engine: Any = None

    async def __aenter__(self) -> SqlHistory:
        from sqlalchemy import inspect
        from sqlalchemy.exc import DBAPIError

        from services.store import db

        engine = db.make_engine(self._url)
        where = db.redact_url(self._url)
        try:
            tables = set(inspect(engine).get_table_names())
        except DBAPIError as exc:
            engine.dispose()
            raise errors.Unavailable(f"database {where} unreachable: {exc.orig}") from None
        if "decisions" not in tables:
            engine.dispose()
            raise errors.NotFound(f"database {where} has no Tide schema (run `tide db upgrade`)")
        self._engine = engine
        self._factory = db.make_session_factory(engine)
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

        from services.store import db

        try:
            with db.session_scope(self._factory, write=False) as session:
                return fn(session)
        except DBAPIError as exc:
            raise errors.Unavailable(f"database read failed: {exc.orig}") from None

    # Record → message converters, field by field: the records may hold more
    # than the API shows (epochs, versions).

    @staticmethod
    def _decision(r: Any) -> scaler_pb2.Decision:
        d: Any = scaler_pb2.Decision(
            id=r.id,
            job_id=r.job_id,
            from_replicas=r.from_replicas,
            to_replicas=r.to_replicas,
            reason=enum_value(common_pb2.DecisionReason, "DECISION_REASON_", r.reason),
            message=r.message,
            trigger=enum_value(common_pb2.DecisionTrigger, "DECISION_TRIGGER_", r.trigger),
            state=_state(str(r.state)),
            error=r.error,
            pause_s=r.pause_s,
            lost_steps=r.lost_steps,
            generation=r.generation,
            requested_by=r.requested_by,
        )
        d.created_at.CopyFrom(ts_of(r.created_at))
        d.updated_at.CopyFrom(ts_of(r.updated_at))
        return cast(scaler_pb2.Decision, d)

    @staticmethod
    def _job(r: Any, active_id: int) -> scaler_pb2.Job:
        job = scaler_pb2.Job(
            job_id=r.job_id,
            current_replicas=r.current_replicas,
            generation=r.generation,
            autoscaling_paused=r.autoscaling_paused,
            pause_reason=r.pause_reason,
            gpus_per_replica=r.gpus_per_replica,
            active_decision_id=active_id,
        )
        # Only the operator's overrides are stored; the defaults are the
        # scaler's configuration, which an offline reader does not have.
        json_format.ParseDict(dict(r.policy_overrides), job.policy, ignore_unknown_fields=True)
        job.policy.min_replicas = r.min_replicas
        job.policy.max_replicas = r.max_replicas
        job.created_at.CopyFrom(ts_of(r.created_at))
        if r.last_resize_ended_at is not None:
            job.last_resize_at.CopyFrom(ts_of(r.last_resize_ended_at))
        return job

    @staticmethod
    def _point(r: Any) -> scaler_pb2.UtilizationPoint:
        p = scaler_pb2.UtilizationPoint(
            mean_pct=r.mean_pct,
            min_pct=r.min_pct,
            max_pct=r.max_pct,
            samples=r.samples,
            replicas=r.replicas,
        )
        p.minute.CopyFrom(ts_of(r.minute))
        return p

    async def list_jobs(self) -> list[scaler_pb2.Job]:
        from services.scaler import repo

        def q(s: Any) -> list[scaler_pb2.Job]:
            out = []
            for r in repo.list_jobs(s):
                active = repo.active_decision(s, r.job_id)
                out.append(self._job(r, active.id if active else 0))
            return out

        result: list[scaler_pb2.Job] = self._read(q)
        return result

    async def get_job(self, job_id: str) -> scaler_pb2.Job:
        from services.scaler import repo

        def q(s: Any) -> scaler_pb2.Job:
            active = repo.active_decision(s, job_id)
            return self._job(repo.get_job(s, job_id), active.id if active else 0)

        result: scaler_pb2.Job = self._read(q)
        return result

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        from services.scaler import repo

        wanted = [
            repo.DecisionState(
                str(common_pb2.DecisionState.Name(cast(Any, v))).removeprefix("DECISION_STATE_")
            )
            for v in states
        ]

        def q(s: Any) -> list[scaler_pb2.Decision]:
            out: list[scaler_pb2.Decision] = []
            token = ""
            while True:
                page = repo.list_decisions(
                    s,
                    job_id=job_id,
                    since=since,
                    until=until,
                    states=wanted,
                    page_size=PAGE_SIZE,
                    page_token=token,
                )
                out.extend(self._decision(r) for r in page.decisions)
                token = page.next_page_token
                if not token:
                    return out

        result: list[scaler_pb2.Decision] = self._read(q)
        return result

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail:
        from services.scaler import repo
        from services.scaler.convert import inputs_to_proto

        def q(s: Any) -> scaler_pb2.DecisionDetail:
            rec = repo.get_decision(s, decision_id)
            d = rec.decision
            detail = scaler_pb2.DecisionDetail(decision=self._decision(d))
            # The scaler's own reading of its stored inputs: one mapping for both paths.
            detail.inputs.CopyFrom(inputs_to_proto(d.inputs))
            for e in rec.events:
                ev = detail.events.add(decision_id=d.id, job_id=d.job_id, detail=e.detail)
                ev.state = _state(str(e.state))
                ev.at.CopyFrom(ts_of(e.at))
            span = timedelta(minutes=context_minutes or 10)
            lo = d.created_at.replace(second=0, microsecond=0) - span
            hi = (d.ended_at or d.updated_at) + span
            detail.utilization.extend(
                self._point(r) for r in repo.rollups_between(s, d.job_id, lo, hi)
            )
            return detail

        result: scaler_pb2.DecisionDetail = self._read(q)
        return result

    async def utilization(
        self, job_id: str, since: datetime, until: datetime
    ) -> list[scaler_pb2.UtilizationPoint]:
        from services.scaler import repo

        # A rollup is keyed by the start of its minute: include the one in progress at `since`.
        lo = since.replace(second=0, microsecond=0)

        def q(s: Any) -> list[scaler_pb2.UtilizationPoint]:
            repo.get_job(s, job_id)
            return [self._point(r) for r in repo.rollups_between(s, job_id, lo, until)]

        result: list[scaler_pb2.UtilizationPoint] = self._read(q)
        return result
