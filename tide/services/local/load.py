"""A synthetic GPU node whose load the demo sets: it streams Telemetry to the scaler.

On this machine there are no GPUs and no kubelet, so the node attributes GPU
``i`` to the job's local pod with index ``i`` (as the kubelet's PodResources
would name the pod holding that GPU) and reports the utilization the demo asks
for, with a little noise. Reports follow the Telemetry contract: one boot id,
sequence numbers 1, 2, 3... without gaps, and after a reconnect the reports not
acknowledged yet are sent again, with their numbers, before new ones.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc

from tide.base.client import open_channel
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.errors import ConfigError
from tide.base.retry import Backoff
from tide.base.timeconv import ts_from_seconds
from tide.services.common.clock import Clock, SystemClock
from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

logger = logging.getLogger(__name__)

#: GPU index → the pod holding it ("namespace", "pod name").
Attribution = Callable[[], Mapping[int, tuple[str, str]]]

_MEMORY_TOTAL_BYTES = 80 * 1024**3


@dataclass(frozen=True)
class LoadSettings:
    node_name: str = "local-0"
    gpus: int = 4
    interval_s: float = 1.0
    # Uniform noise added to every reading, percentage points (kept within 0..100).
    noise_pct: float = 2.0
    # Reconnect delays after a broken stream: tide.base's jittered backoff from
    # reconnect_s up to reconnect_max_s, starting small again once acks come.
    reconnect_s: float = 0.5
    reconnect_max_s: float = 5.0
    # Unacknowledged reports kept for resending after a reconnect.
    buffer_reports: int = 120

    def __post_init__(self) -> None:
        if not 1 <= self.gpus <= 64:
            raise ConfigError(f"gpus: must be 1..64, got {self.gpus}")
        if not self.interval_s > 0:
            raise ConfigError(f"interval_s: must be > 0, got {self.interval_s}")
        if not 0 <= self.noise_pct <= 20:
            raise ConfigError(f"noise_pct: must be 0..20, got {self.noise_pct}")
        if not 0 < self.reconnect_s <= self.reconnect_max_s:
            raise ConfigError(
                f"reconnect_s: must be > 0 and <= reconnect_max_s ({self.reconnect_max_s}),"
                f" got {self.reconnect_s}"
            )
        if self.buffer_reports < 1:
            raise ConfigError(f"buffer_reports: must be >= 1, got {self.buffer_reports}")
        if not self.node_name:
            raise ConfigError("node_name: must not be empty")


class SyntheticNode:
    def __init__(
        self,
        target: str,
        attribution: Attribution,
        settings: LoadSettings | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        credentials: ClientCredentials = NO_CREDENTIALS,
    ) -> None:
        self.target = target
        self.credentials = credentials
        self.attribution = attribution
        self.settings = settings or LoadSettings()
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.boot_id = uuid.uuid4().hex
        #: Utilization every attributed GPU reports now, percent; idle GPUs report 0.
        self.level_pct = 0.0
        self.seq = 0
        self.acked_seq = 0
        self.reports_sent = 0
        self.last_error = ""
        self._backoff = Backoff(self.settings.reconnect_s, self.settings.reconnect_max_s)
        # Sent but not acknowledged, oldest first; bounded like the agent's buffer.
        self._unacked: collections.deque[telemetry_pb2.NodeReport] = collections.deque(
            maxlen=self.settings.buffer_reports
        )

    def report(self) -> telemetry_pb2.NodeReport:
        """The next report: one sample per GPU, attributed ones at ``level_pct``."""
        self.seq += 1
        s = self.settings
        owners = self.attribution()
        r = telemetry_pb2.NodeReport(
            node_name=s.node_name,
            boot_id=self.boot_id,
            seq=self.seq,
            gpu_capacity=s.gpus,
            sampled_at=ts_from_seconds(self.clock.now()),
        )
        for i in range(s.gpus):
            owner = owners.get(i)
            base = self.level_pct if owner is not None else 0.0
            util = min(100.0, max(0.0, base + self.rng.uniform(-s.noise_pct, s.noise_pct)))
            g = r.gpus.add(
                index=i,
                uuid=f"GPU-synthetic-{s.node_name}-{i}",
                utilization_pct=util,
                memory_used_bytes=int(_MEMORY_TOTAL_BYTES * (0.6 if owner else 0.0)),
                memory_total_bytes=_MEMORY_TOTAL_BYTES,
                power_w=70.0 + 3.3 * util,
                temperature_c=35.0 + 0.4 * util,
                health_flags=telemetry_pb2.GPU_HEALTH_FLAG_OK,
            )
            if owner is not None:
                g.pod.namespace, g.pod.name = owner
        return r

    async def run(self, stop: asyncio.Event) -> None:
        """Stream until ``stop`` is set, reconnecting after a broken stream."""
        while not stop.is_set():
            try:
                async with open_channel(self.target, credentials=self.credentials) as channel:
                    await self._stream(telemetry_pb2_grpc.TelemetryStub(channel), stop)
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
                logger.warning(
                    "node %s: telemetry stream to %s broke (%s); reconnecting",
                    self.settings.node_name,
                    self.target,
                    self.last_error,
                )
            if not stop.is_set():
                await self._sleep_or_stop(stop, self._backoff.next_delay_s())

    async def _stream(self, stub: telemetry_pb2_grpc.TelemetryStub, stop: asyncio.Event) -> None:
        async def reports() -> AsyncIterator[telemetry_pb2.NodeReport]:
            for held in list(self._unacked):
                yield held
            while not stop.is_set():
                r = self.report()
                self._unacked.append(r)
                yield r
                self.reports_sent += 1
                await self._sleep_or_stop(stop, self.settings.interval_s)

        # The generated stubs are typed for the sync API; on an aio channel the
        # call takes and returns async iterators.
        call: Any = stub.Stream(cast(Any, reports()))
        async for ack in call:
            self._backoff.reset()  # a scaler that answers: the next outage starts small
            if ack.boot_id == self.boot_id:
                self.acked_seq = max(self.acked_seq, ack.acked_seq)
                while self._unacked and self._unacked[0].seq <= self.acked_seq:
                    self._unacked.popleft()

    async def _sleep_or_stop(self, stop: asyncio.Event, seconds: float) -> None:
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()


def pods_by_index(state_dir: str, job_id: str) -> Attribution:
    """GPU i → the local pod of ``job_id`` with index i, read from the actuator's pid files."""
    from pathlib import Path

    from tide.services.scaler.actuators.local import LocalActuator, LocalActuatorSettings

    # Only pods() is used, which reads the state dir; the coordinator address is unused.
    reader = LocalActuator(LocalActuatorSettings(Path(state_dir), "127.0.0.1:1"))
    ns = job_id.partition("/")[0]

    def owners() -> dict[int, tuple[str, str]]:
        return {p.index: (ns, p.name) for p in reader.pods(job_id)}

    return owners
