"""The agent as a process: flags, one-line errors, SIGTERM, and a scaler that is killed."""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.poll import eventually
from tests.support.procs import ROOT, start_service
from tide.base.listening import parse_listening
from tide.services.testing.ports import free_port
from tide.v1 import telemetry_pb2

from .support import Scaler

pytestmark = pytest.mark.integration

PY = sys.executable


def _agent_cmd(port: int, *extra: str) -> list[str]:
    return [
        PY,
        "-m",
        "tide.services.agent",
        f"--scaler=127.0.0.1:{port}",
        "--node-name=gpu-node-7",
        "--source=synthetic",
        "--synthetic-gpus=8",
        "--interval-s=0.05",
        "--no-watch-node",
        "--pod-resources-socket=",
        "--backoff-initial-s=0.05",
        "--backoff-max-s=0.3",
        *extra,
    ]


def test_help_lists_the_settings() -> None:
    out = subprocess.run(
        [PY, "-m", "tide.services.agent", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in ("--scaler", "--node-name", "--source", "--interval-s", "--buffer-reports"):
        assert flag in out.stdout
    assert "--pod-resources-socket" in out.stdout and "--metrics-listen" in out.stdout


def test_bad_setting_is_one_line_naming_it() -> None:
    out = subprocess.run(
        [PY, "-m", "tide.services.agent", "--interval-s=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["tide-agent: interval_s: must be > 0, got -1.0"]


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="NVML is installed here"
)
def test_nvml_init_failure_is_one_clear_error_line() -> None:
    """This machine has no NVIDIA driver: the real pynvml fails to load NVML."""
    out = subprocess.run(
        [
            PY,
            "-m",
            "tide.services.agent",
            "--source=nvml",
            "--no-watch-node",
            "--pod-resources-socket=",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, out.stderr
    assert "NVML init failed" in errors[0]
    assert "Traceback" not in out.stderr


async def _scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
    body = (await asyncio.wait_for(reader.read(), 10)).decode()
    writer.close()
    return body


async def test_sigterm_sends_a_final_report_and_exits(scaler: Scaler) -> None:
    metrics_port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *_agent_cmd(scaler.port, f"--metrics-listen=127.0.0.1:{metrics_port}"),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await eventually(lambda: len(scaler.recorder.received) >= 5, timeout_s=30, what="reports")
        metrics = await _scrape(metrics_port)
        sampled = re.search(r"^tide_agent_reports_sampled_total (\S+)$", metrics, re.M)
        assert sampled and float(sampled.group(1)) >= 5
        assert re.search(r"^tide_agent_stream_connected 1\.0$", metrics, re.M)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0
    last = scaler.recorder.received[-1]
    assert [e.kind for e in last.events] == [telemetry_pb2.NodeEvent.KIND_AGENT_SHUTDOWN]
    assert len(last.gpus) == 8
    seqs = [r.seq for r in scaler.recorder.received]
    assert seqs == list(range(1, len(seqs) + 1))


class ScalerProcess:
    """tests/agent/telemetry_server.py as a process that can be killed with -9."""

    def __init__(self, record: Path) -> None:
        self.record = record
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            PY,
            "-m",
            "tests.agent.telemetry_server",
            f"--port={self.port}",
            f"--record={self.record}",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        match = re.fullmatch(rb"PORT (\d+)\n", line)
        assert match, line
        self.port = int(match.group(1))

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def received(self) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]


@pytest.mark.slow
@pytest.mark.parametrize(("buffer", "expect_drops"), [(1000, False), (30, True)])
async def test_scaler_killed_and_restarted_loses_nothing_uncounted(
    tmp_path: Path, buffer: int, expect_drops: bool
) -> None:
    first = ScalerProcess(tmp_path / "first.jsonl")
    await first.start()
    agent = await asyncio.create_subprocess_exec(
        *_agent_cmd(first.port, f"--buffer-reports={buffer}", "--max-in-flight-reports=10"),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    second = ScalerProcess(tmp_path / "second.jsonl")
    try:
        await eventually(lambda: len(first.received()) >= 20, timeout_s=30, what="streaming")
        await first.kill()  # kill -9: no goodbye to the agent
        await asyncio.sleep(3.0)  # the outage: ~60 samples at 20 Hz
        second.port = first.port
        await second.start()
        await eventually(lambda: len(second.received()) >= 20, timeout_s=30, what="resumed")
        agent.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(agent.communicate(), 20)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await first.kill()
        await second.kill()
    assert agent.returncode == 0
    log = stderr.decode()
    match = re.search(r"final report acked; (\d+) sampled, (\d+) dropped, (\d+) unacked", log)
    assert match, log[-2000:]
    sampled, dropped, unacked = map(int, match.groups())
    assert unacked == 0

    before = [int(str(r["seq"])) for r in first.received()]
    after = [int(str(r["seq"])) for r in second.received()]
    delivered = set(before) | set(after)
    last_seq = max(delivered)
    # Delivered once by sequence number: no hole, nothing numbered twice...
    assert delivered == set(range(1, last_seq + 1))
    assert len(before) == len(set(before)) and len(after) == len(set(after))
    # ...re-deliveries across the restart only for what the killed scaler had not acked.
    assert len(set(before) & set(after)) <= 10
    # ...and every sampled report is delivered or counted as dropped.
    assert last_seq + dropped == sampled
    assert (dropped > 0) is expect_drops


@pytest.mark.slow
def test_bench_prints_a_result_line() -> None:
    out = subprocess.run(
        [PY, "-m", "bench.agent", "--seconds=3", "--warmup-s=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last[len("RESULT ") :])
    assert result["reports_per_s"] > 0
    # Loose bounds: a smoke test on a shared machine, not the measurement.
    assert 0 < result["cpu_pct"] < 25 and 10 < result["rss_mb"] < 200


class RealScaler:
    """The production scaler's Telemetry path (``python -m tide.services.testing.scaler``, with the
    in-memory coordinator and actuator: no job moves here), killed with -9 and restarted."""

    def __init__(self, db: Path, port: int = 0) -> None:
        self.db = db
        self.port = port
        self.metrics_port = 0
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            PY,
            "-m",
            "tide.services.testing.scaler",
            "--coordinator=memory",
            "--actuator=memory",
            f"--listen=127.0.0.1:{self.port}",
            "--metrics-listen=127.0.0.1:0",
            f"--db=sqlite:///{self.db}",
            "--report-interval-s=0",
            "--log-level=WARNING",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
            assert line, "scaler exited before listening"
            ports = parse_listening(line)
            if ports is not None:
                assert ports.metrics_port is not None
                self.port, self.metrics_port = ports.grpc_port, ports.metrics_port
                return

    async def counters(self) -> dict[str, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.metrics_port)
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        body = (await asyncio.wait_for(reader.read(), 10)).decode()
        writer.close()
        found: dict[str, float] = {}
        for line in body.splitlines():
            m = re.match(r'tide_scaler_telemetry_reports_total\{result="(\w+)"\} (\S+)', line)
            if m:
                found[m.group(1)] = float(m.group(2))
            m = re.match(r"tide_scaler_telemetry_seq_gaps_total (\S+)", line)
            if m:
                found["gaps"] = float(m.group(1))
        return found

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.mark.slow
async def test_against_the_real_scaler_killed_and_restarted(tmp_path: Path) -> None:
    first = RealScaler(tmp_path / "scaler.db")
    await first.start()
    agent = await asyncio.create_subprocess_exec(
        *_agent_cmd(first.port, "--buffer-reports=1000", "--max-in-flight-reports=10"),
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    second = RealScaler(tmp_path / "scaler.db")
    try:
        accepted_first = 0.0
        deadline = asyncio.get_running_loop().time() + 60
        while accepted_first < 20:
            assert asyncio.get_running_loop().time() < deadline, "scaler got no reports"
            looked_at = time.monotonic()
            before = await first.counters()
            assert before.get("gaps", 0) == 0
            accepted_first = before.get("accepted", 0)
        await first.kill()  # right after the last look: it accepted at least accepted_first
        # Reports the killed scaler may have accepted (and acked) after that look.
        since_look = int((time.monotonic() - looked_at) / 0.05) + 2
        killed_at = time.monotonic()
        await asyncio.sleep(2.0)  # the outage
        second.port = first.port
        await second.start()
        # The agent held every report sampled since the kill (one per 0.05 s at most, plus
        # its 10 in flight): SIGTERM only once the new scaler took that backlog, so the drain
        # that follows has the last few reports to send, not hundreds (on a loaded machine
        # their resend outlasted the drain's grace and the final report went unacked).
        backlog = int((time.monotonic() - killed_at) / 0.05) + 10
        accepted_second = 0.0
        while accepted_second < 20 + backlog:
            assert asyncio.get_running_loop().time() < deadline + 60, "no reports after restart"
            accepted_second = (await second.counters()).get("accepted", 0)
        agent.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(agent.communicate(), 20)
        after = await second.counters()
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        await first.kill()
        await second.kill()
    assert agent.returncode == 0
    log = stderr.decode()
    match = re.search(
        r"final report acked; (\d+) sampled, (\d+) dropped, (\d+) unacked at exit, last seq (\d+)",
        log,
    )
    assert match, log[-2000:]
    sampled, dropped, unacked, last_seq = map(int, match.groups())
    assert unacked == 0 and dropped == 0 and last_seq == sampled
    # The restarted scaler saw a contiguous run first..last_seq, each once...
    assert after.get("gaps", 0) == 0 and after.get("duplicate", 0) == 0
    received_second = after["accepted"] + after.get("dropped", 0)
    first_seq_second = last_seq - received_second + 1
    # ...starting where the agent resumed after the restart (what scaler 1 had not acked)...
    resumed = [int(n) for n in re.findall(r"up; resuming at seq (\d+)", log)]
    assert len(resumed) == 2 and resumed[1] == first_seq_second, (resumed, first_seq_second)
    # ...which is no later than right after what the killed one had accepted: no hole.
    assert first_seq_second <= accepted_first + 1 + since_look, (
        first_seq_second,
        accepted_first,
        since_look,
    )


def test_sigterm_turns_health_off_and_drains_for_the_grace_period() -> None:
    """The agent inherits grace_period_s: on SIGTERM its health says NOT_SERVING at once,
    and an RPC in flight (a probe's Watch) may run for the grace period, no longer."""
    grace_s = 2.0
    svc = start_service(
        [
            *_agent_cmd(free_port())[1:],
            "--listen=127.0.0.1:0",
            f"--grace-period-s={grace_s}",
            # Nothing listens at --scaler: do not wait for the final report's ack.
            "--shutdown-flush-s=0",
        ],
        timeout_s=60,
    )
    try:
        with grpc.insecure_channel(svc.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30
            )
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.monotonic()
            svc.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            not_serving_s = time.monotonic() - t0
            rc = svc.proc.wait(timeout=30)
            elapsed = time.monotonic() - t0
            watch.cancel()
    finally:
        svc.kill()
    assert rc == 0
    assert not_serving_s < 1.0, not_serving_s
    # Held open for the grace period, then cancelled (plus interpreter exit on 2 cores).
    assert grace_s - 0.2 <= elapsed < grace_s + 5.0, elapsed
