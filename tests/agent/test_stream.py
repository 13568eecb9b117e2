"""The Telemetry stream against a real grpc.aio server on port 0."""

from __future__ import annotations

import time

import pytest

from tests.support.poll import eventually
from tide.base import grpc_options
from tide.services.agent.model import GpuReading, NodeNotice, NoticeKind
from tide.services.agent.stream import StreamConfig
from tide.v1 import telemetry_pb2

from .proxy import StallingProxy
from .support import RunAgent, Scaler, agent_settings, single_stream

pytestmark = pytest.mark.component


def _contiguous(seqs: list[int]) -> bool:
    return sorted(set(seqs)) == list(range(1, max(seqs) + 1)) if seqs else True


async def test_reports_are_acked_in_order_and_released(scaler: Scaler, run_agent: RunAgent) -> None:
    r = await run_agent(agent_settings(scaler.port))
    sink = single_stream(r.agent)
    boot = r.agent.boot_id
    await eventually(lambda: len(scaler.recorder.seqs(boot)) >= 10, what="10 reports")
    seqs = scaler.recorder.seqs(boot)
    assert seqs == list(range(1, len(seqs) + 1))
    assert scaler.recorder.duplicates == 0
    first = scaler.recorder.received[0]
    assert first.node_name == "gpu-node-1"
    assert first.gpu_capacity == 2
    assert [g.index for g in first.gpus] == [0, 1]
    # Acked reports leave the buffer: only the last one or two can still be in flight.
    await eventually(lambda: sink.buffer.acked_seq >= 10, what="acks")
    assert len(sink.buffer) <= 3
    await r.shutdown()


async def test_sampling_continues_while_scaler_is_down_and_held_reports_are_resent(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    r = await run_agent(agent_settings(scaler.port))
    agent = r.agent
    sink = single_stream(agent)
    await eventually(lambda: len(scaler.recorder.received) >= 5, what="first reports")
    await scaler.server.stop(None)
    old = scaler.recorder
    sampled_at_stop = sink.buffer.added_total
    # The network is gone, yet the beat goes on at its own pace.
    await eventually(lambda: sink.buffer.added_total >= sampled_at_stop + 10, what="sampling")
    assert len(sink.buffer) >= 10

    await scaler.restart(keepalive_time_s=1.0)
    await eventually(lambda: len(sink.buffer) <= 2, timeout_s=10, what="resend after restart")
    seqs = old.seqs(agent.boot_id) + scaler.recorder.seqs(agent.boot_id)
    assert _contiguous(seqs)
    assert sink.buffer.dropped_total == 0
    assert sink.stream.state.connects >= 2
    await r.shutdown()


async def test_full_buffer_drops_oldest_unsent_and_counts(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    settings = agent_settings(scaler.port, buffer_reports=8, max_in_flight_reports=4)
    r = await run_agent(settings)
    agent = r.agent
    sink = single_stream(agent)
    await eventually(lambda: len(scaler.recorder.received) >= 3, what="first reports")
    await scaler.server.stop(None)
    old = scaler.recorder
    await eventually(lambda: sink.buffer.dropped_total >= 10, what="drops")
    assert len(sink.buffer) <= 8
    await scaler.restart(keepalive_time_s=1.0)
    await eventually(lambda: len(sink.buffer) <= 2, what="drain")
    r.stop.set()
    await r.task
    delivered = set(old.seqs(agent.boot_id)) | set(scaler.recorder.seqs(agent.boot_id))
    assert delivered == set(range(1, sink.buffer.last_seq + 1))
    # Every sampled report was delivered (once, by seq), dropped, or is still held.
    assert len(delivered) + sink.buffer.dropped_total + len(sink.buffer) == (
        sink.buffer.added_total
    )


async def test_scaler_that_stops_acking_is_left_after_ack_timeout(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    r = await run_agent(agent_settings(scaler.port, ack_timeout_s=0.5))
    agent = r.agent
    sink = single_stream(agent)
    await eventually(lambda: len(scaler.recorder.received) >= 3, what="first reports")
    scaler.recorder.hold_acks = True
    await eventually(lambda: sink.stream.state.disconnects, what="a disconnect")
    assert sink.stream.state.disconnects[0].reason.startswith("ACK_TIMEOUT")
    scaler.recorder.hold_acks = False
    await eventually(lambda: len(sink.buffer) <= 2, what="drain after timeout")
    assert _contiguous(scaler.recorder.seqs(agent.boot_id))
    await r.shutdown()


async def test_scaler_sets_the_report_interval(scaler: Scaler, run_agent: RunAgent) -> None:
    scaler.recorder.report_interval_s = 0.2
    r = await run_agent(agent_settings(scaler.port, interval_s=0.05))
    await eventually(lambda: r.agent.interval_s == 0.2, what="interval from ack")
    await r.shutdown()


async def test_partition_is_detected_within_keepalive(scaler: Scaler, run_agent: RunAgent) -> None:
    proxy = StallingProxy(scaler.port)
    await proxy.start()
    keepalive_time_s, keepalive_timeout_s = 1.0, 1.0
    settings = agent_settings(
        proxy.port,
        keepalive_time_s=keepalive_time_s,
        keepalive_timeout_s=keepalive_timeout_s,
        ack_timeout_s=60.0,  # so that only keepalive can notice
    )
    r = await run_agent(settings)
    agent = r.agent
    sink = single_stream(agent)
    try:
        await eventually(lambda: len(scaler.recorder.received) >= 3, what="first reports")
        proxy.stall()
        stalled_at = time.monotonic()
        sampled_at_stall = sink.buffer.added_total
        await eventually(lambda: sink.stream.state.disconnects, timeout_s=10, what="detection")
        # Writes were stuck behind the stalled path, and the beat went on regardless.
        sampled_during = sink.buffer.added_total - sampled_at_stall
        assert sampled_during >= 10, sampled_during  # ~40 expected at 20 Hz over ~2 s
        detected_s = time.monotonic() - stalled_at
        reason = sink.stream.state.disconnects[0].reason
        print(f"partition detected after {detected_s:.2f} s ({reason})")
        # A write stuck behind the stall when keepalive ends the transport loses the
        # call's UNAVAILABLE to grpcio's INTERNAL (grpc/grpc#36066): STATUS_LOST. Either
        # way it was keepalive: the ack timeout is 60 s, and the bound below holds.
        assert reason.startswith(("UNAVAILABLE", "STATUS_LOST")), reason
        # The first ping goes out at most keepalive_time after the last read, and the
        # connection is dead keepalive_timeout later; 1 s of slack for a loaded CI box.
        assert detected_s <= keepalive_time_s + keepalive_timeout_s + 1.0, detected_s
        proxy.heal()
        await eventually(lambda: len(sink.buffer) <= 2, timeout_s=10, what="recovery")
        assert _contiguous(scaler.recorder.seqs(agent.boot_id))
        await r.shutdown()
    finally:
        await proxy.close()


def test_agent_keepalive_agrees_with_the_scaler_options() -> None:
    client = dict(StreamConfig("x:1", "n", "b").channel_options())
    server = dict(grpc_options.server_options())
    assert client["grpc.keepalive_time_ms"] == grpc_options.KEEPALIVE_TIME_S * 1000
    assert client["grpc.keepalive_timeout_ms"] == grpc_options.KEEPALIVE_TIMEOUT_S * 1000
    # The scaler must accept our pings, or it answers GOAWAY(too_many_pings).
    assert (
        server["grpc.http2.min_recv_ping_interval_without_data_ms"]
        <= (client["grpc.keepalive_time_ms"])
    )
    assert client["grpc.max_send_message_length"] <= server["grpc.max_receive_message_length"]


async def test_final_report_on_stop_carries_agent_shutdown(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    r = await run_agent(agent_settings(scaler.port))
    sink = single_stream(r.agent)
    await eventually(lambda: len(scaler.recorder.received) >= 3, what="first reports")
    await r.shutdown()
    last = scaler.recorder.received[-1]
    assert [e.kind for e in last.events] == [telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN]
    assert len(sink.buffer) == 0


class HungSource:
    """A source whose driver hangs after the first samples (a wedged NVML call)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.samples = 0

    def open(self) -> int:
        return 2

    def sample(self) -> list[GpuReading]:
        self.samples += 1
        if self.samples > 3:
            self.release.wait(30)
        return [GpuReading(0, "GPU-a"), GpuReading(1, "GPU-b")]

    def close(self) -> None:
        pass


async def test_sigterm_reaches_the_scaler_even_with_a_hung_driver(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    source = HungSource()
    r = await run_agent(agent_settings(scaler.port), source)
    try:
        await eventually(lambda: source.samples > 3, what="the hang")
        started = time.monotonic()
        await r.shutdown(timeout_s=10)
        assert time.monotonic() - started < 5
    finally:
        source.release.set()
    last = scaler.recorder.received[-1]
    assert [e.kind for e in last.events] == [telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN]
    assert len(last.gpus) == 0 and last.gpu_capacity == 2


class FlakySource:
    """A source that raises for a while (an unexpected driver error), then recovers."""

    def __init__(self) -> None:
        self.failing = False

    def open(self) -> int:
        return 1

    def sample(self) -> list[GpuReading]:
        if self.failing:
            raise RuntimeError("driver went away")
        return [GpuReading(0, "GPU-a", 50.0)]

    def close(self) -> None:
        pass


async def test_a_failing_source_still_lets_notices_through(
    scaler: Scaler, run_agent: RunAgent
) -> None:
    source = FlakySource()
    r = await run_agent(agent_settings(scaler.port), source)
    agent = r.agent
    await eventually(lambda: len(scaler.recorder.received) >= 3, what="first reports")
    source.failing = True
    agent.post_notice(NodeNotice(NoticeKind.CORDONED, time.time(), "test"))

    def cordon_report() -> telemetry_pb2.NodeReport | None:
        for report in scaler.recorder.received:
            if any(e.kind == telemetry_pb2.NodeEvent.KIND_CORDONED for e in report.events):
                return report
        return None

    report = await eventually(cordon_report, what="the notice despite the failing source")
    assert len(report.gpus) == 0
    source.failing = False
    seen = len(scaler.recorder.received)
    await eventually(
        lambda: any(len(rep.gpus) == 1 for rep in scaler.recorder.received[seen:]),
        what="recovery",
    )
    await r.shutdown()
    assert agent.failure is None
    failed = agent.metrics.registry.get_sample_value("tide_agent_samples_failed_total")
    assert failed is not None and failed >= 1


async def test_a_scaler_not_listening_yet_is_unavailable_not_an_error(
    run_agent: RunAgent, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that starts before its scaler (a DaemonSet rolled out first): each try ends
    UNAVAILABLE, and no write into the ended call is logged as an ERROR."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = await run_agent(agent_settings(port))
    sink = single_stream(r.agent)
    await eventually(lambda: len(sink.stream.state.disconnects) >= 3, what="3 tries")
    reasons = [d.reason for d in sink.stream.state.disconnects]
    assert all(reason.startswith("UNAVAILABLE") for reason in reasons), reasons
    # Formatted whole, so that a failure shows each record's traceback, not its first line.
    errors = [caplog.handler.format(rec) for rec in caplog.records if rec.levelname == "ERROR"]
    assert errors == []
    await r.shutdown()
