"""Print what NVML reports on this machine, raw and through the agent's NvmlSource.

Needs only ``pip install nvidia-ml-py`` for the raw part:

    python tide/services/agent/nvml_check.py [--samples 3]

Exits 1 with one line when NVML cannot be initialised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def _try(fn: Any, *args: Any) -> Any:
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        return f"<{exc}>"


def raw(samples: int) -> None:
    import pynvml

    print(
        f"driver {_try(pynvml.nvmlSystemGetDriverVersion)}, NVML {_try(pynvml.nvmlSystemGetNVMLVersion)}"
    )
    count = pynvml.nvmlDeviceGetCount()
    print(f"{count} GPUs")
    for n in range(samples):
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = _try(pynvml.nvmlDeviceGetUtilizationRates, h)
            mem = _try(pynvml.nvmlDeviceGetMemoryInfo, h)
            power = _try(pynvml.nvmlDeviceGetPowerUsage, h)
            temp = _try(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
            ecc = _try(
                pynvml.nvmlDeviceGetTotalEccErrors,
                h,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            )
            procs = _try(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
            t0 = time.perf_counter()
            pynvml.nvmlDeviceGetUtilizationRates(h)
            call_us = (time.perf_counter() - t0) * 1e6
            print(
                f"sample {n} gpu {i} {_try(pynvml.nvmlDeviceGetName, h)}"
                f" uuid={_try(pynvml.nvmlDeviceGetUUID, h)}"
                f" util={getattr(util, 'gpu', util)}%"
                f" mem={getattr(mem, 'used', mem)}/{getattr(mem, 'total', mem)}B"
                f" power={power if isinstance(power, str) else power / 1000:.6}W"
                f" temp={temp}C ecc_uncorrected={ecc}"
                f" procs={[getattr(p, 'pid', p) for p in procs] if isinstance(procs, list) else procs}"
                f" utilization_call={call_us:.0f}us"
            )
        time.sleep(1.0)


def through_agent(samples: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    try:
        from tide.services.agent.nvml import NvmlSource
    except ImportError as exc:  # the repository's dependencies are not installed here
        print(f"(agent NvmlSource skipped: {exc})")
        return
    source = NvmlSource()
    count = source.open()
    for n in range(samples):
        t0 = time.perf_counter()
        readings = source.sample()
        took_ms = (time.perf_counter() - t0) * 1e3
        print(f"agent sample {n}: {count} GPUs in {took_ms:.1f} ms")
        for r in readings:
            print(f"  {r}")
        time.sleep(1.0)
    source.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"NVML init failed: {exc}", file=sys.stderr)
        return 1
    try:
        raw(args.samples)
    finally:
        pynvml.nvmlShutdown()
    through_agent(args.samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
