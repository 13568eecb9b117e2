"""The demo's run: the control plane up, the job registered, the load driven phase by phase.

:class:`Demo` is the one stateful piece: it owns the cluster and the current phase, and
steps the scenario (:mod:`.scenario`) on each poll (:mod:`.poll`); what it starts comes
from :mod:`.spec`, what it leaves from :mod:`.report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tide.base.client import open_channel
from tide.base.errors import FailedPrecondition, TideError, Unavailable
from tide.services.local.demo import spec
from tide.services.local.demo.poll import Poller
from tide.services.local.demo.report import Outcome, draw_chart
from tide.services.local.demo.scenario import (
    DEMO_LIFECYCLE,
    Phase,
    goal_reached,
    next_job_id,
    next_phase,
)
from tide.services.local.demo.settings import RPC_TIMEOUT_S, DemoSettings
from tide.services.local.load import LoadSettings, pods_by_index
from tide.services.local.samples import audit
from tide.services.local.up import LocalCluster, UpSettings
from tide.services.local.view import Snapshot
from tide.services.scaler.actuators.local import JobSpec, job_dir_name
from tide.v1 import coordinator_pb2_grpc, scaler_pb2, scaler_pb2_grpc

logger = logging.getLogger(__name__)


class Demo:
    def __init__(
        self,
        settings: DemoSettings,
        show: Callable[[Snapshot], None],
        echo: Callable[[str], None],
    ) -> None:
        self.s = settings
        self.show = show
        self.echo = echo
        self.job_id = next_job_id(settings.state_dir)
        name = job_dir_name(self.job_id)
        self.samples_dir = settings.state_dir / "samples" / name
        self.ckpt_dir = settings.state_dir / "checkpoints" / name
        self.phase = Phase.STARTING
        self.t0 = time.monotonic()
        self.started_at = datetime.now(tz=UTC)
        self.poller = Poller(self.job_id, self.started_at, self.elapsed)
        # The poller's, under the names they had here.
        self.trails = self.poller.trails
        self.timeline = self.poller.timeline
        self.cluster: LocalCluster | None = None
        self._level = settings.warm_pct

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _move(self, new: Phase) -> None:
        DEMO_LIFECYCLE.check(self.phase, new, what=self.job_id)
        logger.info("demo %s: phase %s -> %s", self.job_id, self.phase.value, new.value)
        self.phase = new

    def up_settings(self) -> UpSettings:
        return spec.up_settings(self.s)

    def job_spec(self) -> JobSpec:
        return spec.job_spec(self.s, self.samples_dir, self.ckpt_dir)

    def policy(self) -> scaler_pb2.Policy:
        return spec.policy(self.s)

    async def run(self, stop: asyncio.Event) -> Outcome:
        """Run the demo; ``stop`` (Ctrl-C) interrupts it at any point, cleanly."""
        cluster = LocalCluster(self.up_settings())
        self.cluster = cluster
        outcome = Outcome(self.job_id, Phase.FAILED, 0.0)
        body = asyncio.create_task(self._body(cluster, outcome), name="demo")
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({body, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not body.done():
                body.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await body
                raise FailedPrecondition(f"interrupted in phase {self.phase.value}")
            body.result()
        except Exception as exc:
            if self.phase is not Phase.FAILED:
                self._move(Phase.FAILED)
            outcome.error = str(exc) or type(exc).__name__
            if isinstance(exc, TideError):
                logger.warning("demo %s: %s", self.job_id, outcome.error)
            else:
                logger.exception("demo %s failed", self.job_id)
        finally:
            stopper.cancel()
            self.echo("stopping the job and the control plane ...")
            await cluster.stop()
        outcome.phase = self.phase
        outcome.elapsed_s = self.elapsed()
        if self.samples_dir.is_dir():
            outcome.audit = audit(
                self.samples_dir,
                dataset_size=self.s.dataset_size,
                global_batch=self.s.global_batch,
                seed=self.s.seed,
            )
        outcome.chart = draw_chart(outcome, self.timeline, self.s.chart_path)
        return outcome

    async def _body(self, cluster: LocalCluster, outcome: Outcome) -> None:
        self.echo(f"starting the control plane under {self.s.state_dir} ...")
        await cluster.start()
        self.echo(
            f"scaler {cluster.scaler_target}, coordinator {cluster.coordinator_target};"
            f" job {self.job_id} ({self.s.workload} example) on {self.s.start_replicas} workers"
        )
        async with (
            open_channel(
                cluster.scaler_target, credentials=cluster.credentials(admin_token=True)
            ) as sch,
            open_channel(
                cluster.coordinator_target, credentials=cluster.credentials(admin_token=True)
            ) as cch,
        ):
            # Typed for the sync API by the generator; on aio channels calls are awaitable.
            scaler: Any = scaler_pb2_grpc.ScalerStub(sch)
            coord: Any = coordinator_pb2_grpc.CoordinatorStub(cch)
            await self._start_job(cluster, scaler)
            node = cluster.add_node(
                LoadSettings(node_name="demo-gpu-node", gpus=self.s.max_replicas),
                pods_by_index(str(self.s.state_dir), self.job_id),
                self.s.warm_pct,
            )
            await self._drive(scaler, coord, node)
            outcome.decisions = await self.poller.details(scaler)

    async def _start_job(self, cluster: LocalCluster, scaler: Any) -> None:
        assert cluster.actuator is not None
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # The spec first: the scaler's actuator reads it to start the pods. The scaler
        # starts a new job itself: its JOB_STARTED decision asks the local actuator for
        # the pods, then the coordinator forms generation 1 (STARTING waits for it).
        cluster.actuator.write_spec(self.job_id, self.job_spec())
        await scaler.UpsertJob(
            scaler_pb2.UpsertJobRequest(
                job_id=self.job_id,
                policy=self.policy(),
                initial_replicas=self.s.start_replicas,
                gpus_per_replica=1,
            ),
            timeout=RPC_TIMEOUT_S,
        )

    async def _drive(self, scaler: Any, coord: Any, node: Any) -> None:
        s = self.s
        cycles_done = 0
        goal_at: float | None = None
        # Decisions of earlier phases: a phase's goal needs a decision of its own.
        earlier: set[int] = set()
        while self.phase not in (Phase.DONE, Phase.FAILED):
            snap = await self.poll(scaler, coord)
            self.show(snap)
            now = self.elapsed()
            self._check_services()
            if now > s.timeout_s:
                raise FailedPrecondition(
                    f"timed out after {s.timeout_s:g} s in phase {self.phase.value}"
                    f" (last evaluation: {snap.last_evaluation})"
                )
            if self.phase is Phase.STARTING:
                for d in snap.decisions:
                    if d.reason == "JOB_STARTED" and d.state in ("ABORTED", "FAILED"):
                        raise FailedPrecondition(
                            f"the job did not start: decision {d.id} {d.state}: {d.error}"
                        )
            if goal_at is None and goal_reached(self.phase, snap, s, earlier):
                goal_at = now
            hold = 0.0 if self.phase is Phase.STARTING else s.hold_s
            if goal_at is not None and now - goal_at >= hold:
                earlier = {d.id for d in snap.decisions}
                if self.phase is Phase.LOW:
                    cycles_done += 1
                self._move(next_phase(self.phase, cycles_done, s.cycles))
                self._level = s.high_pct if self.phase is Phase.HIGH else s.low_pct
                node.level_pct = self._level
                goal_at = None
            await asyncio.sleep(s.poll_interval_s)
        self.show(await self.poll(scaler, coord))

    def _check_services(self) -> None:
        """Fail fast, naming its log, when a service died under the demo."""
        assert self.cluster is not None
        for child in self.cluster.supervisor.children:
            if child.proc.returncode is not None:
                raise Unavailable(
                    f"{child.name} exited with code {child.proc.returncode}; see {child.log_path}"
                )

    async def poll(self, scaler: Any, coord: Any) -> Snapshot:
        return await self.poller.poll(scaler, coord, self.phase, self._level)
