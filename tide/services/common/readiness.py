"""What a service's health says, and why: readiness and liveness apart.

The kubelet asks two questions with different consequences. Readiness ("send
me work?") is the gRPC health of ``""`` and of each service name: it turns
NOT_SERVING while a dependency the service cannot work without is down (its
store), and back by itself when it returns. Liveness ("restart me?") is the
health of :data:`LIVENESS`: it turns NOT_SERVING only when the process is
broken beyond repair (a background task died), since restarting a scaler
because PostgreSQL is down helps nobody and loses its warm windows.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc_health.v1 import health_pb2

logger = logging.getLogger(__name__)

#: The health service name the chart's livenessProbe asks for.
LIVENESS = "liveness"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Readiness:
    """Causes of unreadiness by name; health is SERVING when there are none.

    Created before the server, bound to its health servicer once it runs
    (:meth:`bind`); causes set before that are applied at bind time."""

    def __init__(self) -> None:
        self._down: dict[str, str] = {}
        self._dead: str | None = None
        self._health: Any = None
        self._names: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return not self._down and self._dead is None

    async def bind(self, health: Any, names: Sequence[str]) -> None:
        self._health = health
        self._names = ("", *names)
        await self._apply()

    async def set_down(self, cause: str, why: str) -> None:
        """Not ready because of ``cause`` (e.g. "store"), with a line of why."""
        if self._down.get(cause) == why:
            return
        self._down[cause] = why
        logger.warning("not ready: %s: %s", cause, why)
        await self._apply()

    async def set_up(self, cause: str) -> None:
        if self._down.pop(cause, None) is None:
            return
        logger.warning("%s recovered%s", cause, "" if self._down else "; ready again")
        await self._apply()

    def follower(self, cause: str) -> Callable[[bool, str], Awaitable[None]]:
        """A listener ``fn(ok, why)`` that sets ``cause`` up or down (a store probe's)."""

        async def follow(ok: bool, why: str) -> None:
            if ok:
                await self.set_up(cause)
            else:
                await self.set_down(cause, why)

        return follow

    async def mark_dead(self, why: str) -> None:
        """The process cannot recover by itself: readiness and liveness both go."""
        self._dead = why
        await self._apply()

    async def _apply(self) -> None:
        if self._health is None:
            return
        status = _SERVING if self.ready else _NOT_SERVING
        for name in self._names:
            await self._health.set(name, status)
        await self._health.set(LIVENESS, _NOT_SERVING if self._dead is not None else _SERVING)
