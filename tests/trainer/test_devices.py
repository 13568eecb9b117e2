"""Backend choice, workers per pod, rank layout and device pinning (tide/trainer/devices.py)."""

from __future__ import annotations

import pytest

from tide.base.errors import ConfigError
from tide.trainer import devices
from tide.trainer.devices import (
    Backend,
    PodDevices,
    WorkerPlace,
    detect,
    local_env,
    memory_shortfall,
    worker_env,
)
from tide.trainer.distenv import DistEnv

pytestmark = pytest.mark.unit


def test_visible_gpus_from_the_container_runtime_environment() -> None:
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert devices.visible_gpus({"NVIDIA_VISIBLE_DEVICES": "0"}) == ["0"]
    assert devices.visible_gpus({"NVIDIA_VISIBLE_DEVICES": "void"}) == []
    assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_all_counts_through_nvml_or_device_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_nvml_count", lambda: None)
    monkeypatch.setattr(devices, "_device_nodes", lambda: 2)
    assert devices.visible_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}) == ["0", "1"]
    monkeypatch.setattr(devices, "_nvml_count", lambda: 8)
    assert len(devices.visible_gpus({})) == 8


def test_backend_is_nccl_with_gpus_gloo_without_and_overridable() -> None:
    assert devices.choose_backend(Backend.AUTO, 2) is Backend.NCCL
    assert devices.choose_backend(Backend.AUTO, 0) is Backend.GLOO
    assert devices.choose_backend(Backend.GLOO, 4) is Backend.GLOO
    with pytest.raises(ConfigError, match="nccl needs a GPU"):
        devices.choose_backend(Backend.NCCL, 0)
    with pytest.raises(ConfigError, match="'mpi'"):
        Backend.parse("mpi")


def test_one_worker_per_gpu_or_one_on_cpu() -> None:
    gpu = detect(env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert (gpu.backend, gpu.workers) == (Backend.NCCL, 3)
    cpu = detect(env={"CUDA_VISIBLE_DEVICES": ""})
    assert (cpu.backend, cpu.workers) == (Backend.GLOO, 1)
    assert detect(workers=2, env={"CUDA_VISIBLE_DEVICES": ""}).workers == 2
    with pytest.raises(ConfigError, match="<= the pod's 1 GPUs"):
        PodDevices(Backend.NCCL, ("0",), 2)


def test_ranks_are_laid_out_pod_by_pod() -> None:
    ranks = [WorkerPlace(p, 3, local, 2).rank for p in range(3) for local in range(2)]
    assert ranks == [0, 1, 2, 3, 4, 5]
    assert WorkerPlace(1, 3, 0, 2).world_size == 6
    with pytest.raises(ConfigError, match="local_rank"):
        WorkerPlace(0, 1, 2, 2)


def test_each_gpu_worker_sees_only_its_own_gpu() -> None:
    pod = PodDevices(Backend.NCCL, ("4", "5"), 2)
    env = worker_env(WorkerPlace(1, 2, 1, 2), pod, "10.0.0.1:6000", ["10.0.0.1:6000", "h2:7000"])
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["FLAGS_selected_gpus"] == "0"
    assert env["PADDLE_DISTRI_BACKEND"] == "nccl"
    assert (env["PADDLE_TRAINER_ID"], env["PADDLE_TRAINERS_NUM"]) == ("3", "4")
    assert env["PADDLE_TRAINER_ENDPOINTS"].split(",") == [
        "10.0.0.1:6000",
        "10.0.0.1:6001",
        "h2:7000",
        "h2:7001",
    ]
    assert env["PADDLE_CURRENT_ENDPOINT"] == "h2:7001"
    dist = DistEnv.from_env(env)
    assert (dist.rank, dist.local_rank, dist.pod_rank, dist.paddle_device) == (3, 1, 1, "gpu:0")


def test_a_cpu_worker_hides_gpus_and_a_standby_has_its_pinning_before_its_rank() -> None:
    pod = PodDevices(Backend.GLOO, ("0",), 1)
    env = local_env(pod, 0)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and "FLAGS_selected_gpus" not in env
    assert DistEnv.from_env(env).paddle_device == "cpu"
    assert local_env(PodDevices(Backend.NCCL, ("3",), 1), 0)["CUDA_VISIBLE_DEVICES"] == "3"


def test_a_gpu_short_of_memory_for_a_prepared_worker_is_named() -> None:
    assert memory_shortfall({"0": 9000, "1": 12000}, 8192) == ""
    assert memory_shortfall({"0": 9000, "1": 4000}, 8192) == (
        "GPU 1 has 4000 MiB free; a prepared worker needs 8192 MiB (prepare_min_free_mib)"
    )
