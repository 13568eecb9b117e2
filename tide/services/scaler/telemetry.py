"""The Telemetry API over :class:`Ingest`: one stream per agent.

Each agent stream is its own task on the event loop and the ingest's work per
report is a few microseconds with no await inside, so a slow or dead agent
only ever holds up its own stream. Acks are coalesced: one goes out after
``ack_every_reports`` reports or once ``ack_max_delay_s`` has passed since
the previous one, so an agent reporting every second gets every report acked
at once, while a burst (a resend after reconnect) costs one ack per batch.
Held-back acks and idle streams are looked after by two tasks shared by all
streams, not two per stream (docs/scaler.md "Scaling out"). A write runs beside
the handler when the flusher started it; the reports taken meanwhile follow the
same rule, so a busy stream gets an ack per batch, not one per write's round trip.

A report dropped for its timestamp is still acknowledged (resending it cannot
help), and the ack that covers it names the cause, how many reports it took
and the skew seen (``TelemetryAck.refused``), so that the agent learns that
its clock is wrong instead of only the scaler's metric saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tide.base.errors import grpc_status_of
from tide.services.common import refused_streams
from tide.services.scaler.ingest import (
    Ingest,
    InvalidStream,
    Rejection,
    StreamConflict,
    StreamState,
)
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

logger = logging.getLogger(__name__)

Ctx = grpc.aio.ServicerContext[Any, Any]

_REFUSAL = telemetry_pb2.ReportRefusal
#: The ingest's report-scope refusals as the ack names them.
REFUSAL_REASONS: dict[Rejection, _REFUSAL.Reason.ValueType] = {
    Rejection.TIMESTAMP_MISSING: _REFUSAL.REASON_TIMESTAMP_MISSING,
    Rejection.TIMESTAMP_IN_FUTURE: _REFUSAL.REASON_TIMESTAMP_IN_FUTURE,
    Rejection.TIMESTAMP_TOO_OLD: _REFUSAL.REASON_TIMESTAMP_TOO_OLD,
    Rejection.TIMESTAMP_OUT_OF_ORDER: _REFUSAL.REASON_TIMESTAMP_OUT_OF_ORDER,
}


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
        "refusing",
        "reports",
        "sent",
        "since",
        "stream",
        "writing",
    )

    def __init__(self, context: Ctx, interval_s: float, stream: StreamState) -> None:
        self.context = context
        self.stream = stream
        self.refusing = False  # msg carries refusals, cleared before the next write
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
        """Write the stream's newest ack; one that came meanwhile goes out when due."""
        if st.writing:
            return  # the write in flight sees to the newest ack when it is done
        st.writing = True
        msg = st.msg
        ingest = self.ingest
        refused = ingest.refused
        monotonic = ingest.clock.monotonic
        try:
            # A refusal goes out even when the ack did not move (the refused report
            # waits behind a gap): the agent learns of it within ack_max_delay_s.
            while st.ack is not None and (st.ack != st.sent or (refused and st.stream in refused)):
                ack = st.sent = st.ack
                st.since = 0
                st.last_s = monotonic()
                boot, seq = ack
                if msg.boot_id != boot:
                    msg.boot_id = boot
                msg.acked_seq = seq
                if refused:
                    self._refusals(st, msg)
                elif st.refusing:
                    st.refusing = False
                    msg.ClearField("refused")
                await st.context.write(msg)
                # Reports taken while it was in flight (a flusher's write runs beside the
                # handler) are acked as any others: now if due, else held back. Writing
                # again whenever the ack had moved kept a busy stream's acks back to back,
                # one every report or two (docs/scaler.md "Ingest ceiling").
                if (
                    st.since < self.ack_every_reports
                    and monotonic() - st.last_s < self.ack_max_delay_s
                ):
                    if st.ack != st.sent or (refused and st.stream in refused):
                        self._hold(st)
                    break
        finally:
            st.writing = False

    def _hold(self, st: _Acks) -> None:
        self._held.add(st)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_held())

    def _refusals(self, st: _Acks, msg: telemetry_pb2.TelemetryAck) -> None:
        if st.refusing:
            st.refusing = False
            msg.ClearField("refused")
        per = self.ingest.take_refused(st.stream)
        if not per:
            return
        settings = self.ingest.settings
        for reason, (reports, skew_s, last_seq) in per.items():
            limit_s = 0.0
            if reason is Rejection.TIMESTAMP_IN_FUTURE:
                limit_s = settings.max_clock_skew_s
            elif reason is Rejection.TIMESTAMP_TOO_OLD:
                limit_s = settings.max_report_age_s
            msg.refused.add(
                reason=REFUSAL_REASONS.get(reason, _REFUSAL.REASON_UNSPECIFIED),
                reports=reports,
                skew_s=skew_s,
                limit_s=limit_s,
                last_seq=last_seq,
            )
        st.refusing = True

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
        st = _Acks(context, ingest.settings.report_interval_s, stream)
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
            # Out of the reaper's and the flusher's sight (no ack goes out), then read what
            # the agent still sends: a refusal that lands on one of its writes reaches it
            # as INTERNAL, not this code (refused_streams.drain).
            self._streams.pop(st, None)
            await refused_streams.drain(context)
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
            self._streams.pop(st, None)
            held.discard(st)
            if st.flight is not None and not st.flight.done():
                # The stream is over: an ack still in flight has nowhere to go.
                st.flight.cancel()
            ingest.close_stream(stream)
