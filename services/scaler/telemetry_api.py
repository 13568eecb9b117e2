"""The Telemetry servicer: a thin grpc.aio edge over :class:`IngestEngine`.

Each agent stream is its own task on the event loop and the engine's work per
report is a few microseconds with no await inside, so a slow or dead agent
only ever holds up its own stream. Acks are coalesced: one goes out after
``ack_every_reports`` reports or once ``ack_max_delay_s`` has passed since
the previous one, so an agent reporting every second gets every report acked
at once, while a burst (a resend after reconnect) costs one ack per batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

from services.scaler.ingest import IngestEngine, InvalidStream

logger = logging.getLogger(__name__)


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(
        self,
        engine: IngestEngine,
        *,
        ack_every_reports: int = 32,
        ack_max_delay_s: float = 0.2,
    ) -> None:
        self.engine = engine
        self.ack_every_reports = max(1, ack_every_reports)
        self.ack_max_delay_s = ack_max_delay_s

    # A coroutine handler that writes with context.write (not a generator), so the
    # flusher task can send a held-back ack while the stream is idle.
    async def Stream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[telemetry_pb2.NodeReport],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        engine = self.engine
        process = engine.process
        clock = engine.clock
        interval = engine.settings.report_interval_s
        stream = engine.open_stream()
        every = self.ack_every_reports
        delay = self.ack_max_delay_s
        # [reports since the last ack, monotonic time of the last ack, ack to send, ack sent]
        st: list[Any] = [0, -1e18, None, None]
        dirty = asyncio.Event()
        lock = asyncio.Lock()

        async def send() -> None:
            async with lock:
                ack = st[2]
                if ack is None or ack == st[3]:
                    return
                st[0] = 0
                st[1] = clock.monotonic()
                st[3] = ack
                await context.write(
                    telemetry_pb2.TelemetryAck(
                        boot_id=ack[0], acked_seq=ack[1], report_interval_s=interval
                    )
                )

        async def flusher() -> None:
            # Acks held back during a burst go out once the burst pauses.
            while True:
                await dirty.wait()
                dirty.clear()
                await asyncio.sleep(delay)
                await send()

        flush_task = asyncio.create_task(flusher())
        try:
            try:
                async for report in request_iterator:
                    st[2] = process(stream, report)
                    st[0] += 1
                    if st[0] >= every or clock.monotonic() - st[1] >= delay:
                        await send()
                    else:
                        dirty.set()
            except DecodeError as exc:
                # grpc hands a parse failure to the handler; it is the peer's fault.
                raise engine.malformed(stream, str(exc)) from exc
            await send()
        except InvalidStream as exc:
            node = stream.node.name if stream.node is not None else "?"
            logger.warning("node %s: telemetry stream refused: %s", node, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            flush_task.cancel()
            engine.close_stream(stream)
