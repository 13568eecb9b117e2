"""GPU readings from a node's dcgm-exporter endpoint instead of NVML.

Many clusters already run NVIDIA's dcgm-exporter as a DaemonSet: it holds the
GPUs' DCGM profiling session, and a second reader through NVML GPM would only
duplicate it. This source reads the exporter's Prometheus text exposition
(``GET /metrics``, parsed with prometheus_client's text parser) once per sample,
on the agent's sampling thread like NVML's blocking calls.

Per GPU (the ``gpu`` label is its index, ``UUID`` its UUID):

- ``DCGM_FI_DEV_GPU_UTIL`` (percent) is the utilization; a GPU the endpoint lists
  without it is flagged NVML_ERROR with zeros, as NVML's failed reads are;
- ``DCGM_FI_PROF_SM_ACTIVE``, ``DCGM_FI_PROF_SM_OCCUPANCY``,
  ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE`` and ``DCGM_FI_PROF_DRAM_ACTIVE`` (ratios
  0..1, sent as percent) are the GPM activity. Each one the endpoint does not
  publish (the exporter's counters file leaves the profiling fields out by
  default, and a GPU without profiling support never has them) is absent, never
  zero;
- ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB), ``DCGM_FI_DEV_POWER_USAGE``
  (W) and ``DCGM_FI_DEV_GPU_TEMP`` (°C) when published, else 0 as before.
"""

from __future__ import annotations

import logging
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .errors import SourceError
from .model import GpmActivity, GpuReading, HealthFlag

logger = logging.getLogger(__name__)

MIB = 1024**2

UTIL = "DCGM_FI_DEV_GPU_UTIL"
#: GpmActivity's fields, in order, and the DCGM profiling field of each (ratios 0..1).
PROF_FIELDS = (
    ("sm_active_pct", "DCGM_FI_PROF_SM_ACTIVE"),
    ("sm_occupancy_pct", "DCGM_FI_PROF_SM_OCCUPANCY"),
    ("tensor_active_pct", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"),
    ("dram_active_pct", "DCGM_FI_PROF_DRAM_ACTIVE"),
)
_PROF = {metric: name for name, metric in PROF_FIELDS}
_DEV = {
    UTIL: "util",
    "DCGM_FI_DEV_FB_USED": "fb_used",
    "DCGM_FI_DEV_FB_FREE": "fb_free",
    "DCGM_FI_DEV_POWER_USAGE": "power",
    "DCGM_FI_DEV_GPU_TEMP": "temp",
}


@dataclass
class _Gpu:
    uuid: str = ""
    dev: dict[str, float] = field(default_factory=dict)
    prof: dict[str, float] = field(default_factory=dict)


def parse_exposition(text: str) -> dict[int, _Gpu]:
    """The GPUs of one scrape by index. Series without a numeric ``gpu`` label, those
    of MIG instances and non-finite values are skipped. Raises ValueError on text
    that is not the exposition format."""
    gpus: dict[int, _Gpu] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            dev = _DEV.get(s.name)
            prof = _PROF.get(s.name)
            if dev is None and prof is None:
                continue
            labels = s.labels
            # A MIG instance's series carry GPU_I_ID: its activity is not the GPU's.
            if labels.get("GPU_I_ID"):
                continue
            try:
                index = int(labels.get("gpu", ""))
            except ValueError:
                continue
            value = float(s.value)
            if not math.isfinite(value):
                continue
            g = gpus.get(index)
            if g is None:
                g = gpus[index] = _Gpu()
            g.uuid = g.uuid or labels.get("UUID", "")
            if dev is not None:
                g.dev[dev] = value
            elif prof is not None:
                g.prof[prof] = value
    return gpus


def _fetch(url: str, timeout_s: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body: bytes = resp.read()
    except (urllib.error.URLError, OSError) as exc:
        raise SourceError(f"dcgm-exporter at {url}: {exc}") from None
    return body.decode("utf-8", "replace")


class DcgmExporterSource:
    """Reads utilization, memory, power, temperature and SM/tensor/DRAM activity from a
    dcgm-exporter endpoint (module docstring)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise SourceError(f"dcgm_exporter_url: http:// or https:// expected, got {url!r}")
        self._url = url
        self._timeout_s = timeout_s
        self._count = 0
        self._uuids: list[str] = []

    def _scrape(self) -> dict[int, _Gpu]:
        text = _fetch(self._url, self._timeout_s)
        try:
            return parse_exposition(text)
        except ValueError as exc:
            raise SourceError(
                f"dcgm-exporter at {self._url}: not Prometheus text format: {exc}"
            ) from None

    def open(self) -> int:
        gpus = self._scrape()
        with_util = [i for i, g in gpus.items() if "util" in g.dev]
        if not with_util:
            raise SourceError(
                f"dcgm-exporter at {self._url} publishes no {UTIL} for any GPU: is it the"
                " exporter's /metrics, with the default counters (or a counters file that"
                f" keeps {UTIL})?"
            )
        self._count = max(gpus) + 1
        self._uuids = [gpus[i].uuid if i in gpus else "" for i in range(self._count)]
        prof = sorted({name for g in gpus.values() for name in g.prof})
        logger.info(
            "dcgm-exporter at %s: %d GPUs; profiling fields: %s",
            self._url,
            self._count,
            ", ".join(prof) or "none (SM/tensor activity not reported)",
        )
        return self._count

    def _reading(self, index: int, g: _Gpu | None) -> GpuReading:
        uuid = (g.uuid if g is not None else "") or self._uuids[index]
        if g is None or "util" not in g.dev:
            # Listed at open, not now (or without utilization): not trustworthy, and
            # never left out (a missing GPU would look like an idle one).
            return GpuReading(
                index=index,
                uuid=uuid,
                health=HealthFlag.NVML_ERROR,
                error=f"dcgm-exporter: no {UTIL} for GPU {index}",
            )
        dev = g.dev
        used = int(dev.get("fb_used", 0.0) * MIB)
        total = used + int(dev.get("fb_free", 0.0) * MIB)
        prof = g.prof
        gpm = None
        if prof:
            # Each field the endpoint lacks stays None: absent, not zero.
            values = [prof.get(name) for name, _ in PROF_FIELDS]
            gpm = GpmActivity(*(None if v is None else 100.0 * v for v in values))
        return GpuReading(
            index=index,
            uuid=uuid,
            utilization_pct=dev["util"],
            memory_used_bytes=used,
            memory_total_bytes=total,
            power_w=dev.get("power", 0.0),
            temperature_c=dev.get("temp", 0.0),
            gpm=gpm,
        )

    def sample(self) -> list[GpuReading]:
        gpus = self._scrape()
        return [self._reading(i, gpus.get(i)) for i in range(self._count)]

    def close(self) -> None:
        pass
