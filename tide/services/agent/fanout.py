"""Streaming to every scaler replica (``--scaler-fanout``), for a scaler run as a leader
and followers (docs/reliability.md, Leader election).

Every replica ingests telemetry so that a follower's windows are full the moment it
leads, but in Kubernetes the scaler's Service sends an agent to ready pods only, and
only the leader is ready. With fan-out the agent resolves ``--scaler``'s host (a
headless Service that lists not-ready pods too) to every address it has, keeps one
Telemetry stream to each, and gives each replica the same reports through a buffer
of its own: a replica that is away holds back nothing for the others, and each one
acks its own sequence numbers.

The set of replicas is resolved again every ``scaler_resolve_interval_s``. A replica
whose address goes away stops getting reports; its buffer is kept (up to
``MAX_REMEMBERED`` of them), so that if the address comes back (a DNS answer that
missed one pod), its stream resends what was in flight with the same numbers: a
scaler acks the highest contiguous number it holds, so a buffer started again from
1, or one with a hole, would stall that replica's acks for good.

Not for sharded scalers (``--shards``): there each replica forwards what it ingests
to the job's owner, so a report sent to every replica would be counted once per
replica. There the agent streams to the Service, one replica, as without fan-out.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from tide.services.common.clock import Clock
from tide.services.common.logs import with_context
from tide.v1 import telemetry_pb2

from .buffer import ReportBuffer
from .metrics import AgentMetrics
from .stream import StreamConfig, TelemetryStream

logger = logging.getLogger(__name__)

#: Resolves HOST:PORT to the HOST:PORT of every address behind it.
Resolver = Callable[[str], Awaitable[list[str]]]

#: Buffers kept for replicas whose address went away (see the module's docstring).
MAX_REMEMBERED = 16

#: How long one resolution may take before the last answer is kept.
RESOLVE_TIMEOUT_S = 5.0


async def resolve_addresses(target: str) -> list[str]:
    """Every address ``target``'s host resolves to (A and AAAA), with its port, sorted."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = {str(info[4][0]) for info in infos}
    return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)


def _copy(report: telemetry_pb2.NodeReport) -> telemetry_pb2.NodeReport:
    # Each buffer numbers its reports and may move a dropped one's events to the next,
    # in place: every replica gets a copy of its own.
    own = telemetry_pb2.NodeReport()
    own.CopyFrom(report)
    return own


@dataclass
class _Replica:
    buffer: ReportBuffer
    stream: TelemetryStream
    task: asyncio.Task[None] | None = None


class ScalerFanout:
    """One buffer and one Telemetry stream per scaler replica; ``add`` gives each the
    report. A ``ReportSink`` (tide/services/agent/sink.py). Owned by the agent's event loop."""

    def __init__(
        self,
        config: StreamConfig,
        *,
        buffer_reports: int,
        max_in_flight_reports: int,
        resolve_interval_s: float,
        clock: Clock,
        metrics: AgentMetrics,
        resolver: Resolver = resolve_addresses,
        on_interval: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self._log = with_context(logger, node=config.node_name)
        self._buffer_reports = buffer_reports
        self._max_in_flight = max_in_flight_reports
        self._resolve_interval_s = resolve_interval_s
        self._clock = clock
        self._metrics = metrics
        self._resolver = resolver
        self._on_interval = on_interval
        #: The replicas streamed to now, by address.
        self.replicas: dict[str, _Replica] = {}
        #: Replicas whose address went away, oldest first (see the module's docstring).
        self._gone: OrderedDict[str, _Replica] = OrderedDict()
        self._resolve_failing = False
        self.resolved = asyncio.Event()
        #: Reports sampled before the first answer of the resolver (the beat and the
        #: resolution start together): every first replica gets them, so none is lost.
        self._early: deque[telemetry_pb2.NodeReport] = deque(maxlen=buffer_reports)
        self._early_dropped = 0

    # -- what the agent sees: one place to put reports --------------------------

    def add(self, report: telemetry_pb2.NodeReport) -> None:
        if not self.resolved.is_set():
            if len(self._early) == self._early.maxlen:
                self._early_dropped += 1
            self._early.append(report)
            return
        for replica in self.replicas.values():
            replica.buffer.add(_copy(report))
        self._export()

    @property
    def held(self) -> int:
        return sum(len(r.buffer) for r in self.replicas.values())

    @property
    def dropped_total(self) -> int:
        return self._early_dropped + sum(
            r.buffer.dropped_total for r in (*self.replicas.values(), *self._gone.values())
        )

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every replica acked all it holds; False if one had not by ``timeout_s``."""
        if not self.replicas:
            return True
        done = await asyncio.gather(*(r.stream.flush(timeout_s) for r in self.replicas.values()))
        return all(done)

    async def finish(self, timeout_s: float) -> str:
        """``flush``; the agent's final log line (tide/services/agent/sink.py, ``ReportSink``)."""
        flushed = await self.flush(timeout_s)
        return (
            f"final report {'acked' if flushed else 'NOT acked'} by {len(self.replicas)}"
            f" scaler replicas; {self.dropped_total} dropped, {self.held} unacked at exit"
        )

    # -- the replica set -------------------------------------------------------------

    async def run(self) -> None:
        """Resolve, stream to what is there, again every ``resolve_interval_s``; until cancelled."""
        try:
            while True:
                await self._refresh()
                await self._clock.sleep(self._resolve_interval_s)
        finally:
            tasks = [r.task for r in self.replicas.values() if r.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _refresh(self) -> None:
        target = self.config.target
        try:
            addresses = await asyncio.wait_for(self._resolver(target), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            # Keep streaming to the replicas known: a DNS outage is not a scaler outage.
            if not self._resolve_failing:
                self._log.warning(
                    "cannot resolve scaler replicas at %s (%s); keeping the %d known",
                    target,
                    exc or type(exc).__name__,
                    len(self.replicas),
                )
            self._resolve_failing = True
            return
        if self._resolve_failing:
            self._log.info("scaler replicas at %s resolve again", target)
        self._resolve_failing = False
        if not addresses:
            # An empty answer (every pod gone at once, a rollout) keeps the last set too;
            # before any replica, reports wait in the early buffer.
            return
        self._apply(set(addresses))
        self.resolved.set()
        self._early.clear()

    def _apply(self, addresses: set[str]) -> None:
        for address in sorted(self.replicas.keys() - addresses):
            replica = self.replicas.pop(address)
            if replica.task is not None:
                replica.task.cancel()
                replica.task = None
            self._gone[address] = replica
            while len(self._gone) > MAX_REMEMBERED:
                self._gone.popitem(last=False)
            self._log.info("scaler replica %s left; %d remain", address, len(self.replicas))
        for address in sorted(addresses - self.replicas.keys()):
            replica = self._gone.pop(address) if address in self._gone else self._new(address)
            if not self.resolved.is_set():
                for report in self._early:
                    replica.buffer.add(_copy(report))
            replica.task = asyncio.create_task(replica.stream.run(), name=f"telemetry {address}")
            self.replicas[address] = replica
            self._log.info(
                "streaming to scaler replica %s (%d in all)", address, len(self.replicas)
            )
        self._export()

    def _new(self, address: str) -> _Replica:
        host = self.config.target.rpartition(":")[0].strip("[]")
        # The replica's certificate names the Service, not the pod's address.
        config = replace(self.config, target=address, tls_server_name=host)
        buffer = ReportBuffer(self._buffer_reports, self._max_in_flight)
        # Each stream's own counters and gauges stay private: one "connected" gauge
        # set by N streams would say whichever wrote last. The agent exports the sums.
        stream = TelemetryStream(
            config, buffer, metrics=AgentMetrics(), clock=self._clock, on_interval=self._on_interval
        )
        return _Replica(buffer, stream)

    def _export(self) -> None:
        m = self._metrics
        m.scaler_replicas.set(len(self.replicas))
        m.scaler_replicas_connected.set(
            sum(1 for r in self.replicas.values() if r.stream.state.connected)
        )
        m.buffered.set(self.held)
