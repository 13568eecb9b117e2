"""The scaler's view of the coordinator: Resize, AbortResize, GetJobStatus, WatchJob.

Domain types here, converted to and from tide.v1 at the gRPC client, so the
controller never touches protobuf. :class:`InMemoryCoordinator` has the
coordinator's semantics as docs/resize-protocol.md states them (idempotent on
decision_id, grow waits for newcomers, abort resumes the old generation) and,
given a path, keeps its state in a file so it outlives a killed scaler the
way the real coordinator process would.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from tide.v1 import coordinator_pb2, coordinator_pb2_grpc

from services.scaler.members import Member
from tidebase.client import domain_error
from tidebase.grpc_options import DEFAULT_TIMEOUT_S

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Values equal tide.v1.ResizePhase."""

    WAITING_FOR_MEMBERS = 1
    CHECKPOINTING = 2
    DRAINING = 3
    RENDEZVOUS = 4
    COMPLETED = 5
    ABORTED = 6
    FAILED = 7

    @property
    def final(self) -> bool:
        return self in (Phase.COMPLETED, Phase.ABORTED, Phase.FAILED)


@dataclass(frozen=True)
class ResizeSpec:
    decision_id: int
    job_id: str
    target_world_size: int
    deadline_s: float
    leaving_pods: tuple[str, ...] = ()
    min_world_size: int = 0


@dataclass(frozen=True)
class Progress:
    decision_id: int
    phase: Phase
    generation: int = 0
    world_size: int = 0
    checkpoint_step: int = 0
    pause_s: float = 0.0
    lost_steps: int = 0
    message: str = ""


@dataclass(frozen=True)
class JobStatusView:
    job_id: str
    generation: int
    world_size: int
    members: tuple[Member, ...]
    step: int = 0
    samples_per_s: float = 0.0


class CoordinatorClient(Protocol):
    def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        """Start the resize, or re-attach to it; streams progress until a final phase."""
        ...

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase: ...

    async def job_status(self, job_id: str) -> JobStatusView: ...

    def watch_members(self, job_id: str) -> AsyncIterator[list[Member]]: ...

    def latest_status(self, job_id: str) -> JobStatusView | None:
        """The last status a member watch of the job saw (step, throughput); no call."""
        ...


# --- the in-memory coordinator ------------------------------------------------------------


@dataclass
class _Job:
    generation: int = 0
    world_size: int = 0
    step: int = 0


@dataclass
class _State:
    jobs: dict[str, _Job] = field(default_factory=dict)
    # decision id → final progress (as a dict) once finished
    finished: dict[str, dict[str, object]] = field(default_factory=dict)


class InMemoryCoordinator:
    """Coordinator semantics without trainers.

    ``available`` tells how many pods of a job exist (the actuator's count): a
    grow waits in WAITING_FOR_MEMBERS until that many are there, or until its
    deadline, then proceeds with at least ``min_world_size`` or aborts.
    ``step_s`` is how long each phase takes; ``fail_at`` makes the next resize
    of a job abort at a given phase.
    """

    def __init__(
        self,
        available: Callable[[str], int | None] | None = None,
        *,
        step_s: float = 0.0,
        path: Path | None = None,
    ) -> None:
        self.available = available
        self.step_s = step_s
        self.path = path
        self.fail_at: dict[str, Phase] = {}
        self.calls: list[ResizeSpec] = []
        self._state = self._load()
        self._running: dict[int, asyncio.Task[Progress]] = {}
        self._abort: dict[int, str] = {}
        self._phase: dict[int, Phase] = {}
        self._watchers: dict[str, list[asyncio.Queue[list[Member]]]] = {}
        self._members: dict[str, list[Member]] = {}

    def _load(self) -> _State:
        if self.path is None or not self.path.exists():
            return _State()
        doc = json.loads(self.path.read_text())
        return _State(jobs={k: _Job(**v) for k, v in doc["jobs"].items()}, finished=doc["finished"])

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {
            "jobs": {k: asdict(v) for k, v in self._state.jobs.items()},
            "finished": self._state.finished,
        }
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def set_job(self, job_id: str, world_size: int, generation: int = 1) -> None:
        self._state.jobs[job_id] = _Job(generation, world_size)
        self._set_members(job_id, world_size)
        self._save()

    def job(self, job_id: str) -> tuple[int, int]:
        """(generation, world size) of a job."""
        j = self._state.jobs.get(job_id, _Job())
        return j.generation, j.world_size

    def _set_members(self, job_id: str, n: int) -> None:
        name = job_id.partition("/")[2] or job_id
        ms = [Member(f"{name}-trainer-{i}", f"uid-{name}-{i}") for i in range(n)]
        self._members[job_id] = ms
        for q in self._watchers.get(job_id, []):
            q.put_nowait(list(ms))

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        self.calls.append(spec)
        done = self._state.finished.get(str(spec.decision_id))
        if done is not None:
            yield _progress_from(done)
            return
        task = self._running.get(spec.decision_id)
        if task is None:
            task = asyncio.create_task(self._run(spec))
            self._running[spec.decision_id] = task
        last: Phase | None = None
        while not task.done():
            phase = self._phase.get(spec.decision_id)
            if phase is not None and phase != last:
                last = phase
                yield Progress(spec.decision_id, phase)
            await asyncio.wait({task}, timeout=0.01)
        yield task.result()

    async def _run(self, spec: ResizeSpec) -> Progress:
        job = self._state.jobs.setdefault(spec.job_id, _Job())
        did = spec.decision_id
        grow = spec.target_world_size > job.world_size
        fail = self.fail_at.pop(spec.job_id, None)
        phases = (
            [Phase.WAITING_FOR_MEMBERS, Phase.CHECKPOINTING, Phase.RENDEZVOUS]
            if grow
            else [Phase.CHECKPOINTING, Phase.DRAINING, Phase.RENDEZVOUS]
        )
        world = spec.target_world_size
        result: Progress | None = None
        for phase in phases:
            self._phase[did] = phase
            if did in self._abort:
                result = Progress(
                    did,
                    Phase.ABORTED,
                    job.generation,
                    job.world_size,
                    message=f"aborted: {self._abort.pop(did)}",
                )
                break
            if fail is phase:
                result = Progress(
                    did,
                    Phase.ABORTED,
                    job.generation,
                    job.world_size,
                    message=f"barrier missed its deadline in {phase.name}",
                )
                break
            if phase is Phase.WAITING_FOR_MEMBERS and self.available is not None:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + spec.deadline_s
                # The pod count has no event to wait on; polling it is the model.
                while (self.available(spec.job_id) or 0) < world and loop.time() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                have = self.available(spec.job_id) or 0
                if have < world:
                    floor = spec.min_world_size or world
                    if have < floor:
                        result = Progress(
                            did,
                            Phase.ABORTED,
                            job.generation,
                            job.world_size,
                            message=f"only {have} of {world} members arrived",
                        )
                        break
                    world = have
            if self.step_s:
                await asyncio.sleep(self.step_s)
        if result is None:
            job.generation += 1
            job.world_size = world
            self._set_members(spec.job_id, world)
            result = Progress(
                did, Phase.COMPLETED, job.generation, world, checkpoint_step=job.step, pause_s=0.5
            )
        self._state.finished[str(did)] = _progress_doc(result)
        self._save()
        self._phase.pop(did, None)
        return result

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase:
        done = self._state.finished.get(str(decision_id))
        if done is not None:
            return _progress_from(done).phase
        task = self._running.get(decision_id)
        if task is None:
            # Never started here: record it as aborted so a late Resize cannot start it.
            g, w = self.job(job_id)
            self._state.finished[str(decision_id)] = _progress_doc(
                Progress(decision_id, Phase.ABORTED, g, w, message=f"aborted: {reason}")
            )
            self._save()
            return Phase.ABORTED
        self._abort[decision_id] = reason
        return (await task).phase

    async def job_status(self, job_id: str) -> JobStatusView:
        g, w = self.job(job_id)
        return JobStatusView(job_id, g, w, tuple(self._members.get(job_id, [])))

    def latest_status(self, job_id: str) -> JobStatusView | None:
        if job_id not in self._state.jobs:
            return None
        g, w = self.job(job_id)
        return JobStatusView(job_id, g, w, tuple(self._members.get(job_id, [])))

    async def watch_members(self, job_id: str) -> AsyncIterator[list[Member]]:
        q: asyncio.Queue[list[Member]] = asyncio.Queue()
        self._watchers.setdefault(job_id, []).append(q)
        try:
            yield list(self._members.get(job_id, []))
            while True:
                yield await q.get()
        finally:
            self._watchers[job_id].remove(q)


def _progress_doc(p: Progress) -> dict[str, object]:
    d = asdict(p)
    d["phase"] = p.phase.name
    return d


def _progress_from(d: dict[str, object]) -> Progress:
    return Progress(
        decision_id=int(str(d["decision_id"])),
        phase=Phase[str(d["phase"])],
        generation=int(str(d["generation"])),
        world_size=int(str(d["world_size"])),
        checkpoint_step=int(str(d["checkpoint_step"])),
        pause_s=float(str(d["pause_s"])),
        lost_steps=int(str(d["lost_steps"])),
        message=str(d["message"]),
    )


# --- the gRPC client --------------------------------------------------------------------------


class GrpcCoordinatorClient:
    """The real client. Errors come back as TideErrors (tidebase.client.domain_error)."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._timeout_s = timeout_s
        self._latest: dict[str, JobStatusView] = {}

    def latest_status(self, job_id: str) -> JobStatusView | None:
        return self._latest.get(job_id)

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        req = coordinator_pb2.ResizeRequest(
            decision_id=spec.decision_id,
            job_id=spec.job_id,
            target_world_size=spec.target_world_size,
            leaving_pods=list(spec.leaving_pods),
            deadline_s=spec.deadline_s,
            min_world_size=spec.min_world_size,
        )
        # The stream lasts as long as the resize: its deadline is the barrier's
        # plus room for the waits around it.
        call = self._stub.Resize(req, timeout=spec.deadline_s * 3 + 30.0)
        try:
            async for p in call:
                yield Progress(
                    decision_id=p.decision_id,
                    phase=Phase(p.phase) if p.phase else Phase.WAITING_FOR_MEMBERS,
                    generation=p.generation,
                    world_size=p.world_size,
                    checkpoint_step=p.checkpoint_step,
                    pause_s=p.pause_s,
                    lost_steps=p.lost_steps,
                    message=p.message,
                )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase:
        try:
            resp = await self._stub.AbortResize(
                coordinator_pb2.AbortResizeRequest(
                    decision_id=decision_id, job_id=job_id, reason=reason
                ),
                timeout=self._timeout_s,
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        return Phase(resp.phase) if resp.phase else Phase.ABORTED

    async def job_status(self, job_id: str) -> JobStatusView:
        try:
            st = await self._stub.GetJobStatus(
                coordinator_pb2.GetJobStatusRequest(job_id=job_id), timeout=self._timeout_s
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        return _status_view(st)

    async def watch_members(self, job_id: str) -> AsyncIterator[list[Member]]:
        # A watch lives until the coordinator goes away; keepalive notices a dead peer.
        call = self._stub.WatchJob(coordinator_pb2.GetJobStatusRequest(job_id=job_id))
        try:
            async for st in call:
                view = _status_view(st)
                self._latest[job_id] = view
                yield list(view.members)
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc


def _status_view(st: coordinator_pb2.JobStatus) -> JobStatusView:
    members = tuple(
        Member(m.pod_name, m.pod_uid, m.state == coordinator_pb2.MEMBER_STATE_ACTIVE)
        for m in st.members
        if m.state != coordinator_pb2.MEMBER_STATE_GONE
    )
    return JobStatusView(
        st.job_id, st.generation, st.world_size, members, st.step, st.samples_per_s
    )
