"""An actuator that counts its errors: any Actuator, wrapped once in the scaler's wiring.

The decision that meets the error records it (FAILED, with the message); this
counter is what an alert can see across decisions (``tide_scaler_actuator_errors_total``).
"""

from __future__ import annotations

from prometheus_client import Counter

from tide.services.scaler.actuators.base import Actuator


class CountedActuator:
    """Delegates every call to ``inner``; a call that raises is counted, then re-raised."""

    def __init__(self, inner: Actuator, errors: Counter) -> None:
        self.inner = inner
        self._errors = errors

    def adopt(self, job_id: str, *, replicas: int, gpus_per_replica: int) -> None:
        self.inner.adopt(job_id, replicas=replicas, gpus_per_replica=gpus_per_replica)

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        try:
            await self.inner.set_replicas(job_id, replicas, decision_id=decision_id)
        except Exception:
            self._errors.labels("set_replicas").inc()
            raise

    async def get_replicas(self, job_id: str) -> int | None:
        try:
            return await self.inner.get_replicas(job_id)
        except Exception:
            self._errors.labels("get_replicas").inc()
            raise

    async def free_gpus(self) -> int | None:
        try:
            return await self.inner.free_gpus()
        except Exception:
            self._errors.labels("free_gpus").inc()
            raise
