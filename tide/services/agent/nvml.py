"""GPU readings from NVML (pynvml, package nvidia-ml-py).

Every call here blocks in the driver, so ``sample`` runs on the agent's
sampling thread. A GPU whose calls fail is reported with a health flag and
zeros, never skipped: a missing GPU would look like an idle one to the scaler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .errors import SourceError
from .gpm import GpmReader
from .model import GpuProcess, GpuReading, HealthFlag

logger = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Reads utilization, memory, power, temperature, ECC, XID, processes and, on
    GPUs with NVML GPM, SM/tensor/DRAM activity (tide/services/agent/gpm.py).

    ``nvml`` is the pynvml module (a stand-in in tests). ECC counters and the
    process list change slowly and cost a driver call each per GPU, so they are
    read every ``slow_every`` samples and reused in between.
    """

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        slow_every: int = 5,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nv = nvml
        self._slow_every = max(1, slow_every)
        self._handles: list[Any | None] = []
        self._uuids: list[str] = []
        self._events: Any | None = None
        self._tick = 0
        self._ecc_flags: dict[int, HealthFlag] = {}
        self._procs: dict[int, tuple[GpuProcess, ...]] = {}
        self._ecc_supported: dict[int, bool] = {}
        self._last_health: dict[int, HealthFlag] = {}
        self.gpm = GpmReader(nvml, now)

    def open(self) -> int:
        nv = self._nv
        try:
            nv.nvmlInit()
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            raise SourceError(
                f"NVML init failed: {exc}. Is the NVIDIA driver installed and the container"
                " started with the NVIDIA runtime (libnvidia-ml.so.1 visible)?"
            ) from None
        except OSError as exc:  # pragma: no cover - a broken library load
            raise SourceError(f"NVML init failed: {exc}") from None
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            driver = "unknown"
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            logger.warning("NVML: no event set, XID errors will not be reported: %s", exc)
            self._events = None
        for i in range(count):
            handle: Any | None
            uuid = ""
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except nv.NVMLError as exc:
                # Keep the slot: the GPU is reported as lost rather than vanishing.
                logger.error("NVML: GPU %d unusable at start: %s", i, exc)
                handle = None
            self._handles.append(handle)
            self._uuids.append(uuid)
            if handle is not None:
                self.gpm.open(i, handle)
            if handle is not None and self._events is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(
                        handle, nv.nvmlEventTypeXidCriticalError, self._events
                    )
                except nv.NVMLError as exc:
                    logger.info("NVML: GPU %d: XID events not available: %s", i, exc)
        logger.info("NVML: driver %s, %d GPUs, %d with GPM", driver, count, len(self.gpm.supported))
        return count

    def _poll_xids(self) -> dict[int, list[int]]:
        """XID errors since the last sample, by GPU index (non-blocking)."""
        nv = self._nv
        xids: dict[int, list[int]] = {}
        if self._events is None:
            return xids
        for _ in range(64):  # bounded: a storm of XIDs must not stall sampling
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as exc:
                logger.warning("NVML: reading XID events failed: %s", exc)
                break
            try:
                index = self._handles.index(data.device)
            except ValueError:
                continue
            xids.setdefault(index, []).append(int(data.eventData))
        return xids

    def _read_slow(self, i: int, handle: Any) -> None:
        nv = self._nv
        if self._ecc_supported.get(i, True):
            try:
                uncorrected = nv.nvmlDeviceGetTotalEccErrors(
                    handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
                self._ecc_flags[i] = (
                    HealthFlag.ECC_UNCORRECTABLE if uncorrected > 0 else HealthFlag.OK
                )
            except nv.NVMLError_NotSupported:
                self._ecc_supported[i] = False  # ECC off or not on this board: stop asking
            except nv.NVMLError as exc:
                logger.debug("NVML: GPU %d ECC read failed: %s", i, exc)
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            self._procs[i] = tuple(
                GpuProcess(pid=int(p.pid), used_memory_bytes=p.usedGpuMemory) for p in procs
            )
        except nv.NVMLError as exc:
            logger.debug("NVML: GPU %d process list failed: %s", i, exc)

    def _read(self, i: int, xids: list[int]) -> GpuReading:
        nv = self._nv
        handle = self._handles[i]
        uuid = self._uuids[i]
        if handle is None:
            return GpuReading(
                index=i,
                uuid=uuid,
                health=HealthFlag.LOST | HealthFlag.NVML_ERROR,
                error="no handle",
            )
        flags = HealthFlag.XID if xids else HealthFlag.OK
        errors: list[str] = [f"xid {','.join(map(str, xids))}"] if xids else []
        values: dict[str, Any] = {}
        calls = (
            ("utilization", lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)),
            ("memory", lambda: nv.nvmlDeviceGetMemoryInfo(handle)),
            ("power", lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            (
                "temperature",
                lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            ),
        )
        for name, call in calls:
            try:
                values[name] = call()
            except nv.NVMLError_GpuIsLost as exc:
                flags |= HealthFlag.LOST | HealthFlag.NVML_ERROR
                errors.append(f"{name}: {exc}")
                break  # the GPU is gone; the rest would fail the same way
            except nv.NVMLError as exc:
                flags |= HealthFlag.NVML_ERROR
                errors.append(f"{name}: {exc}")
        if not flags & HealthFlag.LOST and self._tick % self._slow_every == 0:
            self._read_slow(i, handle)
        flags |= self._ecc_flags.get(i, HealthFlag.OK)
        gpm = None if flags & HealthFlag.LOST else self.gpm.read(i)
        memory = values.get("memory")
        return GpuReading(
            index=i,
            uuid=uuid,
            utilization_pct=values.get("utilization", 0.0),
            memory_used_bytes=int(memory.used) if memory is not None else 0,
            memory_total_bytes=int(memory.total) if memory is not None else 0,
            power_w=values.get("power", 0.0),
            temperature_c=values.get("temperature", 0.0),
            health=flags,
            processes=self._procs.get(i, ()),
            gpm=gpm,
            error="; ".join(errors),
        )

    def sample(self) -> list[GpuReading]:
        xids = self._poll_xids()
        readings = [self._read(i, xids.get(i, [])) for i in range(len(self._handles))]
        self._tick += 1
        for r in readings:
            # Log transitions only: a lost GPU would otherwise log once a second.
            if r.health != self._last_health.get(r.index, HealthFlag.OK):
                if r.health:
                    logger.warning("NVML: GPU %d (%s) unhealthy: %s", r.index, r.uuid, r.error)
                else:
                    logger.info("NVML: GPU %d (%s) healthy again", r.index, r.uuid)
            self._last_health[r.index] = r.health
        return readings

    def close(self) -> None:
        nv = self._nv
        self.gpm.close()
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            logger.debug("NVML shutdown: %s", exc)
