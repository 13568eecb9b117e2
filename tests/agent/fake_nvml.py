"""A stand-in for the pynvml module: the same function names, NVML's error
classes and constants, and GPUs whose state a test scripts. No GPU exists on
the test machine, so this is where the NVML source meets "the library".

``call_cost_s`` makes every call burn that much CPU, like a driver ioctl.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
NVMLError_Timeout = pynvml.NVMLError_Timeout
NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
NVML_SUCCESS = pynvml.NVML_SUCCESS
NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
NVML_GPM_METRIC_SM_OCCUPANCY = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
NVML_GPM_METRIC_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
_GPM_FIELDS = {
    NVML_GPM_METRIC_SM_UTIL: 0,
    NVML_GPM_METRIC_SM_OCCUPANCY: 1,
    NVML_GPM_METRIC_ANY_TENSOR_UTIL: 2,
    NVML_GPM_METRIC_DRAM_BW_UTIL: 3,
}


class c_nvmlGpmMetricsGet_t:
    """pynvml's struct, as plain attributes."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: Any = None
        self.sample2: Any = None
        self.metrics = [
            SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(len(_GPM_FIELDS))
        ]


@dataclass
class FakeGpu:
    uuid: str
    util: int = 50
    mem_used: int = 10 * 1024**3
    mem_total: int = 80 * 1024**3
    power_mw: int = 300_000
    temp_c: int = 55
    ecc_uncorrected: int = 0
    ecc_supported: bool = True
    processes: list[tuple[int, int]] = field(default_factory=list)
    #: GPM activity (sm_active, sm_occupancy, tensor_active, dram_active), percent,
    #: as the next GPM interval measures it; None: the GPU has no GPM (pre-Hopper).
    gpm: tuple[float, float, float, float] | None = None
    #: GPM metric ids whose per-metric return is an error (the read itself succeeds).
    gpm_failing: set[int] = field(default_factory=set)
    #: NVML error code raised by every reading call (e.g. NVML_ERROR_GPU_IS_LOST).
    fail_with: int | None = None
    #: Error code raised by just this call name, e.g. {"power": NVML_ERROR_UNKNOWN}.
    fail_calls: dict[str, int] = field(default_factory=dict)


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu], call_cost_s: float = 0.0) -> None:
        self.gpus = gpus
        self.call_cost_s = call_cost_s
        self.init_error: int | None = None
        self.initialized = False
        self.calls = 0
        self.pending_xids: list[tuple[int, int]] = []
        self.registered: set[int] = set()
        self.gpm_samples_allocated = 0
        for name in (
            "NVMLError",
            "NVMLError_NotSupported",
            "NVMLError_GpuIsLost",
            "NVMLError_Timeout",
            "NVML_TEMPERATURE_GPU",
            "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
            "NVML_VOLATILE_ECC",
            "nvmlEventTypeXidCriticalError",
            "NVML_SUCCESS",
            "NVML_GPM_METRICS_GET_VERSION",
            "NVML_GPM_METRIC_SM_UTIL",
            "NVML_GPM_METRIC_SM_OCCUPANCY",
            "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
            "NVML_GPM_METRIC_DRAM_BW_UTIL",
            "c_nvmlGpmMetricsGet_t",
        ):
            setattr(self, name, globals()[name])

    def _call(self, handle: int | None = None, name: str = "") -> FakeGpu | None:
        self.calls += 1
        if self.call_cost_s:
            end = time.perf_counter() + self.call_cost_s
            while time.perf_counter() < end:
                pass
        if not self.initialized:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = self.gpus[handle]
        if gpu.fail_with is not None:
            raise NVMLError(gpu.fail_with)
        if name in gpu.fail_calls:
            raise NVMLError(gpu.fail_calls[name])
        return gpu

    def nvmlInit(self) -> None:
        self.calls += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._call()
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call()
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        self._call()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._call()
        if self.gpus[i].fail_with == pynvml.NVML_ERROR_GPU_IS_LOST and "handle" in (
            self.gpus[i].fail_calls
        ):
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        self._call()
        return self.gpus[h].uuid

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        gpu = self._call(h, "utilization")
        assert gpu is not None
        return SimpleNamespace(gpu=gpu.util, memory=gpu.util // 2)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        gpu = self._call(h, "memory")
        assert gpu is not None
        return SimpleNamespace(
            used=gpu.mem_used, total=gpu.mem_total, free=gpu.mem_total - gpu.mem_used
        )

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        gpu = self._call(h, "power")
        assert gpu is not None
        return gpu.power_mw

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        gpu = self._call(h, "temperature")
        assert gpu is not None and sensor == NVML_TEMPERATURE_GPU
        return gpu.temp_c

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        gpu = self._call(h, "ecc")
        assert gpu is not None
        if not gpu.ecc_supported:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        assert error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and counter == NVML_VOLATILE_ECC
        return gpu.ecc_uncorrected

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        gpu = self._call(h, "processes")
        assert gpu is not None
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in gpu.processes]

    def nvmlGpmQueryDeviceSupport(self, h: int) -> Any:
        gpu = self._call(h, "gpm_support")
        assert gpu is not None
        return SimpleNamespace(version=1, isSupportedDevice=int(gpu.gpm is not None))

    def nvmlGpmSampleAlloc(self) -> Any:
        self._call()
        self.gpm_samples_allocated += 1
        return SimpleNamespace(handle=None, values=None)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._call()
        self.gpm_samples_allocated -= 1

    def nvmlGpmSampleGet(self, h: int, sample: Any) -> Any:
        gpu = self._call(h, "gpm")
        assert gpu is not None
        if gpu.gpm is None:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample.handle = h
        sample.values = gpu.gpm
        return sample

    def nvmlGpmMetricsGet(self, mg: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
        self._call()
        assert mg.version == NVML_GPM_METRICS_GET_VERSION
        a, b = mg.sample1, mg.sample2
        assert a is not b and a.handle == b.handle and b.values is not None
        gpu = self.gpus[b.handle]
        for m in mg.metrics[: mg.numMetrics]:
            if m.metricId in gpu.gpm_failing:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            m.nvmlReturn = NVML_SUCCESS
            m.value = b.values[_GPM_FIELDS[m.metricId]]
        return mg

    def nvmlEventSetCreate(self) -> str:
        self._call()
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        self._call()
        assert types & nvmlEventTypeXidCriticalError
        self.registered.add(h)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self._call()
        if not self.pending_xids:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        h, xid = self.pending_xids.pop(0)
        return SimpleNamespace(device=h, eventData=xid, eventType=nvmlEventTypeXidCriticalError)

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._call()


def eight_gpus(call_cost_s: float = 0.0) -> FakeNvml:
    return FakeNvml(
        [FakeGpu(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000") for i in range(8)],
        call_cost_s=call_cost_s,
    )
