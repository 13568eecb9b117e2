"""The node agent: samples on a fixed beat, attributes GPUs to pods, streams reports.

Threads and the event loop:
- the event loop runs the beat, the Telemetry stream and the PodResources refresh;
- one sampling thread makes the blocking source calls (NVML), so a slow driver
  never stalls the stream and a slow scaler never stalls sampling;
- one thread runs the Node watch (the kubernetes client blocks); it hands
  notices to the loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import uuid
from typing import Any, Final

from tide.base.errors import Unavailable
from tide.base.lifecycle import TransitionTable
from tide.services.common.clock import Clock, SystemClock
from tide.services.common.logs import with_context

from .attribution import PodResourcesClient
from .fanout import Resolver, resolve_addresses
from .metrics import AgentMetrics
from .model import GpuReading, NodeNotice, NoticeKind, PodOwner, Sample
from .nodewatch import NodeWatcher
from .report import build_report
from .settings import AgentSettings
from .sink import ReportSink, open_sink
from .sources import Source

logger = logging.getLogger(__name__)

#: The scaler may retune the interval, within these bounds (seconds).
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 300.0


class AgentState(enum.Enum):
    """CREATED → STARTING → RUNNING → DRAINING → STOPPED; STARTING or RUNNING → STOPPED on failure."""

    CREATED = "created"
    STARTING = "starting"  # opening the source
    RUNNING = "running"  # sampling and streaming
    DRAINING = "draining"  # final report sent, waiting for its ack
    STOPPED = "stopped"


#: The agent's one lifecycle table; an edge it lacks is a bug (tide.base.lifecycle.InvalidTransition).
AGENT_LIFECYCLE: Final = TransitionTable[AgentState](
    "agent",
    {
        # run() was called.
        AgentState.CREATED: {AgentState.STARTING},
        # The source opened (or failed to: straight to STOPPED).
        AgentState.STARTING: {AgentState.RUNNING, AgentState.STOPPED},
        # Stop was requested (SIGTERM), or a task failed.
        AgentState.RUNNING: {AgentState.DRAINING, AgentState.STOPPED},
        # Flushed, or the flush deadline passed.
        AgentState.DRAINING: {AgentState.STOPPED},
        AgentState.STOPPED: (),
    },
)


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        source: Source,
        *,
        pod_resources: PodResourcesClient | None = None,
        kube_api: Any | None = None,
        metrics: AgentMetrics | None = None,
        clock: Clock | None = None,
        boot_id: str | None = None,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        self.settings = settings
        # Every line names the node as a field (JSON logs) and a prefix (text).
        self._log = with_context(logger, node=settings.node_name)
        self.source = source
        self.pod_resources = pod_resources
        self.kube_api = kube_api
        self.metrics = metrics or AgentMetrics()
        self.clock = clock or SystemClock()
        self.boot_id = boot_id or uuid.uuid4().hex
        self.state = AgentState.CREATED
        self.interval_s = settings.interval_s
        self.gpu_capacity = 0
        self.owners: dict[str, PodOwner] = {}
        self.last_readings: list[GpuReading] = []
        self.watcher: NodeWatcher | None = None
        #: Where reports go: one stream, or one per scaler replica with --scaler-fanout
        #: (tide/services/agent/sink.py); the agent never asks which.
        self.sink: ReportSink = open_sink(
            settings,
            self.boot_id,
            clock=self.clock,
            metrics=self.metrics,
            resolver=resolver,
            on_interval=self._set_interval,
        )
        self._notices: list[NodeNotice] = []
        self._sampler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sample")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dropped_seen = 0
        self._source_failing = False
        #: Set when a task of the agent died; the process then exits non-zero.
        self.failure: BaseException | None = None

    def _transition(self, new: AgentState) -> None:
        AGENT_LIFECYCLE.check(self.state, new, what=f"of node {self.settings.node_name}")
        self._log.info("agent %s -> %s", self.state.value, new.value)
        self.state = new

    def _set_interval(self, interval_s: float) -> None:
        bounded = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, interval_s))
        if bounded != self.interval_s:
            self._log.info(
                "report interval %.3g s -> %.3g s (asked by the scaler)",
                self.interval_s,
                bounded,
            )
            self.interval_s = bounded

    def post_notice(self, notice: NodeNotice) -> None:
        """Queue a notice for the next report. Event-loop thread only."""
        self.metrics.node_events.labels(notice.kind.name.lower()).inc()
        self._notices.append(notice)

    def post_notice_threadsafe(self, notice: NodeNotice) -> None:
        """Queue a notice from another thread (the Node watch)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closing during shutdown
            loop.call_soon_threadsafe(self.post_notice, notice)

    async def _sample(self) -> Sample:
        loop = asyncio.get_running_loop()
        started = self.clock.monotonic()
        readings = await loop.run_in_executor(self._sampler, self.source.sample)
        self.metrics.sample_seconds.observe(self.clock.monotonic() - started)
        self.metrics.gpu_unhealthy.set(sum(1 for r in readings if r.health))
        self.last_readings = readings
        notices, self._notices = self._notices, []
        return Sample(self.clock.now(), readings, self.gpu_capacity, notices)

    def _enqueue(self, sample: Sample) -> None:
        report = build_report(sample, self.settings.node_name, self.boot_id, self.owners)
        self.metrics.reports_sampled.inc()
        self.sink.add(report)
        dropped = self.sink.dropped_total
        self.metrics.reports_dropped.inc(dropped - self._dropped_seen)
        self._dropped_seen = dropped

    async def _wait(self, stop: asyncio.Event, delay_s: float) -> bool:
        """Sleep ``delay_s`` on the clock unless ``stop`` is set first; True if stopped."""
        if stop.is_set():
            return True
        sleeper = asyncio.ensure_future(self.clock.sleep(max(0.0, delay_s)))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            stopper.cancel()
        return stop.is_set()

    async def _sample_or_notices(self) -> Sample:
        """A sample; when the source itself fails, a report without GPUs that still
        carries the node's notices (a termination notice must not wait for NVML)."""
        try:
            sample = await self._sample()
        except Exception as exc:
            self.metrics.samples_failed.inc()
            if not self._source_failing:
                self._log.exception("sampling failed: %s", exc)
            self._source_failing = True
            notices, self._notices = self._notices, []
            return Sample(self.clock.now(), [], self.gpu_capacity, notices)
        if self._source_failing:
            self._log.info("sampling works again")
        self._source_failing = False
        return sample

    async def _beat(self, stop: asyncio.Event) -> None:
        """Sample on a fixed schedule; a sample that overruns skips ticks, never piles up."""
        next_tick = self.clock.monotonic()
        while not stop.is_set():
            self._enqueue(await self._sample_or_notices())
            next_tick += self.interval_s
            now = self.clock.monotonic()
            if now > next_tick:
                skipped = int((now - next_tick) // self.interval_s) + 1
                self.metrics.samples_skipped.inc(skipped)
                next_tick += skipped * self.interval_s
            if await self._wait(stop, next_tick - now):
                return

    async def _refresh_owners(self, stop: asyncio.Event) -> None:
        assert self.pod_resources is not None
        healthy = True
        while True:
            try:
                self.owners = await self.pod_resources.gpu_owners()
                if not healthy:
                    self._log.info("kubelet PodResources reachable again")
                healthy = True
            except Unavailable as exc:
                self.metrics.pod_resources_errors.inc()
                # Keep the last known owners: pods outlive a kubelet restart.
                if healthy:
                    self._log.warning("%s; keeping last owners", exc)
                healthy = False
            if await self._wait(stop, self.settings.pod_resources_refresh_s):
                return

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then send a final report and flush (bounded)."""
        self._loop = asyncio.get_running_loop()
        self._transition(AgentState.STARTING)
        try:
            self.gpu_capacity = await self._loop.run_in_executor(self._sampler, self.source.open)
        except BaseException:
            self._transition(AgentState.STOPPED)
            self._sampler.shutdown(wait=False)
            raise
        self._transition(AgentState.RUNNING)
        self._log.info(
            "agent up, boot %s, %d GPUs, every %.3g s to %s",
            self.boot_id,
            self.gpu_capacity,
            self.interval_s,
            self.settings.scaler,
        )
        tasks = [asyncio.create_task(self.sink.run(), name="telemetry")]
        if self.pod_resources is not None:
            tasks.append(asyncio.create_task(self._refresh_owners(stop), name="pod-resources"))
        if self.kube_api is not None:
            self.watcher = NodeWatcher(
                self.kube_api,
                self.settings.node_name,
                self.post_notice_threadsafe,
                timeout_s=self.settings.watch_timeout_s,
                clock=self.clock,
            )
            self.watcher.start()
        try:
            beat = asyncio.create_task(self._beat(stop), name="beat")
            # Watching `stop` itself, not only the beat: a beat stuck in a hung driver
            # call must not keep SIGTERM from sending the final report.
            stopped = asyncio.create_task(stop.wait(), name="stop")
            done, _ = await asyncio.wait(
                [beat, stopped, *tasks], return_when=asyncio.FIRST_COMPLETED
            )
            if not done & {beat, stopped}:
                failed = next(iter(done))
                self.failure = failed.exception() or RuntimeError(f"{failed.get_name()} ended")
                self._log.error(
                    "%s stopped unexpectedly: %r",
                    failed.get_name(),
                    self.failure,
                )
            if not beat.done():
                # The beat returns at once when it is between samples; give a sample
                # in progress a moment to finish, then abandon it.
                await asyncio.wait([beat], timeout=min(1.0, self.interval_s))
                beat.cancel()
            stopped.cancel()
            await asyncio.gather(beat, stopped, return_exceptions=True)
            await self._finish()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.watcher is not None:
                self.watcher.stop(join_s=1.0)
            closing = asyncio.wrap_future(self._sampler.submit(self.source.close))
            with contextlib.suppress(Exception):
                # Bounded: a driver hung in the sampling thread must not hang the exit.
                await asyncio.wait_for(closing, timeout=2.0)
            self._sampler.shutdown(wait=False)
            if self.pod_resources is not None:
                await self.pod_resources.close()
            if self.state is not AgentState.STOPPED:
                self._transition(AgentState.STOPPED)

    async def _finish(self) -> None:
        """The final report says the samples stop here, so the scaler need not wait
        for staleness to find out."""
        self._transition(AgentState.DRAINING)
        why = "SIGTERM" if self.failure is None else f"agent failure: {self.failure!r}"
        self.post_notice(NodeNotice(NoticeKind.AGENT_SHUTDOWN, self.clock.now(), why))
        try:
            sample = await asyncio.wait_for(self._sample(), timeout=1.0)
        except Exception:
            # A hung or failing driver must not keep the notice from going out.
            notices, self._notices = self._notices, []
            sample = Sample(self.clock.now(), [], self.gpu_capacity, notices)
        self._enqueue(sample)
        self._log.info("%s", await self.sink.finish(self.settings.shutdown_flush_s))
        self._transition(AgentState.STOPPED)
