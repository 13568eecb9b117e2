"""The Telemetry stream client: sends held reports, releases them on ack, reconnects.

One stream at a time. Three tasks share it: the sender writes reports as the
buffer offers them, the receiver applies acks, and a watchdog ends a stream on
which reports wait longer than ``ack_timeout_s`` for an ack (a scaler that is
up at the transport level but not processing). A dead transport is noticed by
gRPC keepalive (``keepalive_time_s`` + ``keepalive_timeout_s``). Whatever ends
a stream, the next one starts after a jittered exponential backoff and resends
everything in flight, in order, with the same sequence numbers.

The sampler never waits on any of this: it only appends to the buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import grpc

from tide.base import grpc_options
from tide.base.client import channel_options, open_channel
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.retry import Backoff
from tide.services.common.clock import Clock, SystemClock
from tide.services.common.logs import with_context
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

from .buffer import ReportBuffer
from .metrics import AgentMetrics
from .refusals import RefusalLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamConfig:
    target: str
    node_name: str
    boot_id: str
    ack_timeout_s: float = 30.0
    stream_max_age_s: float = 3600.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    keepalive_time_s: float = grpc_options.KEEPALIVE_TIME_S
    keepalive_timeout_s: float = grpc_options.KEEPALIVE_TIMEOUT_S
    credentials: ClientCredentials = NO_CREDENTIALS
    #: The name the scaler's certificate is checked against when ``target`` is an
    #: address (fan-out, tide/services/agent/fanout.py); empty: ``target``'s host.
    tls_server_name: str = ""
    #: Reports the scaler refused for their timestamp: at most one WARNING per cause
    #: this often (tide/services/agent/refusals.py); every one is counted.
    refusal_log_interval_s: float = 300.0

    # BDP probing is off: reports are tiny, and an outstanding BDP ping holds back
    # the keepalive ping that detects a stalled path.
    _EXTRA_OPTIONS: ClassVar[Mapping[str, Any]] = {"grpc.http2.bdp_probe": 0}

    def _extra_options(self) -> dict[str, Any]:
        extra = dict(self._EXTRA_OPTIONS)
        if self.tls_server_name:
            extra["grpc.ssl_target_name_override"] = self.tls_server_name
        return extra

    def open_channel(self) -> grpc.aio.Channel:
        return open_channel(
            self.target,
            credentials=self.credentials,
            keepalive_time_s=self.keepalive_time_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            extra_options=self._extra_options(),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return channel_options(
            keepalive_time_s=self.keepalive_time_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            extra_options=self._extra_options(),
        )


@dataclass
class Disconnect:
    reason: str
    at_monotonic: float
    connected_s: float


@dataclass
class StreamState:
    connects: int = 0
    connected: bool = False
    disconnects: list[Disconnect] = field(default_factory=list)


_Call = grpc.aio.StreamStreamCall[telemetry_pb2.NodeReport, telemetry_pb2.TelemetryAck]


class _AckTimeout(Exception):
    pass


#: What grpcio's asyncio client reports, in place of the call's status, when the call
#: ended while one of its writes was in flight (grpc/grpc#36066).
LOST_STATUS_DETAILS = "Internal error from Core"
_STATUS_LOST = (
    "the stream ended while a report was being written, and grpc lost its status"
    " (the scaler's refusal or a dead transport: grpc/grpc#36066)"
)


def status_lost(exc: grpc.aio.AioRpcError) -> bool:
    """Whether ``exc`` is grpcio's INTERNAL for a stream that ended under a write: not
    the scaler's error, just a stream that ended, so it is retried like UNAVAILABLE."""
    return exc.code() == grpc.StatusCode.INTERNAL and exc.details() == LOST_STATUS_DETAILS


class TelemetryStream:
    def __init__(
        self,
        config: StreamConfig,
        buffer: ReportBuffer,
        *,
        metrics: AgentMetrics | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_interval: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self._log = with_context(logger, node=config.node_name)
        self.buffer = buffer
        self.metrics = metrics or AgentMetrics()
        self.state = StreamState()
        self._clock = clock or SystemClock()
        self._backoff = Backoff(config.backoff_initial_s, config.backoff_max_s, rng)
        self._on_interval = on_interval
        self._acked = asyncio.Event()
        self._waiting_since: float | None = None
        self._resume_at = 1
        self._refusals = RefusalLog(self._log, self.metrics, config.refusal_log_interval_s)

    async def run(self) -> None:
        """Keep a stream open until cancelled."""
        cfg = self.config
        channel = cfg.open_channel()
        stub = telemetry_pb2_grpc.TelemetryStub(channel)
        try:
            while True:
                started = self._clock.monotonic()
                reason = await self._one_stream(stub)
                connected_s = self._clock.monotonic() - started
                self.state.connected = False
                self.metrics.connected.set(0)
                self.state.disconnects.append(
                    Disconnect(reason, self._clock.monotonic(), connected_s)
                )
                # snake_case label: closed_by_scaler, unavailable, status_lost, ack_timeout,
                # error, ...
                label = reason.split(":", 1)[0].strip().lower().replace(" ", "_")
                self.metrics.disconnects.labels(label).inc()
                delay = self._backoff.next_delay_s()
                self._log.warning(
                    "telemetry stream to %s ended (%s) after %.1f s; %d reports held;"
                    " reconnecting in %.2f s",
                    cfg.target,
                    reason,
                    connected_s,
                    len(self.buffer),
                    delay,
                )
                await self._clock.sleep(delay)
        finally:
            self.state.connected = False
            self.metrics.connected.set(0)
            await channel.close(grace=None)

    async def _one_stream(self, stub: telemetry_pb2_grpc.TelemetryStub) -> str:
        # The aio stub opens a bidi call without a request iterator; we write to it.
        call = cast(
            _Call,
            stub.Stream(timeout=self.config.stream_max_age_s),  # type: ignore[call-arg]
        )
        self.buffer.rewind()
        self._waiting_since = None
        # Where the scaler picks up on this stream, for the "up" log line.
        first = self.buffer.first_unacked_seq
        self._resume_at = first if first is not None else self.buffer.last_seq + 1
        receive = asyncio.create_task(self._receive(call), name="telemetry-receive")
        tasks = {
            receive,
            asyncio.create_task(self._send(call), name="telemetry-send"),
            asyncio.create_task(self._watchdog(), name="telemetry-watchdog"),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            call.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # When several ended together, the receiver's error carries the call's status.
        exc = (receive if receive in done else next(iter(done))).exception()
        if exc is None:
            return "closed by scaler"
        if isinstance(exc, grpc.aio.AioRpcError):
            if status_lost(exc):
                return f"STATUS_LOST: {_STATUS_LOST}"
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                self._log.error(
                    "the scaler rejected a report: %s",
                    exc.details(),
                )
            return f"{exc.code().name}: {exc.details()}"
        if isinstance(exc, _AckTimeout):
            return f"ACK_TIMEOUT: {exc}"
        self._log.error("telemetry stream failed", exc_info=exc)
        return f"ERROR: {exc!r}"

    async def _receive(self, call: _Call) -> None:
        async for ack in call:
            if not self.state.connected:
                self.state.connected = True
                self.state.connects += 1
                self.metrics.connected.set(1)
                self._log.info(
                    "telemetry stream to %s up; resuming at seq %d",
                    self.config.target,
                    self._resume_at,
                )
            # A scaler that answers is a healthy scaler: the next outage starts small.
            self._backoff.reset()
            if ack.boot_id and ack.boot_id != self.config.boot_id:
                self._log.debug("ack for another boot id %s", ack.boot_id)
                continue
            if ack.refused:
                self._refusals.note(ack.refused, self._clock.monotonic())
            released = self.buffer.ack(ack.acked_seq)
            if released:
                self.metrics.reports_acked.inc(released)
                self.metrics.buffered.set(len(self.buffer))
                self._waiting_since = self._clock.monotonic() if self.buffer.in_flight else None
                self._acked.set()
            if ack.report_interval_s > 0 and self._on_interval is not None:
                self._on_interval(ack.report_interval_s)

    async def _send(self, call: _Call) -> None:
        buffer = self.buffer
        while True:
            report = buffer.next_to_send()
            if report is None:
                buffer.changed.clear()
                report = buffer.next_to_send()
                if report is None:
                    await buffer.changed.wait()
                    continue
            if self._waiting_since is None:
                self._waiting_since = self._clock.monotonic()
            try:
                await call.write(report)
            except asyncio.InvalidStateError:
                # The call ended under the write (a scaler not listening yet, a closed
                # stream): the receiver ends with the call's status, which is the reason.
                await asyncio.Event().wait()
            self.metrics.reports_written.inc()

    async def _watchdog(self) -> None:
        timeout = self.config.ack_timeout_s
        while True:
            await self._clock.sleep(min(1.0, timeout / 4))
            since = self._waiting_since
            if since is not None and self._clock.monotonic() - since > timeout:
                raise _AckTimeout(
                    f"{self.buffer.in_flight} reports unacked for more than {timeout:g} s"
                )

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every held report is acked; False if ``timeout_s`` passed first."""
        deadline = self._clock.monotonic() + timeout_s
        while len(self.buffer):
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False
            self._acked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acked.wait(), remaining)
        return True
