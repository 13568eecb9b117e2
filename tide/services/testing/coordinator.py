"""The coordinator as the scaler sees it, without trainers: a CoordinatorClient double.

:class:`InMemoryCoordinator` follows docs/resize-protocol.md as far as the
scaler can tell: Resize is idempotent on decision_id (a finished one answers
its final progress again); a grow waits in WAITING_FOR_MEMBERS for the pods
the actuator asked for (``available``), then CHECKPOINTING and RENDEZVOUS; a
shrink goes CHECKPOINTING then RENDEZVOUS (DRAIN to the leavers goes out with
the stayers' RENDEZVOUS, so there is no DRAINING phase); AbortResize before
RENDEZVOUS resumes the old generation (ABORTED), in RENDEZVOUS it is too late
and answers the current phase while the resize completes. Given a path, its
state lives in a file, so it outlives a killed scaler the way the real
coordinator process would.

Nothing moves here, so no progress may pass for a real one: every final
progress carries :data:`NOTHING_MOVED` in its message and a pause of 0.
tests/scaler/test_coordinator_contract.py runs the same suite over this and
the real coordinator.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tide.base.errors import InvalidArgument, NotFound
from tide.services.scaler.coordination import JobStatusView, Phase, Progress, ResizeSpec
from tide.services.scaler.members import Member
from tide.services.testing.actuators import InMemoryActuator

#: In the message of every final progress (and so in every decision it ends).
NOTHING_MOVED = "in-memory coordinator: nothing moved"

#: Phases a resize passes before it is final.
GROW_PHASES = (Phase.WAITING_FOR_MEMBERS, Phase.CHECKPOINTING, Phase.RENDEZVOUS)
SHRINK_PHASES = (Phase.CHECKPOINTING, Phase.RENDEZVOUS)


@dataclass
class _Job:
    generation: int = 0
    world_size: int = 0
    step: int = 0
    lost_steps_total: int = 0
    finished: bool = False
    failure: str = ""


@dataclass
class _State:
    jobs: dict[str, _Job] = field(default_factory=dict)
    # decision id -> final progress (as a dict) once finished
    finished: dict[str, dict[str, object]] = field(default_factory=dict)


#: How long a save waits for another process's lock before it takes the holder
#: as paused and writes anyway.
LOCK_PATIENCE_S = 2.0


def _lock_unless_paused(fd: int) -> None:
    """Take the state file's lock, or go on without it after LOCK_PATIENCE_S.

    The failover tests SIGSTOP a scaler replica; one stopped inside its save
    would otherwise hold the lock, and every other replica's loop would block
    in flock behind it for as long as the pause (a paused client never blocks a
    real coordinator). A save taken without the lock can be overwritten by the
    paused one when it wakes; the merge by generation puts the newer job back
    at the next save."""
    deadline = time.monotonic() + LOCK_PATIENCE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)


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
        # job -> samples/s the job's trainers report at a world size (its scaling curve);
        # a job without one reports 0, as trainers that send no rate.
        self.throughput: dict[str, Callable[[int], float]] = {}
        self._state = self._load()
        self._running: dict[int, asyncio.Task[Progress]] = {}
        self._abort: dict[int, str] = {}
        self._phase: dict[int, Phase] = {}
        self._entered: dict[int, list[Phase]] = {}
        self._watchers: dict[str, list[asyncio.Queue[list[Member]]]] = {}
        self._members: dict[str, list[Member]] = {}
        for job_id, job in self._state.jobs.items():
            self._set_members(job_id, job.world_size)

    # -- state ---------------------------------------------------------------------------

    def _load(self) -> _State:
        if self.path is None or not self.path.exists():
            return _State()
        doc = json.loads(self.path.read_text())
        return _State(jobs={k: _Job(**v) for k, v in doc["jobs"].items()}, finished=doc["finished"])

    def _save(self) -> None:
        """Write the state, merged with what other processes wrote since it was read.

        Several scaler processes share one file (tests/scaler/test_sharded.py, a
        replica per process, each resizing its own jobs). Each writes under an
        exclusive lock, through a temporary file of its own, and keeps the file's
        entry of a job whose generation is newer than its own: with one shared
        temporary name, two writers truncated each other's file and the second
        ``os.replace`` found it gone (FileNotFoundError inside a resize), and
        writing the whole state over the file put back other replicas' jobs as this
        process last read them."""
        if self.path is None:
            return
        with open(self.path.with_suffix(".lock"), "a") as lock:
            _lock_unless_paused(lock.fileno())
            jobs = {k: asdict(v) for k, v in self._state.jobs.items()}
            finished = dict(self._state.finished)
            if self.path.exists():
                theirs = json.loads(self.path.read_text())
                for k, v in theirs["jobs"].items():
                    if k not in jobs or v["generation"] > jobs[k]["generation"]:
                        jobs[k] = v
                finished = {**theirs["finished"], **finished}
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump({"jobs": jobs, "finished": finished}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def set_job(self, job_id: str, world_size: int, generation: int = 1) -> None:
        """A job running ``world_size`` members in ``generation`` (as if its pods registered)."""
        self._state.jobs[job_id] = _Job(generation, world_size)
        self._set_members(job_id, world_size)
        self._save()

    def adopt(self, job_id: str, replicas: int) -> None:
        """An actuator's adopt listener: a job recorded as running has a first generation;
        one not known yet and starting (0 replicas) gets it from its first Resize."""
        if replicas > 0 and self.job(job_id)[1] == 0:
            self.set_job(job_id, replicas)

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

    # -- CoordinatorClient -------------------------------------------------------------------

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        self.calls.append(spec)
        if spec.world_multiple > 1 and spec.target_world_size % spec.world_multiple:
            # As the coordinator's start_resize refuses it (INVALID_ARGUMENT).
            raise InvalidArgument(
                f"target_world_size: {spec.target_world_size} is not a multiple of"
                f" world_multiple {spec.world_multiple}"
            )
        if self.path is not None and not self._running:
            # The file is the coordinator's store: another scaler replica may have
            # driven resizes since this one read it.
            self._state = self._load()
        done = self._state.finished.get(str(spec.decision_id))
        if done is not None:
            yield _progress_from(done)
            return
        task = self._running.get(spec.decision_id)
        if task is None:
            task = asyncio.create_task(self._run(spec))
            self._running[spec.decision_id] = task
        # Every phase entered is reported, however fast the phases pass.
        entered = self._entered.setdefault(spec.decision_id, [])
        sent = 0
        while True:
            while sent < len(entered):
                yield Progress(spec.decision_id, entered[sent])
                sent += 1
            if task.done():
                break
            await asyncio.wait({task}, timeout=0.01)
        yield task.result()

    async def _run(self, spec: ResizeSpec) -> Progress:
        job = self._state.jobs.setdefault(spec.job_id, _Job())
        did = spec.decision_id
        grow = spec.target_world_size > job.world_size
        fail = self.fail_at.pop(spec.job_id, None)
        world = spec.target_world_size
        result: Progress | None = None
        for phase in GROW_PHASES if grow else SHRINK_PHASES:
            # Checked before a phase is entered: once in RENDEZVOUS, abort_resize
            # no longer asks (too late), as with the real coordinator.
            if did in self._abort:
                result = self._aborted(did, job, f"aborted: {self._abort.pop(did)}")
                break
            self._phase[did] = phase
            self._entered.setdefault(did, []).append(phase)
            if fail is phase:
                result = self._aborted(did, job, f"barrier missed its deadline in {phase.name}")
                break
            if phase is Phase.WAITING_FOR_MEMBERS and self.available is not None:
                have = await self._wait_members(spec, world)
                if did in self._abort:
                    result = self._aborted(did, job, f"aborted: {self._abort.pop(did)}")
                    break
                if have < world:
                    if have < (spec.min_world_size or world):
                        result = self._aborted(did, job, f"only {have} of {world} members arrived")
                        break
                    world = have
            if self.step_s:
                await asyncio.sleep(self.step_s)
        if result is None:
            job.generation += 1
            job.world_size = world
            self._set_members(spec.job_id, world)
            result = Progress(
                did,
                Phase.COMPLETED,
                job.generation,
                world,
                checkpoint_step=job.step,
                message=NOTHING_MOVED,
            )
        self._state.finished[str(did)] = _progress_doc(result)
        self._save()
        self._phase.pop(did, None)
        self._entered.pop(did, None)
        return result

    async def _wait_members(self, spec: ResizeSpec, world: int) -> int:
        assert self.available is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + spec.deadline_s
        # The pod count has no event to wait on; polling it is the model.
        while True:
            have = self.available(spec.job_id) or 0
            if have >= world or loop.time() >= deadline or spec.decision_id in self._abort:
                return have
            await asyncio.sleep(0.01)

    @staticmethod
    def _aborted(did: int, job: _Job, why: str) -> Progress:
        return Progress(
            did, Phase.ABORTED, job.generation, job.world_size, message=f"{why}; {NOTHING_MOVED}"
        )

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase:
        done = self._state.finished.get(str(decision_id))
        if done is not None:
            return _progress_from(done).phase
        task = self._running.get(decision_id)
        if task is None:
            # Never started here: record it as aborted so a late Resize cannot start it.
            job = self._state.jobs.get(job_id, _Job())
            self._state.finished[str(decision_id)] = _progress_doc(
                self._aborted(decision_id, job, f"aborted: {reason}")
            )
            self._save()
            return Phase.ABORTED
        phase = self._phase.get(decision_id)
        if phase is Phase.RENDEZVOUS:
            # Too late: the leavers are exiting; the resize is carried to completion.
            return phase
        self._abort[decision_id] = reason
        return (await task).phase

    async def job_status(self, job_id: str) -> JobStatusView:
        st = self.latest_status(job_id)
        if st is None:
            raise NotFound(f"job {job_id!r} not found")
        return st

    def latest_status(self, job_id: str) -> JobStatusView | None:
        if job_id not in self._state.jobs:
            return None
        g, w = self.job(job_id)
        rate = self.throughput.get(job_id)
        return JobStatusView(
            job_id,
            g,
            w,
            tuple(self._members.get(job_id, [])),
            samples_per_s=rate(w) if rate is not None and w > 0 else 0.0,
            lost_steps_total=self._state.jobs[job_id].lost_steps_total,
            finished=self._state.jobs[job_id].finished,
            failure=self._state.jobs[job_id].failure,
        )

    def lose_member(self, job_id: str, lost_steps: int) -> None:
        """A member lost without notice: the rest re-form one smaller, as the real
        coordinator's recovery does, having lost ``lost_steps``."""
        job = self._state.jobs[job_id]
        job.generation += 1
        job.world_size -= 1
        job.lost_steps_total += lost_steps
        self._set_members(job_id, job.world_size)
        self._save()

    def request_leave(self, job_id: str, index: int, deadline_s: float | None = None) -> None:
        """Member ``index``'s launcher got SIGTERM and asks for a coordinated leave, its
        grace ending at ``deadline_s`` (unix seconds) when it says."""
        ms = self._members[job_id]
        ms[index] = replace(ms[index], leave_requested=True, leave_deadline_s=deadline_s)
        for q in self._watchers.get(job_id, []):
            q.put_nowait(list(ms))

    def finish(self, job_id: str) -> None:
        """Every member finished its training budget."""
        self._state.jobs[job_id].finished = True
        self._save()

    def fail(self, job_id: str, why: str) -> None:
        """The job failed for good (its restart budget spent)."""
        self._state.jobs[job_id].failure = why
        self._save()

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


def follow_actuator(coordinator: InMemoryCoordinator, actuator: InMemoryActuator) -> None:
    """Wire the pair as a cluster would: the coordinator counts the actuator's pods
    (a grow waits for them) and learns each running job the actuator adopts."""
    coordinator.available = lambda j: actuator.replicas.get(j)
    actuator.on_adopt.append(coordinator.adopt)
