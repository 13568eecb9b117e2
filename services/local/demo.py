"""`tide demo`: an elastic Paddle job scaled up and down by synthetic GPU load, end to end.

1. `tide up`'s control plane starts under the state dir (coordinator, scaler
   with the local actuator), with a synthetic GPU node the demo drives.
2. The example model (trainer/examples/train_mlp.py) is registered with the
   scaler at 2 replicas; the scaler starts it (a JOB_STARTED decision 0 → 2:
   the local actuator starts the launchers, the coordinator forms generation 1).
3. HIGH: every GPU of the job reports ~95 %; after the sustain window the
   scaler decides 2 → 4, newcomers start and warm up, the job checkpoints at
   one step and re-forms with 4 workers.
4. LOW: ~15 %; after the cooldown and the sustain window the scaler decides
   4 → 2: a checkpoint, the two highest pods drain, the rest re-form.
5. The control plane stops; the summary lists each decision with its states
   and pause, the lost steps, and audits the trainer's sample log: every
   sample consumed exactly once. A PNG chart shows utilization, workers and
   the decisions.

The policy windows are short (sustain 10 s, bucket 2 s, cooldown 10 s; the goodput
guard off, since CPU workers on a shared machine rarely scale), so a
default run takes 1-2 minutes; ``--cycles`` and ``--hold-s`` make it longer.
Each run is a new job (``demo/run-N``) in the same store, so ``tide history
demo/run-N --db sqlite:///DIR/tide.db`` reads what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import grpc
from tide.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, scaler_pb2, scaler_pb2_grpc

import trainer
from services.local.chart import Marker, Series, draw
from services.local.load import LoadSettings, pods_by_index
from services.local.samples import SampleAudit, audit
from services.local.up import LocalCluster, UpSettings
from services.local.view import DecisionView, Snapshot
from services.scaler.actuators.local import JobSpec, job_dir_name
from tidebase.client import open_channel
from tidebase.errors import ConfigError, FailedPrecondition, TideError, Unavailable
from tidebase.lifecycle import TransitionTable
from tidebase.timeconv import datetime_of, ts_from_datetime

logger = logging.getLogger(__name__)

ROOT = Path(trainer.__file__).resolve().parent.parent
EXAMPLE = ROOT / "trainer" / "examples" / "train_mlp.py"
# Generous: on two shared cores a worker restart can starve the services for a while.
RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DemoSettings:
    state_dir: Path = Path(".tide")
    start_replicas: int = 2
    max_replicas: int = 4
    warm_pct: float = 60.0
    high_pct: float = 95.0
    low_pct: float = 15.0
    sustain_s: float = 10.0
    bucket_s: float = 2.0
    cooldown_s: float = 10.0
    # Stay this long in each phase after it reached its goal (a longer demo).
    hold_s: float = 0.0
    # High/low cycles.
    cycles: int = 1
    # The whole run gives up after this long, seconds.
    timeout_s: float = 170.0
    # Training: a stand-in for heavier compute per step keeps the CPUs shared.
    step_delay_s: float = 0.05
    dataset_size: int = 4096
    global_batch: int = 64
    seed: int = 0
    poll_interval_s: float = 0.5
    chart: Path | None = None
    # Format of the services' and launchers' logs under STATE_DIR/logs.
    log_format: str = "text"
    # mTLS on every link (False: --insecure) and an optional admin token file; UpSettings'.
    tls: bool = True
    admin_token_file: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.start_replicas < self.max_replicas <= 16:
            raise ConfigError(
                f"start_replicas/max_replicas: need 1 <= start < max <= 16, got"
                f" {self.start_replicas}/{self.max_replicas}"
            )
        if not self.low_pct < 40 < self.warm_pct < 80 < self.high_pct <= 100:
            raise ConfigError(
                "low_pct/warm_pct/high_pct: need low < 40 < warm < 80 < high <= 100, got"
                f" {self.low_pct}/{self.warm_pct}/{self.high_pct}"
            )
        for name in ("sustain_s", "bucket_s", "timeout_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("cooldown_s", "hold_s", "step_delay_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.cycles < 1:
            raise ConfigError(f"cycles: must be >= 1, got {self.cycles}")
        if not 1 <= self.global_batch <= self.dataset_size:
            raise ConfigError(
                f"global_batch: must be 1..dataset_size ({self.dataset_size}),"
                f" got {self.global_batch}"
            )

    @property
    def chart_path(self) -> Path:
        return self.chart or self.state_dir / "demo.png"


class Phase(enum.Enum):
    """STARTING → HIGH → LOW (→ HIGH → LOW ... for more cycles) → DONE; any → FAILED."""

    STARTING = "starting"
    HIGH = "high load"
    LOW = "low load"
    DONE = "done"
    FAILED = "failed"


DEMO_LIFECYCLE: Final = TransitionTable[Phase](
    "demo phase",
    {
        # The first generation runs: drive the load up.
        Phase.STARTING: {Phase.HIGH, Phase.FAILED},
        # The grow completed: drive it down.
        Phase.HIGH: {Phase.LOW, Phase.FAILED},
        # The shrink completed: another cycle, or the end.
        Phase.LOW: {Phase.HIGH, Phase.DONE, Phase.FAILED},
        Phase.DONE: (),
        Phase.FAILED: (),
    },
)


def next_job_id(state_dir: Path) -> str:
    """``demo/run-N``, one more than the runs already in the state dir."""
    runs = [
        int(d.name.removeprefix("demo__run-"))
        for d in (state_dir / "jobs").glob("demo__run-*")
        if d.name.removeprefix("demo__run-").isdigit()
    ]
    return f"demo/run-{max(runs, default=0) + 1}"


def _state(v: int) -> str:
    return str(common_pb2.DecisionState.Name(v)).removeprefix("DECISION_STATE_")  # type: ignore[arg-type]


def _reason(v: int) -> str:
    return str(common_pb2.DecisionReason.Name(v)).removeprefix("DECISION_REASON_")  # type: ignore[arg-type]


def goal_reached(phase: Phase, snap: Snapshot, s: DemoSettings, earlier: set[int]) -> bool:
    """STARTING: the first generation trains. HIGH/LOW: a grow/shrink decided in this
    phase completed and the job is at the top/bottom size."""
    if phase is Phase.STARTING:
        return snap.generation >= 1 and snap.step > 0
    if phase not in (Phase.HIGH, Phase.LOW):
        return False
    grow = phase is Phase.HIGH
    target = s.max_replicas if grow else s.start_replicas
    return snap.replicas == target and any(
        d.state == "COMPLETED" and d.id not in earlier and (d.to_replicas > d.from_replicas) == grow
        for d in snap.decisions
    )


def next_phase(phase: Phase, cycles_done: int, cycles: int) -> Phase:
    """Where a phase whose goal was reached leads (cycles_done counts finished LOW phases)."""
    if phase is Phase.STARTING:
        return Phase.HIGH
    if phase is Phase.HIGH:
        return Phase.LOW
    if phase is Phase.LOW:
        return Phase.HIGH if cycles_done < cycles else Phase.DONE
    raise FailedPrecondition(f"demo phase {phase.value} has no successor")


@dataclass
class Outcome:
    job_id: str
    phase: Phase
    elapsed_s: float
    decisions: list[scaler_pb2.DecisionDetail] = field(default_factory=list)
    audit: SampleAudit | None = None
    chart: Path | None = None
    error: str = ""

    @property
    def lost_steps(self) -> int:
        decided = sum(d.decision.lost_steps for d in self.decisions)
        redone = len(self.audit.repeated_steps) if self.audit else 0
        return decided + redone

    @property
    def ok(self) -> bool:
        return (
            self.phase is Phase.DONE
            and self.audit is not None
            and self.audit.exactly_once
            and self.lost_steps == 0
        )


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
        self.trails: dict[int, list[tuple[str, float]]] = {}
        # (time, window mean, replicas) per poll, for the chart.
        self.timeline: list[tuple[datetime, float | None, int]] = []
        self.cluster: LocalCluster | None = None
        self._level = settings.warm_pct
        # The last answers, kept when a poll fails so the view does not drop to zero.
        self._job: Any = None
        self._status: Any = None
        self._decisions: list[Any] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _move(self, new: Phase) -> None:
        DEMO_LIFECYCLE.check(self.phase, new, what=self.job_id)
        logger.info("demo %s: phase %s -> %s", self.job_id, self.phase.value, new.value)
        self.phase = new

    def up_settings(self) -> UpSettings:
        s = self.s
        return UpSettings(
            state_dir=s.state_dir,
            scaler_listen="127.0.0.1:0",
            coordinator_listen="127.0.0.1:0",
            total_gpus=s.max_replicas,
            log_level="INFO",
            log_format=s.log_format,
            tls=s.tls,
            admin_token_file=s.admin_token_file,
            # Fast evaluation and short staleness, so the short windows act promptly.
            scaler_flags=(
                "--evaluate-interval-s",
                "0.5",
                "--rollup-flush-interval-s",
                "5",
                "--stale-after-s",
                "5",
            ),
            # Heartbeats every second and a short checkpoint lead keep the pause small.
            coordinator_flags=(
                "--heartbeat-interval-s",
                "1",
                "--checkpoint-lead-s",
                "1.5",
                "--heartbeat-timeout-s",
                "60",
            ),
        )

    def job_spec(self) -> JobSpec:
        s = self.s
        return JobSpec(
            command=(
                sys.executable,
                str(EXAMPLE),
                "--dataset-size",
                str(s.dataset_size),
                "--global-batch",
                str(s.global_batch),
                "--seed",
                str(s.seed),
                "--steps",
                "10000000",
                "--ckpt-dir",
                str(self.ckpt_dir.resolve()),
                "--ckpt-every-steps",
                "50",
                "--keep",
                "3",
                "--log-dir",
                str(self.samples_dir.resolve()),
                "--step-delay-s",
                str(s.step_delay_s),
            ),
            cwd=str(ROOT),
            gpus_per_replica=1,
        )

    def policy(self) -> scaler_pb2.Policy:
        s = self.s
        return scaler_pb2.Policy(
            sustain_s=s.sustain_s,
            bucket_s=s.bucket_s,
            cooldown_s=s.cooldown_s,
            scale_down_stabilization_s=0.0,
            min_replicas=s.start_replicas,
            max_replicas=s.max_replicas,
            max_step=s.max_replicas,
            phase_timeout_s=60.0,
            # The demo shows the resize, on CPUs shared with whatever else runs here, where
            # 4 workers are often no faster than 2: the goodput guard would rightly revert
            # the grow (SLOWER_AFTER_SCALE_UP) before the low phase shrinks it.
            min_scale_up_efficiency=0.0,
        )

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
        outcome.chart = self._chart(outcome)
        return outcome

    async def _body(self, cluster: LocalCluster, outcome: Outcome) -> None:
        self.echo(f"starting the control plane under {self.s.state_dir} ...")
        await cluster.start()
        self.echo(
            f"scaler {cluster.scaler_target}, coordinator {cluster.coordinator_target};"
            f" job {self.job_id} on {self.s.start_replicas} workers"
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
            outcome.decisions = await self._details(scaler)

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
        try:
            job = await scaler.GetJob(
                scaler_pb2.GetJobRequest(job_id=self.job_id), timeout=RPC_TIMEOUT_S
            )
            resp = await scaler.ListDecisions(
                scaler_pb2.ListDecisionsRequest(
                    job_id=self.job_id, since=ts_from_datetime(self.started_at), page_size=100
                ),
                timeout=RPC_TIMEOUT_S,
            )
            self._job = job
            self._decisions = sorted(resp.decisions, key=lambda d: d.id)
        except grpc.aio.AioRpcError as exc:
            logger.warning("demo %s: scaler poll failed: %s", self.job_id, exc.details())
        try:
            self._status = await coord.GetJobStatus(
                coordinator_pb2.GetJobStatusRequest(job_id=self.job_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            # The coordinator learns of the job when its first launcher registers: until
            # then NOT_FOUND is the expected answer, not a warning before the first line.
            if exc.code() is not grpc.StatusCode.NOT_FOUND:
                logger.warning("demo %s: coordinator poll failed: %s", self.job_id, exc.details())
        job, status, decisions = self._job, self._status, self._decisions
        now = self.elapsed()
        views = []
        for d in decisions:
            trail = self.trails.setdefault(d.id, [])
            state = _state(d.state)
            if not trail or trail[-1][0] != state:
                trail.append((state, now))
            views.append(
                DecisionView(
                    d.id,
                    d.from_replicas,
                    d.to_replicas,
                    _reason(d.reason),
                    state,
                    tuple(trail),
                    d.pause_s,
                    d.lost_steps,
                    d.error,
                )
            )
        mean = (
            job.window.mean_pct
            if job is not None and job.HasField("window") and job.window.HasField("mean_pct")
            else None
        )
        mean = mean if mean is not None and math.isfinite(mean) else None
        ev = job.last_evaluation if job is not None else None
        resize = ""
        if status is not None and status.HasField("active_resize"):
            ar = status.active_resize
            if ar.phase and ar.phase < coordinator_pb2.RESIZE_PHASE_COMPLETED:
                resize = str(coordinator_pb2.ResizePhase.Name(ar.phase)).removeprefix(
                    "RESIZE_PHASE_"
                )
        replicas = job.current_replicas if job is not None else 0
        self.timeline.append((datetime.now(tz=UTC), mean, replicas))
        return Snapshot(
            elapsed_s=now,
            phase=self.phase.value,
            load_pct=self._level,
            job_id=self.job_id,
            replicas=replicas,
            window_mean_pct=mean,
            coverage=job.window.coverage if job is not None and job.HasField("window") else None,
            generation=status.generation if status is not None else 0,
            world_size=status.world_size if status is not None else 0,
            step=status.step if status is not None else 0,
            samples_per_s=status.samples_per_s if status is not None else 0.0,
            resize_phase=resize,
            last_evaluation=(
                f"{_reason(ev.reason)}: {ev.message}" if ev is not None and ev.reason else ""
            ),
            decisions=tuple(views),
        )

    async def _details(self, scaler: Any) -> list[Any]:
        out = []
        for did in sorted(self.trails):
            out.append(
                await scaler.GetDecision(
                    scaler_pb2.GetDecisionRequest(id=did, context_minutes=5),
                    timeout=RPC_TIMEOUT_S,
                )
            )
        return out

    def _chart(self, outcome: Outcome) -> Path | None:
        if not self.timeline:
            return None
        markers = []
        for d in outcome.decisions:
            created = datetime_of(d.decision.created_at)
            markers.append(
                Marker(
                    created,
                    f"#{d.decision.id} {d.decision.from_replicas}→{d.decision.to_replicas}",
                    _state(d.decision.state),
                )
            )
        series = Series(
            utilization=[(t, u) for t, u, _ in self.timeline if u is not None],
            utilization_band=[],
            replicas=[(t, r) for t, _, r in self.timeline if r],
            markers=markers,
        )
        try:
            return draw(
                series,
                self.s.chart_path,
                title=f"tide demo {self.job_id}: GPU utilization, replicas, decisions",
                scale_up_pct=80.0,
                scale_down_pct=40.0,
            )
        except OSError as exc:
            logger.warning("demo %s: cannot write the chart: %s", self.job_id, exc)
            return None


def summary_lines(outcome: Outcome, state_dir: Path) -> list[str]:
    lines = [
        f"demo {outcome.job_id}: {'OK' if outcome.ok else 'FAILED'} in {outcome.elapsed_s:.0f} s"
        + (f" ({outcome.error})" if outcome.error else "")
    ]
    for detail in outcome.decisions:
        d = detail.decision
        t0 = datetime_of(d.created_at)
        trail = " → ".join(
            f"{_state(e.state)} +{(datetime_of(e.at) - t0).total_seconds():.1f}s"
            for e in detail.events
        )
        lines.append(
            f"  decision {d.id}: {d.from_replicas} → {d.to_replicas} ({_reason(d.reason)})"
            f" {_state(d.state)}; pause {d.pause_s:.2f} s; lost steps {d.lost_steps}"
        )
        lines.append(f"    {trail}")
        if d.error:
            lines.append(f"    error: {d.error}")
    if not outcome.decisions:
        lines.append("  no decisions were made")
    lines.append(f"  lost steps: {outcome.lost_steps}")
    if outcome.audit is not None:
        lines.append(f"  {outcome.audit.summary()}")
        if outcome.audit.unfinished_steps:
            lines.append(
                f"    (steps {', '.join(map(str, outcome.audit.unfinished_steps))} were in"
                " flight when the demo stopped the job; not counted)"
            )
    else:
        lines.append("  no sample log to audit")
    if outcome.chart is not None:
        lines.append(f"  chart: {outcome.chart}")
    db = f"sqlite:///{(state_dir / 'tide.db').resolve()}"
    lines.append(f"  history: tide history {outcome.job_id} --db {db}")
    if outcome.decisions:
        lines.append(f"  explain: tide explain {outcome.decisions[0].decision.id} --db {db}")
    lines.append(f"  logs: {state_dir / 'logs'}")
    return lines
