"""Actuator doubles (tide.services.scaler.actuators.Actuator) for tests and benchmarks.

An in-memory actuator that records every change, and a file-backed one whose
state and change log survive a SIGKILL of the scaler (the crash tests count
changes across restarts with it) and are shared by scaler replicas. Both pass the same contract suite as the
real actuators (tests/scaler/test_actuator_contract.py).

``set_replicas`` is idempotent: asking for the count a job already has is not
a change and is not recorded, so a resumed decision may repeat it safely.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tide.base.errors import InvalidArgument
from tide.services.scaler.actuators import check_still_leading

#: Told of each job the actuator adopts: (job id, its recorded replicas).
AdoptListener = Callable[[str, int], None]


@dataclass(frozen=True)
class ReplicaChange:
    job_id: str
    old: int
    new: int
    decision_id: int
    # Wall time a FileActuator recorded it (the crash tests' "nothing acts
    # before its commit"); None in memory. Not part of a change's identity.
    at: float | None = field(default=None, compare=False)


class InMemoryActuator:
    """Replica counts in a dict, every change appended to ``changes``.

    ``total_gpus`` (None: unlimited) and each job's GPUs per replica give
    ``free_gpus``; a grow beyond it is accepted (pods would stay Pending, as
    in a real cluster), the policy is what keeps within capacity.
    """

    def __init__(self, total_gpus: int | None = None) -> None:
        self.total_gpus = total_gpus
        self.replicas: dict[str, int] = {}
        self.gpus_per_replica: dict[str, int] = {}
        self.changes: list[ReplicaChange] = []
        #: Every ``remove_pods`` that changed the count: (job, pods named, decision id).
        self.removed: list[tuple[str, tuple[str, ...], int]] = []
        # The in-memory coordinator learns a running job's first generation here
        # (tide.services.testing.scaler wires it), as a real one would from its pods.
        self.on_adopt: list[AdoptListener] = []

    def adopt(self, job_id: str, *, replicas: int, gpus_per_replica: int) -> None:
        self.seed(job_id, replicas)
        self.gpus_per_replica[job_id] = gpus_per_replica
        for listener in self.on_adopt:
            listener(job_id, self.replicas[job_id])

    def seed(self, job_id: str, replicas: int) -> None:
        """Set a job's starting count without recording a change (the job's creation)."""
        self.replicas.setdefault(job_id, replicas)

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        if replicas < 0:
            raise InvalidArgument(f"job {job_id}: replicas must be >= 0, got {replicas}")
        check_still_leading(job_id, decision_id)
        old = self.replicas.get(job_id, 0)
        if old == replicas:
            return
        self.replicas[job_id] = replicas
        self.changes.append(ReplicaChange(job_id, old, replicas, decision_id))

    async def remove_pods(
        self, job_id: str, pods: Sequence[str], *, replicas: int, decision_id: int
    ) -> None:
        # Pods have no identity here: the names are recorded with the count's change.
        before = len(self.changes)
        await self.set_replicas(job_id, replicas, decision_id=decision_id)
        if len(self.changes) > before:
            self.removed.append((job_id, tuple(pods), decision_id))

    async def get_replicas(self, job_id: str) -> int | None:
        return self.replicas.get(job_id)

    async def free_gpus(self) -> int | None:
        if self.total_gpus is None:
            return None
        used = sum(n * self.gpus_per_replica.get(j, 1) for j, n in self.replicas.items())
        return max(0, self.total_gpus - used)


class FileActuator(InMemoryActuator):
    """An InMemoryActuator whose state lives on disk, one file per change.

    Change N is the file ``<path>.d/<N>.json``, written aside, fsynced and
    linked into place before ``set_replicas`` returns; ``link`` fails if N is
    taken, which makes it a compare-and-set on the log's length. No lock is
    held across the write: a replica paused mid-change (SIGSTOP, the failover
    tests) must not block the others, as a paused client never blocks an API
    server. An flock here once froze the new leader behind the paused one.
    """

    def __init__(self, path: Path, total_gpus: int | None = None) -> None:
        super().__init__(total_gpus)
        self.path = path
        for change in read_changes(path):
            self.replicas[change.job_id] = change.new
            if change.old != change.new:
                self.changes.append(change)

    def seed(self, job_id: str, replicas: int) -> None:
        """Set a job's starting count without recording a change (the job's creation)."""
        self._reload()  # another replica may have created it, and changed it since
        if job_id not in self.replicas:
            self.replicas[job_id] = replicas
            _record(
                self.path, {"job_id": job_id, "old": replicas, "new": replicas, "decision_id": 0}
            )

    def _reload(self) -> int:
        """Read the file again; returns its line count, the state's version.

        The file is the cluster: another process (a second scaler replica) may have
        changed it since; acting on a stale count would record a change that a
        real operator, which holds one truth, never would."""
        changes = read_changes(self.path)
        for change in changes:
            self.replicas[change.job_id] = change.new
        return len(changes)

    async def get_replicas(self, job_id: str) -> int | None:
        self._reload()
        return await super().get_replicas(job_id)

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        # A compare-and-set on the file's version, as an update carrying the
        # resourceVersion it read: a writer that read before another's change (a
        # leader paused between its read and its write) reads again instead of
        # applying its change a second time.
        while True:
            check_still_leading(job_id, decision_id)
            version = self._reload()
            before = len(self.changes)
            await super().set_replicas(job_id, replicas, decision_id=decision_id)
            if len(self.changes) == before:
                return
            doc = asdict(self.changes[-1]) | {"at": time.time()}
            if _record(self.path, doc, expect_version=version):
                return
            self.changes.pop()


def record_change(path: Path, change: ReplicaChange) -> None:
    """A change made behind the actuator's back (someone scaling the job by hand)."""
    _record(path, asdict(change))


def _record(path: Path, doc: dict[str, object], expect_version: int | None = None) -> bool:
    """Record one change as number ``expect_version`` (the log's length it
    read), or as the next free number when None; False if that number is
    taken (another writer got there first)."""
    log = _log_dir(path)
    log.mkdir(parents=True, exist_ok=True)
    tmp = log / f".{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(doc).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        number = len(_entries(log)) if expect_version is None else expect_version
        while True:
            try:
                os.link(tmp, log / f"{number:09d}.json")
            except FileExistsError:
                if expect_version is not None:
                    return False
                number += 1
                continue
            dir_fd = os.open(log, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the link itself, so a crash keeps the change
            finally:
                os.close(dir_fd)
            return True
    finally:
        os.unlink(tmp)


def _log_dir(path: Path) -> Path:
    return path.with_name(path.name + ".d")


def _entries(log: Path) -> list[Path]:
    if not log.is_dir():
        return []
    return sorted(p for p in log.iterdir() if p.name.endswith(".json"))


def read_changes(path: Path) -> list[ReplicaChange]:
    """Every change a FileActuator at ``path`` recorded, in order (seeds have old == new)."""
    out = []
    for entry in _entries(_log_dir(path)):
        d = json.loads(entry.read_text())
        out.append(ReplicaChange(d["job_id"], d["old"], d["new"], d["decision_id"], d.get("at")))
    return out
