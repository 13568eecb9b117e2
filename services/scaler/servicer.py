"""The scaler's gRPC edge: the Scaler API over :class:`ScalerCore` and the store,
and the Telemetry API over :class:`Ingest`. Thin: validate, decode, call
one domain function, encode; conversions between records and tide.v1 messages
are services.scaler.convert's.

Telemetry: each agent stream is its own task on the event loop and the ingest's work per
report is a few microseconds with no await inside, so a slow or dead agent
only ever holds up its own stream. Acks are coalesced: one goes out after
``ack_every_reports`` reports or once ``ack_max_delay_s`` has passed since
the previous one, so an agent reporting every second gets every report acked
at once, while a burst (a resend after reconnect) costs one ack per batch.
Held-back acks and idle streams are looked after by two tasks shared by all
streams, not two per stream (docs/scaler.md "Scaling out").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tide.v1 import (
    common_pb2,
    peers_pb2,
    peers_pb2_grpc,
    scaler_pb2,
    scaler_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
)

from services.common.guard import Kind, Role, Rule, Subject, caller, requested_by
from services.common.rpc import rpc_errors
from services.scaler.convert import (
    decision_to_proto,
    detail_to_proto,
    point_to_proto,
    policy_from_proto,
    policy_to_proto,
    window_to_proto,
)
from services.scaler.engine.core import ScalerCore
from services.scaler.ingest import Ingest, InvalidStream, StreamConflict
from services.scaler.lifecycle import state_from_proto, state_to_proto
from services.scaler.peers import notice_from_proto, partial_from_proto
from services.scaler.store import JobRecord
from services.store.db import utc_from_epoch
from tidebase.errors import InvalidArgument, grpc_status_of
from tidebase.timeconv import field_datetime, ts_from_datetime, ts_from_seconds

logger = logging.getLogger(__name__)

Ctx = grpc.aio.ServicerContext[Any, Any]

_SCALER = "/tide.v1.Scaler/"
#: Who may call what (services.common.guard): agents stream telemetry for their own
#: node only; the Scaler API has viewer, operator and admin roles.
RULES = {
    "/tide.v1.Telemetry/Stream": Rule(
        frozenset({Kind.AGENT}), subject=lambda r: Subject(node=r.node_name)
    ),
    # Reads also for the scaler's own identity: `kubectl exec deploy/<release>-scaler --
    # tide history ...` runs the CLI with the pod's token (docs/install.md).
    **{
        _SCALER + m: Rule(frozenset({Kind.SCALER}), role=Role.VIEWER)
        for m in (
            "ListJobs",
            "GetJob",
            "ListDecisions",
            "GetDecision",
            "ListUtilization",
            "WatchDecisions",
        )
    },
    **{_SCALER + m: Rule(role=Role.OPERATOR) for m in ("RequestResize", "SetAutoscaling")},
    _SCALER + "UpsertJob": Rule(role=Role.ADMIN),
    # Sharded replicas ship partial aggregates to each other: scaler identities only.
    "/tide.v1.ScalerPeers/ShipPartials": Rule(frozenset({Kind.SCALER})),
}

#: ListUtilization: the range when `since` is unset, and the longest one call may span
#: (one week of minutes, 10,080 points; proto/tide/v1/scaler.proto).
DEFAULT_UTILIZATION_RANGE = timedelta(hours=24)
MAX_UTILIZATION_RANGE = timedelta(days=7)
#: ...and with the per-second detail (1,440 points of 60 seconds: about 1 MB).
MAX_SECONDS_RANGE = timedelta(days=1)


class ScalerServicer(scaler_pb2_grpc.ScalerServicer):
    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    def _job(self, job: JobRecord) -> scaler_pb2.Job:
        core = self.core
        p = core.policies.get(job.job_id) or core.book.policy_of(job)
        now = core.clock.now()
        msg = scaler_pb2.Job(
            job_id=job.job_id,
            policy=policy_to_proto(p),
            current_replicas=job.current_replicas,
            generation=job.generation,
            autoscaling_paused=job.autoscaling_paused,
            pause_reason=job.pause_reason,
            window=window_to_proto(core.pipeline.window_of(job.job_id, now), now),
            active_decision_id=core.active.get(job.job_id, 0),
            gpus_per_replica=job.gpus_per_replica,
            created_at=ts_from_datetime(job.created_at),
            last_resize_at=ts_from_datetime(job.last_resize_ended_at),
        )
        status = core.coordinator.latest_status(job.job_id)
        if status is not None:
            msg.step = status.step
            msg.samples_per_s = status.samples_per_s
            msg.generation = max(msg.generation, status.generation)
            msg.failure = status.failure
        ev = core.evaluations.get(job.job_id)
        if ev is not None:
            msg.last_evaluation.CopyFrom(
                scaler_pb2.Evaluation(
                    reason=common_pb2.DecisionReason.ValueType(ev.decision.reason.value),
                    message=ev.decision.message,
                    at=ts_from_seconds(ev.at_s),
                )
            )
        return msg

    @rpc_errors
    async def ListJobs(
        self, request: scaler_pb2.ListJobsRequest, context: Ctx
    ) -> scaler_pb2.ListJobsResponse:
        jobs = [self._job(j) for _, j in sorted(self.core.jobs.items())]
        return scaler_pb2.ListJobsResponse(jobs=jobs)

    @rpc_errors
    async def GetJob(self, request: scaler_pb2.GetJobRequest, context: Ctx) -> scaler_pb2.Job:
        return self._job(self.core.book.get(request.job_id))

    @rpc_errors
    async def UpsertJob(self, request: scaler_pb2.UpsertJobRequest, context: Ctx) -> scaler_pb2.Job:
        overrides = policy_from_proto(request.policy)
        job = await self.core.upsert_job(
            request.job_id,
            overrides,
            initial_replicas=request.initial_replicas,
            gpus_per_replica=request.gpus_per_replica,
        )
        return self._job(job)

    @rpc_errors
    async def ListDecisions(
        self, request: scaler_pb2.ListDecisionsRequest, context: Ctx
    ) -> scaler_pb2.ListDecisionsResponse:
        try:
            states = tuple(state_from_proto(s) for s in request.states)
        except KeyError:
            raise InvalidArgument(f"unknown decision state in {list(request.states)}") from None
        page = await self.core.store.list_decisions(
            job_id=request.job_id,
            since=field_datetime(request, "since"),
            until=field_datetime(request, "until"),
            states=states,
            page_size=request.page_size or 100,
            page_token=request.page_token,
            with_inputs=False,
        )
        return scaler_pb2.ListDecisionsResponse(
            decisions=[decision_to_proto(d) for d in page.decisions],
            next_page_token=page.next_page_token,
        )

    @rpc_errors
    async def GetDecision(
        self, request: scaler_pb2.GetDecisionRequest, context: Ctx
    ) -> scaler_pb2.DecisionDetail:
        if request.context_minutes > 1440:
            raise InvalidArgument(f"context_minutes={request.context_minutes}: must be 0..1440")
        minutes = request.context_minutes or 10
        detail = await self.core.store.get_decision(request.id)
        d = detail.decision
        end = d.ended_at or d.updated_at
        rollups = await self.core.store.rollups_between(
            d.job_id,
            d.created_at - timedelta(minutes=minutes),
            end + timedelta(minutes=minutes),
        )
        return detail_to_proto(detail, rollups)

    @rpc_errors
    async def ListUtilization(
        self, request: scaler_pb2.ListUtilizationRequest, context: Ctx
    ) -> scaler_pb2.ListUtilizationResponse:
        self.core.book.get(request.job_id)  # NotFound for a job the scaler does not know
        until = field_datetime(request, "until") or utc_from_epoch(self.core.clock.now())
        since = field_datetime(request, "since") or until - DEFAULT_UTILIZATION_RANGE
        if not since < until:
            raise InvalidArgument(
                f"since={since.isoformat()} must be before until={until.isoformat()}"
            )
        limit = MAX_SECONDS_RANGE if request.seconds else MAX_UTILIZATION_RANGE
        if until - since > limit:
            # At most one week of minutes (a day with seconds) per answer, the API's bound;
            # a longer range is asked for in parts rather than cut short without a word.
            raise InvalidArgument(
                f"since..until spans {until - since}; at most {limit} per call"
                + (" with seconds" if request.seconds else "")
            )
        store = self.core.store
        rows = await store.rollups_between(request.job_id, since, until)
        seconds = (
            await store.seconds_between(request.job_id, since, until) if request.seconds else {}
        )
        return scaler_pb2.ListUtilizationResponse(
            points=[point_to_proto(r, seconds.get(r.minute)) for r in rows]
        )

    @rpc_errors
    async def RequestResize(
        self, request: scaler_pb2.RequestResizeRequest, context: Ctx
    ) -> scaler_pb2.Decision:
        d = await self.core.request_resize(
            request.job_id,
            request.replicas,
            request.reason,
            requested_by(caller(), request.requested_by),
        )
        return decision_to_proto(d)

    @rpc_errors
    async def SetAutoscaling(
        self, request: scaler_pb2.SetAutoscalingRequest, context: Ctx
    ) -> scaler_pb2.Job:
        job = await self.core.set_autoscaling(request.job_id, request.paused, request.reason)
        return self._job(job)

    @rpc_errors
    async def WatchDecisions(
        self, request: scaler_pb2.WatchDecisionsRequest, context: Ctx
    ) -> AsyncIterator[scaler_pb2.DecisionEvent]:
        q = self.core.feed.subscribe(request.job_id)
        # Headers go out once subscribed: a client that awaits them knows no
        # later change can be missed.
        await context.send_initial_metadata(())
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                d = item.decision
                yield scaler_pb2.DecisionEvent(
                    decision_id=d.id,
                    job_id=d.job_id,
                    state=state_to_proto(d.state),
                    at=ts_from_datetime(d.updated_at),
                    detail=item.detail,
                    decision=decision_to_proto(d),
                )
        finally:
            self.core.feed.unsubscribe(q)


__all__ = ["RULES", "ScalerServicer"]


class _Acks:
    """One stream's ack state. The servicer's two shared tasks (held-back acks, idle
    reaping) read it, so a stream costs no task, lock or event of its own: at 1 Hz
    with thousands of streams those were most of what a stream cost beyond gRPC."""

    __slots__ = (
        "ack",
        "context",
        "flight",
        "last_s",
        "msg",
        "reaped",
        "reports",
        "sent",
        "since",
        "writing",
    )

    def __init__(self, context: Ctx, interval_s: float) -> None:
        self.context = context
        # One ack message per stream, its fields set before each write (gRPC serialises
        # it inside write, before the first await): no message built per report.
        self.msg = telemetry_pb2.TelemetryAck(report_interval_s=interval_s)
        self.ack: tuple[str, int] | None = None  # (boot id, acked seq) to send
        self.sent: tuple[str, int] | None = None  # the last one written
        self.since = 0  # reports since the last ack
        self.last_s = -1e18  # monotonic time of the last ack
        self.reports = 0  # reports received (the reaper's counter)
        self.writing = False  # a write is in flight: at most one per stream
        self.flight: asyncio.Task[None] | None = None  # the flusher's write, if any
        self.reaped = False


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(
        self,
        ingest: Ingest,
        *,
        ack_every_reports: int = 32,
        ack_max_delay_s: float = 0.2,
    ) -> None:
        self.ingest = ingest
        self.ack_every_reports = max(1, ack_every_reports)
        self.ack_max_delay_s = ack_max_delay_s
        #: Open streams (their handler tasks), and those holding back an ack.
        self._streams: dict[_Acks, asyncio.Task[Any]] = {}
        self._held: set[_Acks] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None

    async def _write(self, st: _Acks) -> None:
        """Write the stream's newest ack, and again if a newer one came meanwhile."""
        if st.writing:
            return  # the write in flight sends the newest ack when it is done
        st.writing = True
        msg = st.msg
        try:
            while st.ack is not None and st.ack != st.sent:
                ack = st.sent = st.ack
                st.since = 0
                st.last_s = self.ingest.clock.monotonic()
                boot, seq = ack
                if msg.boot_id != boot:
                    msg.boot_id = boot
                msg.acked_seq = seq
                await st.context.write(msg)
        finally:
            st.writing = False

    async def _flush_held(self) -> None:
        # Acks held back during a burst go out once it pauses: one task for every
        # stream, waking only while some stream holds one back.
        while self._held:
            await asyncio.sleep(self.ack_max_delay_s)
            # Emptied in place: each handler holds this set (no attribute look-up per report).
            held = list(self._held)
            self._held.clear()
            for st in held:
                if st in self._streams and not st.writing:
                    # A task of its own: a peer that stopped reading holds up only itself.
                    st.flight = asyncio.create_task(self._write(st))
        self._flusher = None

    async def _reap_idle(self, idle_s: float) -> None:
        # Four looks per timeout at each stream's counter, not a clock read per report:
        # a stream is closed between 1 and 1.25 timeouts after its last report.
        seen: dict[_Acks, tuple[int, int]] = {}
        while self._streams:
            await asyncio.sleep(idle_s / 4)
            for st, task in list(self._streams.items()):
                count, quiet = seen.get(st, (-1, 0))
                quiet = quiet + 1 if st.reports == count else 0
                seen[st] = (st.reports, quiet)
                if quiet >= 4:
                    st.reaped = True
                    task.cancel()
            seen = {st: v for st, v in seen.items() if st in self._streams}
        self._reaper = None

    # A coroutine handler that writes with context.write (not a generator), so the
    # shared flusher can send a held-back ack while the stream is idle.
    async def Stream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[telemetry_pb2.NodeReport],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        ingest = self.ingest
        process = ingest.process
        monotonic = ingest.clock.monotonic
        stream = ingest.open_stream()
        every = self.ack_every_reports
        delay = self.ack_max_delay_s
        held = self._held
        st = _Acks(context, ingest.settings.report_interval_s)
        handler = asyncio.current_task()
        assert handler is not None  # a gRPC handler always runs in a task
        self._streams[st] = handler
        idle_s = ingest.settings.stream_idle_timeout_s
        if idle_s > 0 and self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_idle(idle_s))
        try:
            try:
                # The request iterator, never context.read(): the guard wraps the
                # iterator to refuse malformed reports and a token speaking for
                # another node; reading the context directly skips both.
                async for report in request_iterator:
                    st.reports += 1
                    st.ack = process(stream, report)
                    st.since += 1
                    if st.since >= every or monotonic() - st.last_s >= delay:
                        await self._write(st)
                    else:
                        held.add(st)
                        if self._flusher is None:
                            self._flusher = asyncio.create_task(self._flush_held())
            except DecodeError as exc:
                # grpc hands a parse failure to the handler; it is the peer's fault.
                raise ingest.malformed(stream, str(exc)) from exc
            if st.flight is not None:
                await st.flight
            await self._write(st)
        except (InvalidStream, StreamConflict) as exc:
            node = stream.node.name if stream.node is not None else "?"
            logger.warning("node %s: telemetry stream refused: %s", node, exc, extra={"node": node})
            await context.abort(grpc_status_of(exc), str(exc))
        except asyncio.CancelledError:
            if not st.reaped:
                raise
            handler.uncancel()
            node = stream.node.name if stream.node is not None else "?"
            logger.info("node %s: telemetry stream idle, closed", node, extra={"node": node})
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"no report for {idle_s:g} s (stream_idle_timeout_s): stream closed; reconnect",
            )
        finally:
            del self._streams[st]
            held.discard(st)
            if st.flight is not None and not st.flight.done():
                # The stream is over: an ack still in flight has nowhere to go.
                st.flight.cancel()
            ingest.close_stream(stream)


class ScalerPeersServicer(peers_pb2_grpc.ScalerPeersServicer):
    """What other replicas of a sharded deployment ship to this one (docs/scaler.md)."""

    def __init__(self, core: ScalerCore) -> None:
        self.core = core

    @rpc_errors
    async def ShipPartials(
        self, request: peers_pb2.ShipPartialsRequest, context: Ctx
    ) -> peers_pb2.ShipPartialsResponse:
        parts = [partial_from_proto(m) for m in request.jobs]
        # Notices first: a preemption is the urgent part of a shipment.
        applied, notices_refused = self.core.receive_notices(
            [notice_from_proto(m) for m in (*request.notices, *request.withdrawn)]
        )
        refused = await self.core.receive_partials(request.sender, parts)
        self.core.metrics.partials_received.inc(len(parts) - refused)
        return peers_pb2.ShipPartialsResponse(
            merged=len(parts) - refused,
            refused=refused,
            notices_applied=applied,
            notices_refused=notices_refused,
        )
