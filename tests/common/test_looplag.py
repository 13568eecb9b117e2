"""The loop-lag probe's log line: a loop blocked by its own code is a WARNING, a process
that only waited for a CPU is the machine's state (INFO); the gauge counts both."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tide.base.cpuwait import CpuWait
from tide.services.common.looplag import LOG_STALL_S, LoopLag

pytestmark = pytest.mark.unit


def lag() -> LoopLag:
    return LoopLag(gauge=Gauge("lag", "lag", registry=CollectorRegistry()))


def levels(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.levelname for r in caplog.records if r.name == "tide.services.common.looplag"]


def test_a_loop_blocked_by_its_code_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    lag().record(LOG_STALL_S + 0.3, now=100.0, cpu_wait_s=0.1)
    assert levels(caplog) == ["WARNING"]


def test_a_process_waiting_for_a_cpu_is_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    probe = lag()
    probe.record(LOG_STALL_S + 0.3, now=100.0, cpu_wait_s=0.4)
    assert levels(caplog) == ["INFO"]
    assert "waiting for a CPU" in caplog.records[-1].getMessage()
    assert probe.worst_s == LOG_STALL_S + 0.3  # the gauge still sees the whole lag


def test_short_lags_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    lag().record(LOG_STALL_S / 2, now=100.0)
    assert levels(caplog) == []


def test_cpu_wait_counts_the_run_queue_time_of_this_thread() -> None:
    cpu = CpuWait()
    try:
        before = cpu.seconds()
        if before == 0.0:
            pytest.skip("no /proc/thread-self/schedstat here")
        # More busy processes than cores: this thread, busy too, waits for a CPU in turn.
        spin = "import time\nt = time.monotonic() + 1\nwhile time.monotonic() < t: pass"
        burners = [
            subprocess.Popen([sys.executable, "-c", spin])
            for _ in range(2 * len(os.sched_getaffinity(0)))
        ]
        stop = time.monotonic() + 1
        while time.monotonic() < stop:
            pass
        for p in burners:
            p.wait(30)
        assert cpu.seconds() - before > 0.05
    finally:
        cpu.close()
