"""The agent as a process: flags, one-line errors, SIGTERM, and a scaler that is killed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tide.v1 import telemetry_pb2

from .conftest import Scaler, eventually

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _agent_cmd(port: int, *extra: str) -> list[str]:
    return [
        PY,
        "-m",
        "services.agent",
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
        [PY, "-m", "services.agent", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for flag in ("--scaler", "--node-name", "--source", "--interval-s", "--buffer-reports"):
        assert flag in out.stdout
    assert "--pod-resources-socket" in out.stdout and "--metrics-listen" in out.stdout


def test_bad_setting_is_one_line_naming_it() -> None:
    out = subprocess.run(
        [PY, "-m", "services.agent", "--interval-s=-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["tide-agent: interval_s: must be > 0, got -1.0"]


def test_nvml_init_failure_is_one_clear_error_line() -> None:
    """This machine has no NVIDIA driver: the real pynvml fails to load NVML."""
    out = subprocess.run(
        [PY, "-m", "services.agent", "--source=nvml", "--no-watch-node", "--pod-resources-socket="],
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


async def test_sigterm_sends_a_final_report_and_exits(scaler: Scaler) -> None:
    proc = await asyncio.create_subprocess_exec(
        *_agent_cmd(scaler.port), cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    try:
        await eventually(lambda: len(scaler.recorder.received) >= 5, timeout_s=30, what="reports")
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
