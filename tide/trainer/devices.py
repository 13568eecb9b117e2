"""Which devices a pod has, which collective backend its workers use, and where each sits.

The launcher (one per pod) runs one worker per GPU of its pod, or one worker on a CPU pod.
Ranks are laid out pod by pod: worker ``local`` of the pod at pod rank ``p`` has global
rank ``p * workers_per_pod + local``, so a pod's workers are neighbours (NCCL's rings and
trees then keep most traffic inside the pod), and the world size is
``pods * workers_per_pod``. Every worker sees exactly one GPU: ``CUDA_VISIBLE_DEVICES`` is
its own GPU and ``FLAGS_selected_gpus`` is 0, which is how Paddle's own launcher pins a
process to a device (it makes the process's device 0 the pod's GPU ``local``).

The launcher never imports Paddle (it speaks gRPC; see tide/trainer/zygote.py), so the GPUs are
counted from ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA container
runtime's and the device plugin's way of saying what the pod got), then NVML, then the
``/dev/nvidiaN`` device files.
"""

from __future__ import annotations

import contextlib
import enum
import glob
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tide.base.errors import ConfigError

logger = logging.getLogger(__name__)

BACKEND_ENV = "PADDLE_DISTRI_BACKEND"
LOCAL_RANK_ENV = "PADDLE_RANK_IN_NODE"
LOCAL_SIZE_ENV = "PADDLE_LOCAL_SIZE"
POD_RANK_ENV = "TIDE_POD_RANK"
PODS_ENV = "TIDE_PODS"
DEVICE_ENV = "TIDE_DEVICE"  # "gpu:<id as the pod sees it>" or "cpu"

_DEV_NODE = re.compile(r"/dev/nvidia(\d+)$")


class Backend(enum.Enum):
    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"

    @classmethod
    def parse(cls, value: str) -> Backend:
        try:
            return cls(value.lower())
        except ValueError:
            names = ", ".join(b.value for b in cls)
            raise ConfigError(f"backend must be one of {names}, got {value!r}") from None


def _listed(value: str) -> list[str] | None:
    """GPU ids from a CUDA_/NVIDIA_VISIBLE_DEVICES value; None when it says "all"."""
    value = value.strip()
    if value in ("all", ""):
        return None if value == "all" else []
    if value in ("none", "void"):
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


@contextlib.contextmanager
def _nvml() -> Iterator[Any]:
    """pynvml, initialised for the block; None where there is no NVML."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _nvml_count() -> int | None:
    with _nvml() as nvml:
        return None if nvml is None else int(nvml.nvmlDeviceGetCount())


def gpu_free_mib(gpus: Sequence[str]) -> dict[str, int] | None:
    """Free memory of each GPU (an index or a UUID, as CUDA_VISIBLE_DEVICES names it), MiB;
    None when NVML cannot say."""
    with _nvml() as nvml:
        if nvml is None:
            return None
        try:
            out: dict[str, int] = {}
            for gpu in gpus:
                handle = (
                    nvml.nvmlDeviceGetHandleByIndex(int(gpu))
                    if gpu.isdigit()
                    else nvml.nvmlDeviceGetHandleByUUID(gpu)
                )
                out[gpu] = int(nvml.nvmlDeviceGetMemoryInfo(handle).free) // (1 << 20)
            return out
        except nvml.NVMLError:
            return None


def memory_shortfall(free_mib: Mapping[str, int], min_free_mib: int) -> str:
    """Why a second worker per GPU does not fit (overlap mode's prepared standby next to
    the worker that trains), or "": each GPU needs ``min_free_mib`` free."""
    short = [f"GPU {g} has {m} MiB free" for g, m in sorted(free_mib.items()) if m < min_free_mib]
    if not short:
        return ""
    return f"{', '.join(short)}; a prepared worker needs {min_free_mib} MiB (prepare_min_free_mib)"


def _device_nodes() -> int:
    return sum(1 for path in glob.glob("/dev/nvidia*") if _DEV_NODE.search(path))


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The ids of the GPUs this pod may use, as CUDA_VISIBLE_DEVICES would name them."""
    e = os.environ if env is None else env
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        if name in e:
            listed = _listed(e[name])
            if listed is not None:
                return listed
            break  # "all": count them
    count = _nvml_count()
    if count is None:
        count = _device_nodes()
    return [str(i) for i in range(count)]


def choose_backend(requested: Backend, gpus: int) -> Backend:
    """NCCL when the pod has GPUs, gloo on CPU; an explicit choice wins, but NCCL without a
    GPU cannot work and is refused here rather than inside Paddle's group init."""
    if requested is Backend.AUTO:
        return Backend.NCCL if gpus else Backend.GLOO
    if requested is Backend.NCCL and not gpus:
        raise ConfigError("backend nccl needs a GPU, but this pod has none")
    return requested


@dataclass(frozen=True)
class PodDevices:
    """What a launcher runs: its backend and one entry per worker (a GPU id, or None)."""

    backend: Backend
    gpus: tuple[str, ...]
    workers: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers per pod must be >= 1, got {self.workers}")
        if self.backend is Backend.NCCL and self.workers > len(self.gpus):
            raise ConfigError(
                f"workers per pod must be <= the pod's {len(self.gpus)} GPUs under nccl, "
                f"got {self.workers}"
            )

    def gpu_of(self, local: int) -> str | None:
        """The GPU worker ``local`` is pinned to; None on gloo (CPU workers)."""
        if self.backend is Backend.GLOO:
            return None
        return self.gpus[local]


def detect(
    requested: Backend = Backend.AUTO,
    workers: int = 0,
    env: Mapping[str, str] | None = None,
) -> PodDevices:
    """The pod's devices. ``workers`` 0: one per GPU under NCCL, one on CPU."""
    gpus = visible_gpus(env)
    backend = choose_backend(requested, len(gpus))
    if workers == 0:
        workers = len(gpus) if backend is Backend.NCCL else 1
    devices = PodDevices(backend=backend, gpus=tuple(gpus), workers=workers)
    logger.info(
        "pod devices: backend %s, %d GPU(s) %s, %d worker(s)",
        backend.value,
        len(gpus),
        ",".join(gpus) or "-",
        workers,
    )
    return devices


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker sits in a generation laid out pod by pod."""

    pod_rank: int
    pods: int
    local_rank: int
    workers_per_pod: int

    def __post_init__(self) -> None:
        if not 0 <= self.pod_rank < self.pods:
            raise ConfigError(f"pod_rank must be in [0, {self.pods}), got {self.pod_rank}")
        if not 0 <= self.local_rank < self.workers_per_pod:
            raise ConfigError(
                f"local_rank must be in [0, {self.workers_per_pod}), got {self.local_rank}"
            )

    @property
    def rank(self) -> int:
        return self.pod_rank * self.workers_per_pod + self.local_rank

    @property
    def world_size(self) -> int:
        return self.pods * self.workers_per_pod


def worker_endpoints(pod_endpoints: Sequence[str], workers_per_pod: int) -> list[str]:
    """One endpoint per worker, pod by pod. Paddle's dygraph group init only listens on the
    master (PADDLE_MASTER); the others are names it requires to exist, so a pod's workers
    take its endpoint's port plus their local rank."""
    out: list[str] = []
    for ep in pod_endpoints:
        host, port = ep.rsplit(":", 1)
        out.extend(f"{host}:{int(port) + i}" for i in range(workers_per_pod))
    return out


def local_env(devices: PodDevices, local: int) -> dict[str, str]:
    """What local worker ``local`` of a pod always has, whatever its generation: its
    backend, its local rank and its device pinning (a prewarmed worker gets it at fork, so
    that it builds its model on its own GPU)."""
    env = {
        BACKEND_ENV: devices.backend.value,
        LOCAL_RANK_ENV: str(local),
        LOCAL_SIZE_ENV: str(devices.workers),
    }
    gpu = devices.gpu_of(local)
    if gpu is None:
        # A CPU worker must not pick up a GPU that a CPU pod was given by accident.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[DEVICE_ENV] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        env["FLAGS_selected_gpus"] = "0"
        env[DEVICE_ENV] = f"gpu:{gpu}"
    return env


def worker_env(
    place: WorkerPlace,
    devices: PodDevices,
    master: str,
    pod_endpoints: Sequence[str],
) -> dict[str, str]:
    """The PADDLE_* / device environment of one worker of a generation (the launcher adds
    the generation's own TIDE_* part: tide/trainer/launcher/core.py)."""
    endpoints = worker_endpoints(pod_endpoints, place.workers_per_pod)
    return {
        **local_env(devices, place.local_rank),
        "PADDLE_MASTER": master,
        "PADDLE_TRAINER_ID": str(place.rank),
        "PADDLE_TRAINERS_NUM": str(place.world_size),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[place.rank] if endpoints else "",
        POD_RANK_ENV: str(place.pod_rank),
        PODS_ENV: str(place.pods),
    }
