"""SM, tensor and DRAM activity from NVML GPM (GPU Performance Monitoring).

NVML's "utilization" says only that some kernel ran during its sample period: a
GPU running one tiny kernel at a time reads 100 %. GPM (Hopper and later) counts
what the streaming multiprocessors and pipes actually did between two samples.
Every call blocks in the driver, so this runs on the agent's sampling thread,
inside ``NvmlSource.sample``.

A GPU without GPM, or one whose GPM read failed, gets None: the scaler takes
that as "not measured" (NO_SIGNAL for a job scaling on it), never as zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .model import GpmActivity

logger = logging.getLogger(__name__)

#: NVML's GPM reference (nvmlGpmMetricsGet): the two samples of a metric must be
#: more than 100 ms apart, the driver's internal refresh. Sampled faster, the
#: agent reports the last complete interval's figures again.
GPM_MIN_PERIOD_S = 0.1

#: GpmActivity's fields, in order, and the NVML metric of each.
METRICS = (
    "NVML_GPM_METRIC_SM_UTIL",
    "NVML_GPM_METRIC_SM_OCCUPANCY",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "NVML_GPM_METRIC_DRAM_BW_UTIL",
)


@dataclass
class _Gpu:
    handle: Any
    #: Two sample buffers: [0] the previous sample, [1] the one read next.
    samples: list[Any] = field(default_factory=list)
    taken_s: float | None = None
    last: GpmActivity | None = None


class GpmReader:
    """GPM activity per GPU index, between this sample and the previous one."""

    def __init__(self, nvml: Any, now: Callable[[], float] = time.monotonic) -> None:
        self._nv = nvml
        self._now = now
        self._gpus: dict[int, _Gpu] = {}

    def open(self, index: int, handle: Any) -> bool:
        """Whether GPU ``index`` measures GPM; allocates its sample buffers if so."""
        nv = self._nv
        try:
            support = nv.nvmlGpmQueryDeviceSupport(handle)
            if not support.isSupportedDevice:
                logger.info("NVML: GPU %d has no GPM: SM/tensor activity not reported", index)
                return False
            samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        except (nv.NVMLError, AttributeError) as exc:
            # AttributeError: a pynvml older than GPM; NVMLError: a driver older than it.
            logger.info("NVML: GPU %d: GPM not available (%s): activity not reported", index, exc)
            return False
        self._gpus[index] = _Gpu(handle, samples)
        return True

    @property
    def supported(self) -> list[int]:
        return sorted(self._gpus)

    def read(self, index: int) -> GpmActivity | None:
        """The activity since the previous call for GPU ``index``; None on the first
        call, without GPM, or when the read failed (the next interval starts over)."""
        g = self._gpus.get(index)
        if g is None:
            return None
        nv = self._nv
        now = self._now()
        if g.taken_s is not None and now - g.taken_s <= GPM_MIN_PERIOD_S:
            return g.last
        try:
            nv.nvmlGpmSampleGet(g.handle, g.samples[1])
        except nv.NVMLError as exc:
            logger.debug("NVML: GPU %d GPM sample failed: %s", index, exc)
            g.taken_s = g.last = None
            return None
        taken, g.taken_s = g.taken_s, now
        older, newer = g.samples
        # The newest sample is the next interval's first.
        g.samples = [newer, older]
        if taken is None:
            return None
        g.last = self._metrics(index, older, newer)
        return g.last

    def _metrics(self, index: int, older: Any, newer: Any) -> GpmActivity | None:
        nv = self._nv
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(METRICS)
        mg.sample1 = older
        mg.sample2 = newer
        for k, name in enumerate(METRICS):
            mg.metrics[k].metricId = getattr(nv, name)
        try:
            nv.nvmlGpmMetricsGet(mg)
        except nv.NVMLError as exc:
            logger.debug("NVML: GPU %d GPM metrics failed: %s", index, exc)
            return None
        values = []
        for k, name in enumerate(METRICS):
            m = mg.metrics[k]
            if m.nvmlReturn != nv.NVML_SUCCESS:
                # All four or none (tide.v1.GpuSample): one unreadable metric is
                # an unmeasured interval, not a zero.
                logger.debug("NVML: GPU %d %s: error %d", index, name, m.nvmlReturn)
                return None
            values.append(float(m.value))
        return GpmActivity(*values)

    def close(self) -> None:
        nv = self._nv
        for g in self._gpus.values():
            for s in g.samples:
                try:
                    nv.nvmlGpmSampleFree(s)
                except nv.NVMLError as exc:
                    logger.debug("NVML: GPM sample free: %s", exc)
        self._gpus.clear()
