"""Buffer, backoff, sources, report building, settings and the lifecycle, without the network."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide.base.errors import ConfigError
from tide.base.lifecycle import InvalidTransition
from tide.base.retry import Backoff
from tide.services.agent.agent import AGENT_LIFECYCLE, Agent, AgentState
from tide.services.agent.attribution import owners_from_response
from tide.services.agent.buffer import ReportBuffer
from tide.services.agent.errors import SourceError
from tide.services.agent.metrics import AgentMetrics
from tide.services.agent.model import (
    GpuReading,
    HealthFlag,
    NodeNotice,
    NoticeKind,
    PodOwner,
    Sample,
)
from tide.services.agent.podresources import api_pb2
from tide.services.agent.refusals import RefusalLog, reason_label
from tide.services.agent.report import build_report
from tide.services.agent.settings import AgentSettings
from tide.services.agent.sources import Profile, ReplaySource, SyntheticSource
from tide.services.common.config import ProcessSettings, load_settings
from tide.services.common.logs import with_context
from tide.services.testing.clock import FakeClock
from tide.v1 import telemetry_pb2

pytestmark = pytest.mark.component


def _report(events: int = 0) -> telemetry_pb2.NodeReport:
    r = telemetry_pb2.NodeReport(node_name="n", boot_id="b")
    for _ in range(events):
        r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE)
    return r


def test_buffer_numbers_on_first_send_and_resends_in_order_after_rewind() -> None:
    buf = ReportBuffer(capacity=10, max_in_flight=4)
    for _ in range(6):
        buf.add(_report())
    sent = [buf.next_to_send() for _ in range(6)]
    # The in-flight window stops the sender at 4.
    assert [r.seq for r in sent[:4] if r] == [1, 2, 3, 4] and sent[4] is None
    assert buf.ack(2) == 2
    nxt = buf.next_to_send()
    assert nxt is not None and nxt.seq == 5
    buf.rewind()
    resent = []
    while (r := buf.next_to_send()) is not None:
        resent.append(r.seq)
    assert resent == [3, 4, 5, 6]


def test_buffer_drops_oldest_unsent_when_full_and_carries_its_events() -> None:
    buf = ReportBuffer(capacity=4, max_in_flight=2)
    buf.add(_report())
    buf.add(_report())
    assert buf.next_to_send() is not None and buf.next_to_send() is not None  # seq 1, 2 in flight
    buf.add(_report(events=1))  # unsent, carries a termination notice
    buf.add(_report())
    buf.add(_report())  # full: the oldest unsent (with the notice) goes
    assert buf.dropped_total == 1 and len(buf) == 4
    buf.ack(2)
    nxt = buf.next_to_send()
    assert nxt is not None and nxt.seq == 3
    assert [e.kind for e in nxt.events] == [telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE]


def test_buffer_ignores_acks_for_numbers_never_sent() -> None:
    buf = ReportBuffer(capacity=4, max_in_flight=2)
    buf.add(_report())
    buf.add(_report())
    buf.next_to_send()
    assert buf.ack(99) == 1
    assert len(buf) == 1 and buf.acked_seq == 1


@pytest.mark.parametrize(("capacity", "in_flight"), [(1, 1), (4, 4), (4, 0)])
def test_buffer_rejects_bad_sizes(capacity: int, in_flight: int) -> None:
    with pytest.raises(ConfigError):
        ReportBuffer(capacity, in_flight)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.sampled_from(["add", "send", "ack", "rewind", "lose"]), max_size=200),
    capacity=st.integers(2, 12),
)
def test_buffer_accounts_for_every_report(ops: list[str], capacity: int) -> None:
    """Whatever happens, the scaler sees seqs 1..n with no gap, and every added
    report is delivered, dropped or still held."""
    buf = ReportBuffer(capacity, max(1, capacity // 2))
    scaler_acked = 0
    on_wire: list[int] = []
    for op in ops:
        if op == "add":
            buf.add(_report())
        elif op == "send":
            r = buf.next_to_send()
            if r is not None:
                on_wire.append(r.seq)
        elif op == "ack":
            for seq in on_wire:
                if seq == scaler_acked + 1:
                    scaler_acked = seq
            on_wire.clear()
            buf.ack(scaler_acked)
        elif op == "rewind":
            on_wire.clear()
            buf.rewind()
        else:  # the stream breaks: what was on the wire is lost
            on_wire.clear()
        assert len(buf) <= capacity
    assert scaler_acked <= buf.last_seq
    assert scaler_acked + buf.dropped_total + len(buf) == buf.added_total


def test_backoff_doubles_with_jitter_and_resets() -> None:
    b = Backoff(0.5, 4.0, random.Random(7))
    delays = [b.next_delay_s() for _ in range(6)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    for d, c in zip(delays, ceilings, strict=True):
        assert c / 2 <= d <= c
    assert len({round(d, 6) for d in delays[3:]}) == 3  # jittered, not constant
    b.reset()
    assert b.next_delay_s() <= 0.5


def test_synthetic_profiles() -> None:
    clock = FakeClock()
    src = SyntheticSource(Profile.parse("square:20:90:10"), 4, clock)
    assert src.open() == 4
    assert [r.utilization_pct for r in src.sample()] == [20.0, 20.5, 21.0, 21.5]
    clock.advance(10)
    first = src.sample()[0]
    assert first.utilization_pct == 90.0
    assert 0 < first.memory_used_bytes < first.memory_total_bytes
    ramp = Profile.parse("ramp:0:100:100")
    assert ramp.at(50) == 50.0 and ramp.at(500) == 100.0


@pytest.mark.parametrize("text", ["steady", "steady:x", "ramp:1:2", "square:0:200:5", "wave:1"])
def test_bad_profiles_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="synthetic_profile"):
        Profile.parse(text)


def test_replay_jsonl_follows_the_clock_and_loops(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"t": 100, "gpus": [{"index": 0, "utilization_pct": 10}, {"index": 1, "utilization_pct": 11}]}\n'
        '{"t": 102, "index": 0, "utilization_pct": 80, "health_flags": 1}\n'
        '{"t": 102, "index": 1, "utilization_pct": 81}\n'
    )
    clock = FakeClock()
    src = ReplaySource(trace, clock)
    assert src.open() == 2
    assert [r.utilization_pct for r in src.sample()] == [10.0, 11.0]
    clock.advance(2.5)
    now = src.sample()
    assert [r.utilization_pct for r in now] == [80.0, 81.0]
    assert now[0].health == HealthFlag.XID
    clock.advance(2.0)  # period is 4 s (2 s trace + its last step): back to the start
    assert src.sample()[0].utilization_pct == 10.0


def test_replay_csv(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t,index,uuid,utilization_pct,power_w\n0,0,GPU-x,42.5,300\n1,0,GPU-x,43,301\n")
    src = ReplaySource(trace, FakeClock())
    assert src.open() == 1
    r = src.sample()[0]
    assert (r.uuid, r.utilization_pct, r.power_w) == ("GPU-x", 42.5, 300.0)


def test_replay_bad_row_names_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "index": 0}\n{"t": "soon", "index": 1}\n')
    with pytest.raises(SourceError, match=r"bad\.jsonl:2"):
        ReplaySource(trace, FakeClock()).open()


def test_report_carries_readings_owner_and_events() -> None:
    sample = Sample(
        sampled_at=1_800_000_000.5,
        gpus=[
            GpuReading(0, "GPU-a", 101.0, 90, 80, -1.0, 50.0),
            GpuReading(1, "GPU-b", health=HealthFlag.LOST | HealthFlag.NVML_ERROR),
        ],
        gpu_capacity=2,
        notices=[
            NodeNotice(NoticeKind.TERMINATION_NOTICE, 1_800_000_000.0, "spot", 1_800_000_120.0)
        ],
    )
    owners = {"GPU-a": PodOwner("ml", "trainer-0", "worker")}
    r = build_report(sample, "node-a", "boot", owners)
    assert r.seq == 0  # numbered by the buffer, on first send
    a, b = r.gpus
    assert a.utilization_pct == 100.0 and a.memory_used_bytes == 80 and a.power_w == 0.0
    assert (a.pod.namespace, a.pod.name) == ("ml", "trainer-0")
    assert not b.HasField("pod") and b.health_flags == 12
    (event,) = r.events
    assert event.kind == telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE
    assert event.deadline.seconds == 1_800_000_120
    assert r.sampled_at.ToNanoseconds() == 1_800_000_000_500_000_000


def test_owners_from_pod_resources_skip_other_resources_and_strip_replicas() -> None:
    response = api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                name="p",
                namespace="ns",
                containers=[
                    api_pb2.ContainerResources(
                        name="c",
                        devices=[
                            api_pb2.ContainerDevices(
                                resource_name="nvidia.com/gpu", device_ids=["GPU-a::1"]
                            ),
                            api_pb2.ContainerDevices(
                                resource_name="example.com/nic", device_ids=["GPU-z"]
                            ),
                        ],
                    )
                ],
            )
        ]
    )
    assert owners_from_response(response, "nvidia.com/gpu") == {"GPU-a": PodOwner("ns", "p", "c")}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("interval_s", 0.0, "interval_s: must be > 0, got 0.0"),
        ("source", "dcmg", "source: expected one of nvml, dcgm, replay, synthetic, got 'dcmg'"),
        ("dcgm_timeout_s", 0.0, "dcgm_timeout_s: must be > 0, got 0.0"),
        ("scaler", "nohost", "scaler: expected HOST:PORT, got 'nohost'"),
        ("max_in_flight_reports", 600, "max_in_flight_reports: must be in 1..599, got 600"),
        ("backoff_max_s", 0.1, "backoff_max_s: must be >= backoff_initial_s"),
        ("grace_period_s", -1.0, "grace_period_s: must be >= 0, got -1.0"),
        ("log_format", "xml", "log_format: expected text or json, got 'xml'"),
    ],
)
def test_settings_name_the_bad_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AgentSettings(**{field: value})  # type: ignore[arg-type]
    assert message in str(info.value)


def test_settings_inherit_the_process_settings_and_keep_the_agent_flags() -> None:
    """grace_period_s, logs, /metrics and --config are the common ones, written once."""
    assert issubclass(AgentSettings, ProcessSettings)
    s = load_settings(
        AgentSettings,
        ["--grace-period-s=3", "--listen=127.0.0.1:0", "--tls-ca-file=", "--no-watch-node"],
        env={"TIDE_LOG_FORMAT": "json"},
    )
    assert (s.grace_period_s, s.listen, s.watch_node, s.log_format) == (
        3.0,
        "127.0.0.1:0",
        False,
        "json",
    )
    assert AgentSettings().listen == "", "the health server stays off unless asked for"


def test_lifecycle_is_one_table_and_a_missing_edge_is_a_bug() -> None:
    assert AGENT_LIFECYCLE.final_states == {AgentState.STOPPED}
    assert (AgentState.RUNNING, AgentState.DRAINING) in AGENT_LIFECYCLE.edges()
    agent = Agent(
        AgentSettings(watch_node=False, pod_resources_socket=""),
        SyntheticSource(Profile.parse("steady:50"), 1, FakeClock()),
    )
    with pytest.raises(InvalidTransition, match="CREATED -> DRAINING"):
        agent._transition(AgentState.DRAINING)
    assert agent.state is AgentState.CREATED


def test_refusals_are_counted_each_and_logged_once_per_cause_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = AgentMetrics()
    log = RefusalLog(
        with_context(logging.getLogger("tide.services.agent.test"), node="n"), metrics, 60.0
    )
    Refusal = telemetry_pb2.ReportRefusal
    ahead = Refusal(
        reason=Refusal.REASON_TIMESTAMP_IN_FUTURE, reports=3, skew_s=7200.0, limit_s=5.0, last_seq=3
    )
    back = Refusal(reason=Refusal.REASON_TIMESTAMP_OUT_OF_ORDER, reports=1, skew_s=-2.0, last_seq=4)
    with caplog.at_level(logging.WARNING):
        log.note([ahead], 0.0)
        log.note([ahead, back], 10.0)  # the second cause logs at once, the first waits
        log.note([ahead], 59.0)
        log.note([ahead], 61.0)  # the interval passed: the reports since the last line
    lines = caplog.messages
    assert len(lines) == 3, lines
    assert "dropped 3 report(s) (timestamp_in_future" in lines[0]
    assert "2.0 h ahead" in lines[0] and "allows 5.0 s" in lines[0]
    assert "(timestamp_out_of_order" in lines[1] and "stepped back" in lines[1]
    assert "dropped 9 report(s) (timestamp_in_future" in lines[2]
    count = metrics.registry.get_sample_value
    assert count("tide_agent_reports_refused_total", {"reason": "timestamp_in_future"}) == 12
    assert count("tide_agent_reports_refused_total", {"reason": "timestamp_out_of_order"}) == 1
    assert reason_label(99) == "unknown"
