"""A stream that ends while a report is being written: grpcio's asyncio client then
reports INTERNAL "Internal error from Core" in place of the call's status
(grpc/grpc#36066). The agent must take it for what it is, a stream that ended, and
not for an error of the scaler's."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc.aio import Metadata

from tide.services.agent.buffer import ReportBuffer
from tide.services.agent.stream import StreamConfig, TelemetryStream, status_lost
from tide.v1 import telemetry_pb2

pytestmark = pytest.mark.unit


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, Metadata(), Metadata(), details=details)


class _EndedCall:
    """A bidi call that ends, for the writer and the reader alike, with ``error``."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error

    async def write(self, _report: Any) -> None:
        raise self.error

    def __aiter__(self) -> _EndedCall:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        raise self.error

    def cancel(self) -> bool:
        return False


class _Stub:
    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error

    def Stream(self, **_: Any) -> _EndedCall:  # the generated stub's name
        return _EndedCall(self.error)


async def _reason(error: grpc.aio.AioRpcError) -> str:
    buffer = ReportBuffer(8, 4)
    buffer.add(telemetry_pb2.NodeReport(node_name="n", boot_id="b"))
    stream = TelemetryStream(StreamConfig("127.0.0.1:1", "n", "b"), buffer)
    return await stream._one_stream(_Stub(error))  # type: ignore[arg-type]


async def test_a_write_that_lost_the_status_ends_the_stream_as_status_lost() -> None:
    lost = _error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert status_lost(lost)
    reason = await _reason(lost)
    # The disconnect label is status_lost, not internal: no scaler error to look for.
    assert reason.startswith("STATUS_LOST: "), reason
    assert "grpc/grpc#36066" in reason


async def test_the_scalers_own_internal_stays_internal() -> None:
    own = _error(grpc.StatusCode.INTERNAL, "internal error; see the server log")
    assert not status_lost(own)
    assert await _reason(own) == "INTERNAL: internal error; see the server log"
    refused = _error(grpc.StatusCode.UNAUTHENTICATED, "bearer token not accepted")
    assert await _reason(refused) == "UNAUTHENTICATED: bearer token not accepted"
