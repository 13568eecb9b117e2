"""Where a worker sits in its generation, read from the PADDLE_* and TIDE_* environment.

The launcher writes this environment (tide/trainer/launcher/core.py) and the worker reads it
(:class:`DistEnv`); the names are defined once, here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tide.base.errors import ConfigError, DeadlineExceeded
from tide.trainer.channel import CONTROL_SOCKET_ENV
from tide.trainer.devices import DEVICE_ENV, LOCAL_RANK_ENV, LOCAL_SIZE_ENV, POD_RANK_ENV
from tide.trainer.handover import HANDOVER_DIR_ENV

GENERATION_ENV = "TIDE_GENERATION"
RESTORE_STEP_ENV = "TIDE_RESTORE_STEP"
RESTART_STARTED_AT_ENV = "TIDE_RESTART_STARTED_AT"
# Set for a worker forked ahead of time: it learns its generation over the channel.
PREWARM_ENV = "TIDE_PREWARM"
# Set in a prewarmed worker's Rendezvous when it prepares a generation ahead (overlap mode):
# after its group forms it reports Prepared and waits for Start before it restores.
PREPARED_ENV = "TIDE_PREPARED"


@dataclass(frozen=True)
class DistEnv:
    """Where this worker sits, from the PADDLE_* and TIDE_* environment."""

    rank: int = 0
    world_size: int = 1
    master: str = ""
    generation: int = 0
    # Step the rendezvous names; None: the newest good checkpoint (or scratch).
    restore_step: int | None = None
    control_socket: str = ""
    # Wall time at which the launcher began replacing the previous worker; 0 if unknown.
    restart_started_at: float = 0.0
    # Forked ahead of time: rank and generation come later, in a Rendezvous message.
    prewarm: bool = False
    # This worker among its pod's (tide/trainer/devices.py), and its device: "cpu", "gpu:<id>".
    local_rank: int = 0
    local_size: int = 1
    pod_rank: int = 0
    device: str = ""
    # The pod's shared-memory directory for handing state to the next worker; "": none.
    handover_dir: str = ""
    # Its generation's group forms ahead, while the previous worker still trains.
    prepared: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"PADDLE_TRAINERS_NUM must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"PADDLE_TRAINER_ID must be in [0, {self.world_size}), got {self.rank}"
            )
        if self.world_size > 1 and ":" not in self.master:
            raise ConfigError(f"PADDLE_MASTER must be host:port, got {self.master!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        e = os.environ if env is None else env
        restore = e.get(RESTORE_STEP_ENV, "")
        return cls(
            rank=int(e.get("PADDLE_TRAINER_ID", "0")),
            world_size=int(e.get("PADDLE_TRAINERS_NUM", "1")),
            master=e.get("PADDLE_MASTER", ""),
            generation=int(e.get(GENERATION_ENV, "0")),
            restore_step=int(restore) if restore not in ("", "0") else None,
            control_socket=e.get(CONTROL_SOCKET_ENV, ""),
            restart_started_at=float(e.get(RESTART_STARTED_AT_ENV, "0") or 0),
            prewarm=e.get(PREWARM_ENV, "0") == "1",
            local_rank=int(e.get(LOCAL_RANK_ENV, "0")),
            local_size=int(e.get(LOCAL_SIZE_ENV, "1")),
            pod_rank=int(e.get(POD_RANK_ENV, "0")),
            handover_dir=e.get(HANDOVER_DIR_ENV, ""),
            device=e.get(DEVICE_ENV, ""),
            prepared=e.get(PREPARED_ENV, "0") == "1",
        )

    @property
    def paddle_device(self) -> str:
        """The device for ``paddle.set_device``: a pinned worker sees its one GPU as gpu:0."""
        return "gpu:0" if self.device.startswith("gpu") else "cpu"


def wait_for_port(endpoint: str, timeout_s: float) -> None:
    """Connect-and-close until ``host:port`` listens: Paddle's TCPStore client otherwise
    sleeps a hard-coded 3 s before its retry when it connects too early."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"master {endpoint} not listening after {timeout_s}s"
                ) from None
            time.sleep(0.005)
