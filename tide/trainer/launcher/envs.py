"""The environment of a generation's workers, from the RENDEZVOUS (or PREPARE) that forms it."""

from __future__ import annotations

from tide.trainer.devices import PodDevices, WorkerPlace, worker_env
from tide.trainer.distenv import (
    GENERATION_ENV,
    PREPARED_ENV,
    RESTART_STARTED_AT_ENV,
    RESTORE_STEP_ENV,
)
from tide.trainer.launcher.model import Directive, DirectiveKind


def rendezvous_envs(
    d: Directive, devices: PodDevices, restart_started_at: float
) -> list[dict[str, str]]:
    """The PADDLE_*/TIDE_* environment of each local worker of a RENDEZVOUS (or of a
    PREPARE, for the generation it prepares, whose restore step and restart come later
    with the RENDEZVOUS): the coordinator's rank and world size count pods, the workers'
    count processes."""
    rdv = d.rendezvous
    assert rdv is not None
    preparing = d.kind is DirectiveKind.PREPARE
    common = {
        GENERATION_ENV: str(rdv.generation if preparing else d.generation),
        RESTORE_STEP_ENV: str(rdv.restore_step),
        RESTART_STARTED_AT_ENV: repr(restart_started_at),
    }
    if preparing:
        common[PREPARED_ENV] = "1"
    return [
        {
            **worker_env(
                WorkerPlace(rdv.rank, rdv.world_size, local, devices.workers),
                devices,
                rdv.master_endpoint,
                rdv.trainer_endpoints,
            ),
            **common,
        }
        for local in range(devices.workers)
    ]
