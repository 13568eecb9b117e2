"""A minimal service on the common runtime, run as a process by the runtime tests.

It serves Telemetry (echoing acks, so a test can hold a stream open) and
marks Scaler.SetAutoscaling as an admin method, without any domain logic.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

from tide.services.common import logs
from tide.services.common.config import CommonSettings, load_settings
from tide.services.common.server import ServiceSpec, serve
from tide.v1 import scaler_pb2, scaler_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc


class EchoTelemetry(telemetry_pb2_grpc.TelemetryServicer):
    async def Stream(
        self, request_iterator: AsyncIterator[telemetry_pb2.NodeReport], context: Any
    ) -> AsyncIterator[telemetry_pb2.TelemetryAck]:
        async for report in request_iterator:
            yield telemetry_pb2.TelemetryAck(boot_id=report.boot_id, acked_seq=report.seq)


class TinyScaler(scaler_pb2_grpc.ScalerServicer):
    async def ListJobs(self, request: Any, context: Any) -> scaler_pb2.ListJobsResponse:
        return scaler_pb2.ListJobsResponse()

    async def SetAutoscaling(self, request: Any, context: Any) -> scaler_pb2.Job:
        return scaler_pb2.Job(job_id=request.job_id, autoscaling_paused=request.paused)


def main(argv: list[str]) -> int:
    try:
        settings = load_settings(CommonSettings, argv, prog="sample-service")
    except Exception as exc:  # ConfigError: one line, exit 2, like every service
        print(f"sample-service: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    specs = [
        ServiceSpec(
            telemetry_pb2_grpc.add_TelemetryServicer_to_server, EchoTelemetry(), "tide.v1.Telemetry"
        ),
        ServiceSpec(scaler_pb2_grpc.add_ScalerServicer_to_server, TinyScaler(), "tide.v1.Scaler"),
    ]
    asyncio.run(serve(settings, specs, admin_methods=frozenset({"/tide.v1.Scaler/SetAutoscaling"})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
