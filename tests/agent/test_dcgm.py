"""The dcgm-exporter source against a real HTTP server serving the exporter's text
exposition: every GPU, its profiling fields as percent, and a field the endpoint does
not publish absent, never zero."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tide.base.errors import ConfigError
from tide.services.agent.__main__ import make_source
from tide.services.agent.dcgm import DcgmExporterSource
from tide.services.agent.errors import SourceError
from tide.services.agent.model import GpmActivity, HealthFlag, PodOwner, Sample
from tide.services.agent.report import build_report
from tide.services.agent.settings import AgentSettings

pytestmark = pytest.mark.component

H100 = "GPU-5fd4e3e1-9c5b-2a0b-7d0a-1b2c3d4e5f60"
A10 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"


def _labels(gpu: int, uuid: str, model: str, extra: str = "") -> str:
    return (
        f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="00000000:{18 + gpu:02X}:00.0",'
        f'device="nvidia{gpu}",modelName="{model}",Hostname="gpu-node-7",'
        f'DCGM_FI_DRIVER_VERSION="550.54.15"{extra}'
    )


H = _labels(0, H100, "NVIDIA H100 80GB HBM3", ',container="trainer",namespace="ml",pod="j-0"')
A = _labels(1, A10, "NVIDIA A10")
MIG = _labels(0, H100, "NVIDIA H100 80GB HBM3", ',GPU_I_PROFILE="1g.10gb",GPU_I_ID="7"')

# What dcgm-exporter 3.3 serves with its dcp-metrics-included counters: the H100 has the
# profiling fields, the A10 (profiling off on it) only the device fields.
FULL = f"""# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{{{H}}} 1980
DCGM_FI_DEV_SM_CLOCK{{{A}}} 1695
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{{{H}}} 61
DCGM_FI_DEV_GPU_TEMP{{{A}}} 44
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{{{H}}} 612.337000
DCGM_FI_DEV_POWER_USAGE{{{A}}} 58.120000
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{{{H}}} 100
DCGM_FI_DEV_GPU_UTIL{{{A}}} 12
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{H}}} 1024
DCGM_FI_DEV_FB_FREE{{{A}}} 20480
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{H}}} 80000
DCGM_FI_DEV_FB_USED{{{A}}} 2048
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{{{H},err_code="0",err_msg="No Error"}} 0
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{H}}} 0.991234
# HELP DCGM_FI_PROF_SM_ACTIVE The ratio of cycles an SM has at least 1 warp assigned.
# TYPE DCGM_FI_PROF_SM_ACTIVE gauge
DCGM_FI_PROF_SM_ACTIVE{{{H}}} 0.312500
DCGM_FI_PROF_SM_ACTIVE{{{MIG}}} 0.950000
# HELP DCGM_FI_PROF_SM_OCCUPANCY The ratio of number of warps resident on an SM.
# TYPE DCGM_FI_PROF_SM_OCCUPANCY gauge
DCGM_FI_PROF_SM_OCCUPANCY{{{H}}} 0.187500
# HELP DCGM_FI_PROF_PIPE_TENSOR_ACTIVE Ratio of cycles the tensor (HMMA) pipe is active.
# TYPE DCGM_FI_PROF_PIPE_TENSOR_ACTIVE gauge
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{H}}} 0.000000
# HELP DCGM_FI_PROF_DRAM_ACTIVE Ratio of cycles the device memory interface is active sending or receiving data.
# TYPE DCGM_FI_PROF_DRAM_ACTIVE gauge
DCGM_FI_PROF_DRAM_ACTIVE{{{H}}} 0.437500
"""


def _without(text: str, *metrics: str) -> str:
    return (
        "\n".join(line for line in text.splitlines() if not any(m in line for m in metrics)) + "\n"
    )


class Exporter:
    """A real HTTP server on port 0 serving ``body`` at /metrics (500: ``status``)."""

    def __init__(self) -> None:
        self.body = FULL
        self.status = 200
        self.scrapes = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.scrapes += 1
                data = outer.body.encode()
                self.send_response(outer.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    try:
        yield e
    finally:
        e.close()


def test_every_gpu_with_its_profiling_fields_as_percent(exporter: Exporter) -> None:
    src = DcgmExporterSource(exporter.url)
    assert src.open() == 2
    h, a = src.sample()
    assert (h.index, h.uuid, a.index, a.uuid) == (0, H100, 1, A10)
    assert h.utilization_pct == 100.0 and a.utilization_pct == 12.0
    assert h.memory_used_bytes == 80000 * 2**20 and h.memory_total_bytes == 81024 * 2**20
    assert h.power_w == pytest.approx(612.337) and h.temperature_c == 61.0
    assert h.health == HealthFlag.OK and a.health == HealthFlag.OK
    # Ratios 0..1 as percent; the MIG instance's 0.95 is not the GPU's; a measured 0.0
    # tensor activity is a measurement.
    assert h.gpm == GpmActivity(31.25, 18.75, 0.0, 43.75)
    assert a.gpm is None  # no profiling fields for the A10: not measured
    report = build_report(
        Sample(sampled_at=1000.0, gpus=[h, a], gpu_capacity=2),
        "gpu-node-7",
        "boot",
        {H100: PodOwner("ml", "j-0")},
    )
    rh, ra = report.gpus
    assert rh.HasField("tensor_active_pct") and rh.tensor_active_pct == 0.0
    assert rh.sm_active_pct == 31.25 and rh.dram_active_pct == 43.75
    assert not ra.HasField("sm_active_pct") and math.isnan(ra.sm_active_pct)
    assert exporter.scrapes == 2  # one at open, one per sample


def test_a_field_the_endpoint_does_not_publish_is_absent_not_zero(exporter: Exporter) -> None:
    # The exporter's default counters leave SM occupancy and DRAM activity out here.
    exporter.body = _without(FULL, "DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_DRAM_ACTIVE")
    src = DcgmExporterSource(exporter.url)
    src.open()
    h, _ = src.sample()
    assert h.gpm == GpmActivity(31.25, None, 0.0, None)
    g = build_report(Sample(1000.0, [h], 2), "gpu-node-7", "boot", {}).gpus[0]
    assert g.HasField("sm_active_pct") and g.HasField("tensor_active_pct")
    assert not g.HasField("sm_occupancy_pct") and not g.HasField("dram_active_pct")
    assert math.isnan(g.sm_occupancy_pct) and math.isnan(g.dram_active_pct)


def test_a_gpu_the_endpoint_stops_listing_is_flagged_never_dropped(exporter: Exporter) -> None:
    src = DcgmExporterSource(exporter.url)
    src.open()
    exporter.body = "\n".join(line for line in FULL.splitlines() if A10 not in line) + "\n"
    h, a = src.sample()
    assert h.health == HealthFlag.OK
    assert (a.index, a.uuid) == (1, A10)
    assert a.health == HealthFlag.NVML_ERROR and "DCGM_FI_DEV_GPU_UTIL" in a.error
    assert a.gpm is None


def test_an_endpoint_that_cannot_be_read_fails_loudly(exporter: Exporter) -> None:
    src = DcgmExporterSource(exporter.url)
    src.open()
    exporter.status = 500
    with pytest.raises(SourceError, match=r"dcgm-exporter at http://127\.0\.0\.1:\d+/metrics"):
        src.sample()
    exporter.status = 200
    exporter.body = _without(FULL, "DCGM_FI_DEV_GPU_UTIL")
    with pytest.raises(SourceError, match="no DCGM_FI_DEV_GPU_UTIL for any GPU"):
        DcgmExporterSource(exporter.url).open()
    exporter.body = "<html>not the exporter</html>\n"
    with pytest.raises(SourceError, match="not Prometheus text format"):
        DcgmExporterSource(exporter.url).open()
    gone = exporter.url
    exporter.close()
    with pytest.raises(SourceError, match="dcgm-exporter at"):
        DcgmExporterSource(gone, timeout_s=2.0).open()


def test_the_setting_chooses_the_source_and_a_bad_url_names_it(exporter: Exporter) -> None:
    s = AgentSettings(source="dcgm", dcgm_exporter_url=exporter.url, insecure=True)
    src = make_source(s)
    assert isinstance(src, DcgmExporterSource)
    assert src.open() == 2
    with pytest.raises(ConfigError, match="dcgm_exporter_url"):
        AgentSettings(source="dcgm", dcgm_exporter_url="127.0.0.1:9400/metrics", insecure=True)
