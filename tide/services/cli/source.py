"""Where the CLI reads the scaling history from: the scaler over gRPC, or the SQL store offline.

Both sources answer with the API's messages (tide.v1), so every command
renders one shape whatever it read. The offline source exists for the
questions asked when the scaler is down or gone (an incident review, a
`tide demo` state dir): it only reads.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from google.protobuf import json_format

from tide.base import errors
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.timeconv import ts_from_datetime
from tide.v1 import scaler_pb2

if TYPE_CHECKING:
    import grpc

    from tide.v1 import scaler_pb2_grpc

# gRPC is imported when a GrpcScaler opens, not with this module: `tide history --db`
# and `tide --help` never talk to a scaler, and the import is about a tenth of a
# second of every invocation's start-up (issue 18).

logger = logging.getLogger(__name__)

#: ListDecisions page size the CLI asks for (`tide history --chunk-size`, kubectl's
#: default); the API caps pages at 1000.
PAGE_SIZE = 1000

#: Rows per read transaction of `tide history --db` (no API between, so not capped
#: at PAGE_SIZE): 100,000 decisions are 10 reads, not 100 (bench.history).
SQL_PAGE_SIZE = 10_000

#: The API's limit on GetDecision.context_minutes.
MAX_CONTEXT_MINUTES = 1440

#: The longest range one ListUtilization call may span (the API's bound: a week of minutes,
#: a day with each minute's seconds).
UTILIZATION_CHUNK = timedelta(days=7)
SECONDS_CHUNK = timedelta(days=1)


# --- gRPC -----------------------------------------------------------------------------------


async def all_pages(
    pages: AsyncIterator[tuple[list[scaler_pb2.Decision], bool]],
) -> list[scaler_pb2.Decision]:
    """Every decision of a source's ``decision_pages``, in order."""
    out: list[scaler_pb2.Decision] = []
    async for page, _ in pages:
        out.extend(page)
    return out


class GrpcScaler:
    """The scaler's API over one channel. Use as ``async with GrpcScaler(...) as s``."""

    def __init__(
        self,
        target: str,
        *,
        token: str = "",
        timeout_s: float = 5.0,
        credentials: ClientCredentials = NO_CREDENTIALS,
        server_name: str = "",
    ) -> None:
        self._target = target
        # The name the scaler's certificate is checked for ("": the target's host), for a
        # port-forward whose 127.0.0.1 the certificate does not name.
        self._server_name = server_name
        self._token = token
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._stub: scaler_pb2_grpc.ScalerStub | None = None

    async def __aenter__(self) -> GrpcScaler:
        from tide.base.client import open_channel
        from tide.v1 import scaler_pb2_grpc

        # The one place the CLI's calls get their credentials: the channel's TLS and its
        # token interceptors, so every call, unary or streaming (WatchDecisions), carries
        # the same ones: --token, else the token file's.
        self._channel = open_channel(
            self._target,
            credentials=self._credentials,
            token=self._token,
            extra_options=(
                {"grpc.ssl_target_name_override": self._server_name} if self._server_name else None
            ),
        )
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

    async def _call(self, method: Any, request: Any) -> Any:
        import grpc

        try:
            return await method(request, timeout=self._timeout_s, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            raise await self._error(exc) from None

    async def _error(self, exc: grpc.aio.AioRpcError) -> errors.TideError:
        """The domain error of a failed call, saying which scaler did not answer; an
        UNAVAILABLE whose cause is TLS (no CA, a wrong one, a certificate for other
        names, a refused client certificate) says so, as Unauthenticated."""
        import asyncio

        from tide.base.client import domain_error
        from tide.base.tlsprobe import diagnose

        err = domain_error(exc)
        if isinstance(err, errors.Unavailable) and errors.is_store_cause(exc.trailing_metadata()):
            # The scaler answered: it is its database that is down, not the link.
            return errors.StoreUnavailable(
                f"scaler at {self._target} answered, but its database is down: {exc.details()}"
            )
        if isinstance(err, errors.Unavailable):
            cause = await asyncio.to_thread(
                diagnose, self._target, self._credentials, server_name=self._server_name
            )
            if cause:
                return errors.Unauthenticated(f"scaler at {self._target}: TLS: {cause}")
            return errors.Unavailable(f"scaler at {self._target} unreachable: {exc.details()}")
        if isinstance(err, errors.DeadlineExceeded):
            return errors.DeadlineExceeded(
                f"scaler at {self._target} did not answer within {self._timeout_s:g} s"
            )
        return err

    async def list_jobs(self) -> list[scaler_pb2.Job]:
        resp = await self._call(self.stub.ListJobs, scaler_pb2.ListJobsRequest())
        return list(resp.jobs)

    async def get_job(self, job_id: str) -> scaler_pb2.Job:
        job: scaler_pb2.Job = await self._call(
            self.stub.GetJob, scaler_pb2.GetJobRequest(job_id=job_id)
        )
        return job

    async def decision_pages(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        *,
        page_size: Callable[[], int] = lambda: PAGE_SIZE,
        ahead: bool = False,
    ) -> AsyncIterator[tuple[list[scaler_pb2.Decision], bool]]:
        """The decisions one ListDecisions page at a time, newest first, each with
        whether more follow; ``page_size`` is asked before each call (a reader with a
        limit asks for no more than it still wants). ``ahead``: each next page is asked
        for before the current one is handed over, so the scaler reads it while this
        process draws the last (a reader that wants every page: `--all`, whose 100
        round trips for 100,000 decisions were half its time, docs/cli.md)."""
        import asyncio

        def request(token: str) -> scaler_pb2.ListDecisionsRequest:
            req = scaler_pb2.ListDecisionsRequest(
                job_id=job_id,
                page_size=page_size(),
                page_token=token,
                since=ts_from_datetime(since),
                until=ts_from_datetime(until),
            )
            req.states.extend(cast(Any, states))
            return req

        call: asyncio.Future[Any] | None = None
        try:
            resp = await self._call(self.stub.ListDecisions, request(""))
            while True:
                token = resp.next_page_token
                if token and ahead:
                    call = asyncio.ensure_future(
                        self._call(self.stub.ListDecisions, request(token))
                    )
                yield list(resp.decisions), bool(token)
                if not token:
                    return
                if call is None:
                    resp = await self._call(self.stub.ListDecisions, request(token))
                else:
                    resp, call = await call, None
        finally:
            if call is not None:
                call.cancel()

    async def history_table_pages(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        *,
        wide: bool,
        page_size: Callable[[], int] = lambda: PAGE_SIZE,
        ahead: bool = False,
    ) -> AsyncIterator[tuple[list[tuple[str, ...]], bool]]:
        """`tide history`'s table rows, a page at a time (the API's decisions, each
        converted once to its row)."""
        from tide.services.cli import render

        async for page, more in self.decision_pages(
            job_id, since, until, states, page_size=page_size, ahead=ahead
        ):
            yield render.history_rows(page, wide=wide)[1], more

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        return await all_pages(self.decision_pages(job_id, since, until, states))

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail:
        detail: scaler_pb2.DecisionDetail = await self._call(
            self.stub.GetDecision,
            scaler_pb2.GetDecisionRequest(id=decision_id, context_minutes=context_minutes),
        )
        return detail

    async def utilization(
        self, job_id: str, since: datetime, until: datetime, *, seconds: bool = False
    ) -> list[scaler_pb2.UtilizationPoint]:
        # A rollup is keyed by the start of its minute: include the one in progress at
        # `since`, as the SQL source does. The API answers at most a week per call (a
        # day with the per-second detail).
        lo = since.replace(second=0, microsecond=0)
        chunk = SECONDS_CHUNK if seconds else UTILIZATION_CHUNK
        points: list[scaler_pb2.UtilizationPoint] = []
        while True:
            hi = min(until, lo + chunk)
            resp = await self._call(
                self.stub.ListUtilization,
                scaler_pb2.ListUtilizationRequest(
                    job_id=job_id,
                    since=ts_from_datetime(lo),
                    until=ts_from_datetime(hi),
                    seconds=seconds,
                ),
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
        )
        return decision

    async def upsert_job(self, request: scaler_pb2.UpsertJobRequest) -> scaler_pb2.Job:
        job: scaler_pb2.Job = await self._call(self.stub.UpsertJob, request)
        return job

    async def watch_decisions(self, job_id: str) -> AsyncIterator[scaler_pb2.DecisionEvent]:
        """Decision events of ``job_id`` (all jobs when empty) from now on. The first item
        is an empty event that marks the subscription: once it has come, no later
        change can be missed."""
        import grpc

        call: Any = self.stub.WatchDecisions(scaler_pb2.WatchDecisionsRequest(job_id=job_id))
        try:
            # The scaler sends its headers once it has subscribed. A refused call (no or
            # wrong credentials, an old scaler) ends with its status alone, which also
            # answers initial_metadata(): reading it raises the refusal here, before the
            # caller acts on a subscription it does not have.
            await call.initial_metadata()
            if call.done():
                async for _ in call:
                    pass
            yield scaler_pb2.DecisionEvent()  # the "subscribed" mark, never shown
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise await self._error(exc) from None
        finally:
            call.cancel()

    async def set_autoscaling(self, job_id: str, paused: bool, reason: str) -> scaler_pb2.Job:
        job: scaler_pb2.Job = await self._call(
            self.stub.SetAutoscaling,
            scaler_pb2.SetAutoscalingRequest(job_id=job_id, paused=paused, reason=reason),
        )
        return job


# --- SQL (offline) ---------------------------------------------------------------------------


class SqlHistory:
    """Reads the scaler's tables through tide.services.scaler.store and encodes the records with
    the scaler's own converters (tide/services/scaler/convert.py), so ``--db`` prints what the
    scaler would; never writes. Use as ``async with``."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._factory: Any = None
        self._engine: Any = None

    async def __aenter__(self) -> SqlHistory:
        from sqlalchemy import inspect
        from sqlalchemy.exc import DBAPIError

        from tide.services.store import db

        where = db.redact_url(self._url)
        _check_sqlite_file(self._url, where)
        engine = db.make_engine(self._url)
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

        from tide.services.store import db

        try:
            with db.session_scope(self._factory, write=False) as session:
                return fn(session)
        except DBAPIError as exc:
            raise errors.Unavailable(f"database read failed: {exc.orig}") from None

    @staticmethod
    def _job(r: Any, active_id: int) -> scaler_pb2.Job:
        """The offline Job: unlike the scaler's, its policy holds only the stored overrides
        and bounds (the defaults are the scaler's configuration, which an offline reader
        does not have), and it has no live window, step or evaluation (docs/cli.md)."""
        job = scaler_pb2.Job(
            job_id=r.job_id,
            current_replicas=r.current_replicas,
            generation=r.generation,
            autoscaling_paused=r.autoscaling_paused,
            pause_reason=r.pause_reason,
            gpus_per_replica=r.gpus_per_replica,
            active_decision_id=active_id,
            created_at=ts_from_datetime(r.created_at),
            last_resize_at=ts_from_datetime(r.last_resize_ended_at),
        )
        json_format.ParseDict(dict(r.policy_overrides), job.policy, ignore_unknown_fields=True)
        job.policy.min_replicas = r.min_replicas
        job.policy.max_replicas = r.max_replicas
        return job

    async def list_jobs(self) -> list[scaler_pb2.Job]:
        from tide.services.scaler import store

        def q(s: Any) -> list[scaler_pb2.Job]:
            # Two queries whatever the number of jobs: the jobs, and every open
            # decision off the partial index (docs/store.md).
            active = store.active_decisions(s)
            return [
                self._job(r, active[r.job_id].id if r.job_id in active else 0)
                for r in store.list_jobs(s)
            ]

        result: list[scaler_pb2.Job] = self._read(q)
        return result

    async def get_job(self, job_id: str) -> scaler_pb2.Job:
        from tide.services.scaler import store

        def q(s: Any) -> scaler_pb2.Job:
            active = store.active_decision(s, job_id)
            return self._job(store.get_job(s, job_id), active.id if active else 0)

        result: scaler_pb2.Job = self._read(q)
        return result

    async def decision_pages(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        *,
        page_size: Callable[[], int] = lambda: PAGE_SIZE,
        ahead: bool = False,
    ) -> AsyncIterator[tuple[list[scaler_pb2.Decision], bool]]:
        """As GrpcScaler's: one keyset page per read transaction (``ahead`` changes
        nothing: no round trip to overlap)."""
        from tide.services.scaler.convert import decision_to_proto
        from tide.services.scaler.store.rows import decision_record

        async for rows, more in self._decision_rows(job_id, since, until, states, page_size):
            yield [decision_to_proto(decision_record(r, with_inputs=False)) for r in rows], more

    async def history_table_pages(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        *,
        wide: bool,
        page_size: Callable[[], int] = lambda: PAGE_SIZE,
        ahead: bool = False,
    ) -> AsyncIterator[tuple[list[tuple[str, ...]], bool]]:
        """`tide history`'s table rows straight from the store's rows (only the table's
        columns, its times as the database keeps them): no record, no message and no
        aware datetime per decision (100,000 decisions took 8.8 s that way; docs/cli.md)."""
        from tide.services.cli import render
        from tide.services.scaler import store

        async for rows, more in self._pages(
            store.history_table_rows, job_id, since, until, states, page_size, wide=wide
        ):
            yield render.history_rows_of_store(rows, wide=wide), more

    def _decision_rows(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        page_size: Callable[[], int],
    ) -> AsyncIterator[tuple[list[Any], bool]]:
        """The store's decision rows, newest first, one keyset page per read transaction
        (without their inputs: no page shows them), and whether more follow."""
        from tide.services.scaler import store

        return self._pages(
            store.decision_rows, job_id, since, until, states, page_size, with_inputs=False
        )

    async def _pages(
        self,
        read: Callable[..., tuple[list[Any], str]],
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
        page_size: Callable[[], int],
        **kw: Any,
    ) -> AsyncIterator[tuple[list[Any], bool]]:
        """``read``'s keyset pages, one per read transaction, and whether more follow."""
        from tide.services.scaler.lifecycle import state_from_proto

        wanted = [state_from_proto(v) for v in states]
        token = ""
        while True:

            def q(s: Any, token: str = token) -> Any:
                return read(
                    s,
                    job_id=job_id,
                    since=since,
                    until=until,
                    states=wanted,
                    page_size=page_size(),
                    page_token=token,
                    **kw,
                )

            rows, token = self._read(q)
            yield rows, bool(token)
            if not token:
                return

    async def list_decisions(
        self,
        job_id: str,
        since: datetime | None,
        until: datetime | None,
        states: Sequence[int],
    ) -> list[scaler_pb2.Decision]:
        return await all_pages(self.decision_pages(job_id, since, until, states))

    async def get_decision(
        self, decision_id: int, context_minutes: int
    ) -> scaler_pb2.DecisionDetail:
        from tide.services.scaler import store
        from tide.services.scaler.convert import detail_to_proto

        def q(s: Any) -> scaler_pb2.DecisionDetail:
            rec = store.get_decision(s, decision_id)
            d = rec.decision
            span = timedelta(minutes=context_minutes or 10)
            # Include the minute in progress when the decision was made.
            lo = d.created_at.replace(second=0, microsecond=0) - span
            hi = (d.ended_at or d.updated_at) + span
            return detail_to_proto(rec, store.rollups_between(s, d.job_id, lo, hi))

        result: scaler_pb2.DecisionDetail = self._read(q)
        return result

    async def utilization(
        self, job_id: str, since: datetime, until: datetime, *, seconds: bool = False
    ) -> list[scaler_pb2.UtilizationPoint]:
        from tide.services.scaler import store
        from tide.services.scaler.convert import point_to_proto

        # A rollup is keyed by the start of its minute: include the one in progress at `since`.
        lo = since.replace(second=0, microsecond=0)

        def q(s: Any) -> list[scaler_pb2.UtilizationPoint]:
            store.get_job(s, job_id)
            detail = store.seconds_between(s, job_id, lo, until) if seconds else {}
            return [
                point_to_proto(r, detail.get(r.minute))
                for r in store.rollups_between(s, job_id, lo, until)
            ]

        result: list[scaler_pb2.UtilizationPoint] = self._read(q)
        return result


def _check_sqlite_file(url: str, where: str) -> None:
    """A read names the directory that is not there: opening the file would create it
    and then report an empty database as one without Tide's schema."""
    from pathlib import Path

    from tide.services.store import db

    parsed = db.parse_url(url)
    name = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or name in ("", ":memory:"):
        return
    path = Path(name).expanduser()
    if not path.parent.is_dir():
        raise errors.NotFound(f"database {where}: directory {path.parent} does not exist")
