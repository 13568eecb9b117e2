"""Reliability catalog T23: a telemetry stream that stops reporting is closed
after stream_idle_timeout_s, so a peer that holds streams open without using
them holds no slot for long."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.procs import start_memory_scaler
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.integration


def test_an_idle_telemetry_stream_is_closed(tmp_path: Path) -> None:
    scaler = start_memory_scaler(
        f"sqlite:///{tmp_path / 'tide.db'}", "--stream-idle-timeout-s", "1"
    )
    try:
        with grpc.insecure_channel(scaler.target) as ch:
            first = telemetry_pb2.NodeReport(node_name="quiet", boot_id="b", seq=1)
            first.sampled_at.GetCurrentTime()

            def one_then_silence() -> Iterator[telemetry_pb2.NodeReport]:
                yield first
                time.sleep(30)  # never sends again; the server must not wait this out

            started = time.monotonic()
            acks = telemetry_pb2_grpc.TelemetryStub(ch).Stream(one_then_silence(), timeout=20)
            with pytest.raises(grpc.RpcError) as err:
                for _ in acks:
                    pass
            closed_after = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "stream_idle_timeout_s" in (err.value.details() or "")
        # 1 to 1.25 timeouts after the last report, plus a loaded machine's slack.
        assert 1.0 <= closed_after < 4.0, closed_after
    finally:
        scaler.kill()
