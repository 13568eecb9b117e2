"""`python -m tide.services.testing.scaler`: the production scaler with test doubles injected.

For tests, benchmarks and demos that have no coordinator or cluster:

- ``--coordinator memory`` runs the in-memory coordinator
  (tide.services.testing.coordinator); every decision it ends says
  "in-memory coordinator: nothing moved". ``--coordinator-state-file`` keeps its
  state across restarts (the crash tests). A HOST:PORT uses the real one.
- ``--actuator memory`` (changes in a dict) or ``file:PATH`` (a change log that
  survives SIGKILL); ``local:DIR`` is the real local actuator.
- TIDE_FAULT arms a fault point (tide.services.testing.faults): the process kills
  itself with SIGKILL when a decision reaches it.

Everything else (settings, store, engine, servicers) is the production code of
tide/services/scaler/app.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tide.base.client import open_channel
from tide.base.errors import ConfigError
from tide.services.common.clock import Clock, SystemClock
from tide.services.common.config import setting
from tide.services.common.entry import run_service
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.actuators import make_actuator as make_real_actuator
from tide.services.scaler.app import serve_scaler
from tide.services.scaler.coordination import CoordinatorClient, GrpcCoordinatorClient
from tide.services.scaler.settings import ScalerSettings
from tide.services.testing.actuators import FileActuator, InMemoryActuator
from tide.services.testing.coordinator import InMemoryCoordinator, follow_actuator
from tide.services.testing.faults import FaultPoint

MEMORY = "memory"


@dataclass(frozen=True)
class TestScalerSettings(ScalerSettings):
    """ScalerSettings that also accept the doubles."""

    __test__ = False  # not a pytest class, whatever its name says

    coordinator: str = setting(
        "", "coordinator HOST:PORT, or memory (the in-memory coordinator: nothing moves)"
    )
    actuator: str = setting(
        "", "memory; file:PATH (replica log that survives crashes); local:DIR (launchers)"
    )
    coordinator_state_file: str = setting(
        "", "with --coordinator memory: a file that keeps its state across restarts"
    )

    def check_coordinator(self) -> None:
        if self.coordinator != MEMORY:
            super().check_coordinator()

    def check_actuator(self) -> None:
        kind, sep, arg = self.actuator.partition(":")
        if self.actuator == MEMORY or (kind == "file" and sep and arg):
            return
        if kind == "local" and self.coordinator == MEMORY:
            raise ConfigError(
                f"actuator={self.actuator!r}: local pods register with a coordinator;"
                " --coordinator HOST:PORT is required"
            )
        if kind != "local":
            raise ConfigError(
                f"actuator: expected memory, file:PATH or local:DIR, got {self.actuator!r}"
            )
        super().check_actuator()


def make_actuator(settings: TestScalerSettings, clock: Clock) -> Actuator:
    total = settings.total_gpus or None
    kind, _, arg = settings.actuator.partition(":")
    if settings.actuator == MEMORY:
        return InMemoryActuator(total)
    if kind == "file":
        return FileActuator(Path(arg), total)
    return make_real_actuator(
        settings.actuator,
        coordinator=settings.coordinator,
        total_gpus=total,
        clock=clock,
        ca_dir=settings.local_ca_dir,
    )


async def run(settings: TestScalerSettings) -> None:
    clock = SystemClock()
    actuator = make_actuator(settings, clock)
    coordinator: CoordinatorClient
    on_shutdown: list[Callable[[], Awaitable[None]]] = []
    if settings.coordinator == MEMORY:
        state = Path(settings.coordinator_state_file) if settings.coordinator_state_file else None
        memory = InMemoryCoordinator(path=state)
        if isinstance(actuator, InMemoryActuator):
            follow_actuator(memory, actuator)
        coordinator = memory
    else:
        channel = open_channel(settings.coordinator, credentials=settings.credentials())
        coordinator = GrpcCoordinatorClient(channel)
        on_shutdown.append(channel.close)
    await serve_scaler(
        settings,
        actuator=actuator,
        coordinator=coordinator,
        clock=clock,
        fault=FaultPoint(),
        on_shutdown=on_shutdown,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service(
        TestScalerSettings,
        run,
        name="testing.scaler",
        description="Tide scaler with test doubles (in-memory coordinator, memory/file actuators).",
        argv=argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
