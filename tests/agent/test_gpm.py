"""NVML GPM (SM, tensor, DRAM activity) through the NVML source and into the report,
against the stand-in of pynvml: absent is absent, never zero."""

from __future__ import annotations

import math

import pynvml
import pytest

from tide.services.agent.gpm import GPM_MIN_PERIOD_S
from tide.services.agent.model import GpmActivity, PodOwner, Sample
from tide.services.agent.nvml import NvmlSource
from tide.services.agent.report import build_report

from .fake_nvml import FakeGpu, FakeNvml

pytestmark = pytest.mark.component


class Tick:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _source(*gpus: FakeGpu) -> tuple[FakeNvml, NvmlSource, Tick]:
    nv = FakeNvml(list(gpus))
    tick = Tick()
    src = NvmlSource(nv, now=tick)
    src.open()
    return nv, src, tick


def test_gpm_needs_two_samples_and_reads_every_metric() -> None:
    nv, src, tick = _source(FakeGpu("GPU-h", gpm=(35.0, 20.0, 12.5, 40.0)), FakeGpu("GPU-a"))
    assert src.gpm.supported == [0]
    first = src.sample()
    # One GPM sample is no interval: not measured, not zero.
    assert first[0].gpm is None and first[1].gpm is None
    tick.t += 1.0
    second = src.sample()
    assert second[0].gpm == GpmActivity(35.0, 20.0, 12.5, 40.0)
    assert second[1].gpm is None  # no GPM on this GPU (pre-Hopper)
    src.close()
    assert nv.gpm_samples_allocated == 0


def test_sampled_faster_than_gpm_allows_repeats_the_last_interval() -> None:
    nv, src, tick = _source(FakeGpu("GPU-h", gpm=(50.0, 30.0, 20.0, 10.0)))
    src.sample()
    tick.t += 1.0
    assert src.sample()[0].gpm == GpmActivity(50.0, 30.0, 20.0, 10.0)
    nv.gpus[0].gpm = (90.0, 60.0, 70.0, 80.0)
    calls = nv.calls
    tick.t += GPM_MIN_PERIOD_S / 2
    # Within NVML's minimum period: no GPM call, the last figures again.
    again = src.sample()[0].gpm
    assert again == GpmActivity(50.0, 30.0, 20.0, 10.0)
    # The XID poll, utilization, memory, power and temperature only.
    assert nv.calls - calls == 5
    tick.t += GPM_MIN_PERIOD_S
    assert src.sample()[0].gpm == GpmActivity(90.0, 60.0, 70.0, 80.0)


def test_a_failing_metric_or_sample_is_absent_not_zero() -> None:
    nv, src, tick = _source(FakeGpu("GPU-h", gpm=(50.0, 30.0, 20.0, 10.0)))
    src.sample()
    tick.t += 1.0
    nv.gpus[0].gpm_failing = {pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL}
    assert src.sample()[0].gpm is None
    nv.gpus[0].gpm_failing = set()
    nv.gpus[0].fail_calls["gpm"] = pynvml.NVML_ERROR_UNKNOWN
    tick.t += 1.0
    r = src.sample()[0]
    assert r.gpm is None and r.utilization_pct == 50.0
    # After a failed sample the next interval starts over: one sample, then figures.
    del nv.gpus[0].fail_calls["gpm"]
    tick.t += 1.0
    assert src.sample()[0].gpm is None
    tick.t += 1.0
    assert src.sample()[0].gpm == GpmActivity(50.0, 30.0, 20.0, 10.0)


def test_a_pynvml_without_gpm_reports_none() -> None:
    nv = FakeNvml([FakeGpu("GPU-a")])
    nv.gpus[0].fail_calls["gpm_support"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    src = NvmlSource(nv)
    src.open()
    assert src.gpm.supported == []
    assert src.sample()[0].gpm is None


def test_the_report_carries_gpm_only_when_measured() -> None:
    _nv, src, tick = _source(FakeGpu("GPU-h", gpm=(100.4, 30.0, 20.0, -0.1)), FakeGpu("GPU-a"))
    src.sample()
    tick.t += 1.0
    report = build_report(
        Sample(sampled_at=1000.0, gpus=src.sample(), gpu_capacity=2),
        "node-a",
        "boot",
        {"GPU-h": PodOwner("ns", "job-0")},
    )
    with_gpm, without = report.gpus
    fields = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_active_pct")
    assert all(with_gpm.HasField(f) for f in fields)
    # Not measured: not sent, and read as NaN (never 0) by the scaler.
    assert not any(without.HasField(f) for f in fields)
    assert all(math.isnan(getattr(without, f)) for f in fields)
    # Clamped into 0..100, so one rounding cannot make the scaler reject the report; a
    # measured 0.0 is sent (explicit presence), not taken for "not measured".
    assert with_gpm.sm_active_pct == 100.0 and with_gpm.dram_active_pct == 0.0
    assert with_gpm.tensor_active_pct == 20.0 and with_gpm.sm_occupancy_pct == 30.0
    wire = type(with_gpm).FromString(with_gpm.SerializeToString())
    assert wire.HasField("dram_active_pct") and wire.dram_active_pct == 0.0
