"""A Telemetry server with the scaler's ack semantics, for the agent's tests.

Acks the highest contiguous seq received per boot id. A boot id it has not
seen starts at the first seq it receives (a restarted scaler cannot know what
its previous life acknowledged). Duplicates are acked and recorded as such.

Run as a process (``python -m tests.agent.telemetry_server --port 0 --record
FILE``): it prints ``PORT <n>`` and appends one JSON line per received report
to FILE, flushed at once, so a test can kill -9 it and still read what it got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from tide.base import grpc_options
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc


@dataclass
class BootState:
    acked: int
    pending: set[int] = field(default_factory=set)


class TelemetryRecorder(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(self, record: IO[str] | None = None, report_interval_s: float = 0.0) -> None:
        self.boots: dict[str, BootState] = {}
        self.received: list[telemetry_pb2.NodeReport] = []
        self.duplicates = 0
        self.record = record
        self.report_interval_s = report_interval_s
        #: While set, reports are read but not acked (a scaler stuck behind the transport).
        self.hold_acks = False
        self.streams_opened = 0
        self.streams_open = 0
        self.changed = asyncio.Event()

    def seqs(self, boot_id: str) -> list[int]:
        return [r.seq for r in self.received if r.boot_id == boot_id]

    def _accept(self, report: telemetry_pb2.NodeReport) -> int:
        state = self.boots.get(report.boot_id)
        if state is None:
            state = self.boots[report.boot_id] = BootState(acked=report.seq - 1)
        duplicate = report.seq <= state.acked or report.seq in state.pending
        if duplicate:
            self.duplicates += 1
        else:
            state.pending.add(report.seq)
            while state.acked + 1 in state.pending:
                state.acked += 1
                state.pending.discard(state.acked)
        self.received.append(report)
        if self.record is not None:
            line = {
                "boot_id": report.boot_id,
                "seq": report.seq,
                "dup": duplicate,
                "events": [e.kind for e in report.events],
                "gpus": len(report.gpus),
            }
            self.record.write(json.dumps(line) + "\n")
            self.record.flush()
        self.changed.set()
        return state.acked

    async def Stream(
        self, request_iterator: AsyncIterator[telemetry_pb2.NodeReport], context: Any
    ) -> AsyncIterator[telemetry_pb2.TelemetryAck]:
        self.streams_opened += 1
        self.streams_open += 1
        self.changed.set()
        try:
            async for report in request_iterator:
                acked = self._accept(report)
                if self.hold_acks:
                    continue
                yield telemetry_pb2.TelemetryAck(
                    boot_id=report.boot_id,
                    acked_seq=acked,
                    report_interval_s=self.report_interval_s,
                )
        finally:
            self.streams_open -= 1
            self.changed.set()


async def start_server(
    recorder: TelemetryRecorder,
    port: int = 0,
    client_keepalive_time_s: float = grpc_options.KEEPALIVE_TIME_S,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(
        options=grpc_options.server_options(client_keepalive_time_s=client_keepalive_time_s)
    )
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(recorder, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def _serve(args: argparse.Namespace, record: IO[str]) -> None:
    recorder = TelemetryRecorder(record)
    server, port = await start_server(recorder, args.port, args.client_keepalive_time_s)
    print(f"PORT {port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record", required=True)
    parser.add_argument("--client-keepalive-time-s", type=float, default=1.0)
    args = parser.parse_args()
    with open(args.record, "a") as record:
        asyncio.run(_serve(args, record))


if __name__ == "__main__":
    main()
