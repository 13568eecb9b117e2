"""The NVML source against a stand-in of pynvml (no GPU on this machine)."""

from __future__ import annotations

import logging

import pynvml
import pytest

from tide.services.agent.errors import SourceError
from tide.services.agent.model import HealthFlag
from tide.services.agent.nvml import NvmlSource

from .fake_nvml import FakeGpu, FakeNvml, eight_gpus

pytestmark = pytest.mark.component


def test_reads_every_gpu() -> None:
    nv = eight_gpus()
    nv.gpus[3].util = 97
    nv.gpus[3].processes = [(4242, 5 * 1024**3)]
    source = NvmlSource(nv)
    assert source.open() == 8
    readings = source.sample()
    assert [r.index for r in readings] == list(range(8))
    r = readings[3]
    assert r.uuid == nv.gpus[3].uuid
    assert r.utilization_pct == 97.0
    assert r.memory_used_bytes == 10 * 1024**3 and r.memory_total_bytes == 80 * 1024**3
    assert r.power_w == 300.0
    assert r.temperature_c == 55.0
    assert r.health == HealthFlag.OK
    assert [(p.pid, p.used_memory_bytes) for p in r.processes] == [(4242, 5 * 1024**3)]
    source.close()
    assert not nv.initialized


def test_a_lost_gpu_is_reported_unhealthy_not_dropped(caplog: pytest.LogCaptureFixture) -> None:
    nv = eight_gpus()
    source = NvmlSource(nv)
    source.open()
    nv.gpus[5].fail_with = pynvml.NVML_ERROR_GPU_IS_LOST
    with caplog.at_level(logging.WARNING):
        first = source.sample()
        second = source.sample()
    for readings in (first, second):
        assert len(readings) == 8
        lost = readings[5]
        assert lost.uuid == nv.gpus[5].uuid
        assert lost.health & HealthFlag.LOST and lost.health & HealthFlag.NVML_ERROR
        assert lost.utilization_pct == 0.0
        assert all(r.health == HealthFlag.OK for i, r in enumerate(readings) if i != 5)
    # Logged once when it went bad, not once per sample.
    assert len([m for m in caplog.messages if "GPU 5" in m]) == 1


def test_one_failing_call_flags_nvml_error_and_keeps_the_other_readings() -> None:
    nv = eight_gpus()
    nv.gpus[1].fail_calls["power"] = pynvml.NVML_ERROR_UNKNOWN
    source = NvmlSource(nv)
    source.open()
    r = source.sample()[1]
    assert r.health == HealthFlag.NVML_ERROR
    assert r.power_w == 0.0
    assert r.utilization_pct == 50.0 and r.temperature_c == 55.0
    assert "power" in r.error


def test_ecc_and_xid_set_health_flags() -> None:
    nv = eight_gpus()
    nv.gpus[2].ecc_uncorrected = 3
    nv.gpus[4].ecc_supported = False
    source = NvmlSource(nv, slow_every=1)
    source.open()
    assert nv.registered == set(range(8))
    nv.pending_xids = [(6, 79)]
    readings = source.sample()
    assert readings[2].health == HealthFlag.ECC_UNCORRECTABLE
    assert readings[4].health == HealthFlag.OK  # ECC not supported is not an error
    assert readings[6].health == HealthFlag.XID and "79" in readings[6].error
    # An XID is reported once, with the sample that follows it.
    assert source.sample()[6].health == HealthFlag.OK


def test_gpu_unusable_at_start_keeps_its_slot() -> None:
    nv = FakeNvml(
        [
            FakeGpu("GPU-a"),
            FakeGpu("GPU-b", fail_with=pynvml.NVML_ERROR_GPU_IS_LOST, fail_calls={"handle": 0}),
        ]
    )
    source = NvmlSource(nv)
    assert source.open() == 2
    readings = source.sample()
    assert len(readings) == 2
    assert readings[1].health & HealthFlag.LOST


def test_init_failure_is_one_clear_error() -> None:
    nv = eight_gpus()
    nv.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(SourceError) as info:
        NvmlSource(nv).open()
    message = str(info.value)
    assert message.startswith("NVML init failed: NVML Shared Library Not Found")
    assert "\n" not in message


def test_slow_readings_are_cached_between_refreshes() -> None:
    nv = eight_gpus()
    source = NvmlSource(nv, slow_every=5)
    source.open()
    nv.calls = 0
    source.sample()  # tick 0: fast + slow
    with_slow = nv.calls
    nv.calls = 0
    source.sample()  # tick 1: fast only
    assert nv.calls == with_slow - 8 * 2
