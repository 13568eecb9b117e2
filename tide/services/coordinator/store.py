"""Persistence seam of the coordinator: what it saves, in one unit per operation,
and what it reloads after a restart.

Two implementations with the same semantics: :class:`MemoryStore` here (tests,
and the embedded mode without a database) and
:class:`tide.services.coordinator.sql_store.SqlStore`. Both check the version of the
rows several writers could touch (job, member, resize), so a second coordinator
writing the same job fails with Conflict instead of silently splitting it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

from tide.base.errors import Conflict
from tide.services.coordinator.domain import (
    Checkpoint,
    Directive,
    Generation,
    JobRecord,
    Member,
    Resize,
)


@dataclass
class Unit:
    """Everything one coordinator operation changed, committed in one transaction."""

    job: JobRecord | None = None
    members: list[Member] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    resizes: list[Resize] = field(default_factory=list)
    directives: list[Directive] = field(default_factory=list)

    def add(self, obj: JobRecord | Member | Generation | Checkpoint | Resize | Directive) -> None:
        """Include ``obj`` in the unit (once; the list keeps the order of first change)."""
        if isinstance(obj, JobRecord):
            self.job = obj
            return
        rows: list[Any]
        if isinstance(obj, Member):
            rows = self.members
        elif isinstance(obj, Generation):
            rows = self.generations
        elif isinstance(obj, Checkpoint):
            rows = self.checkpoints
        elif isinstance(obj, Resize):
            rows = self.resizes
        else:
            rows = self.directives
        _add_once(rows, obj)

    def empty(self) -> bool:
        return not (
            self.job
            or self.members
            or self.generations
            or self.checkpoints
            or self.resizes
            or self.directives
        )


def _add_once(rows: list[Any], obj: object) -> None:
    if not any(x is obj for x in rows):
        rows.append(obj)


@dataclass
class JobSnapshot:
    job: JobRecord
    members: list[Member]
    generations: list[Generation]
    checkpoints: list[Checkpoint]
    resizes: list[Resize]
    directives: list[Directive]


class CoordinatorStore(Protocol):
    def save(self, unit: Unit) -> None:
        """Commit ``unit`` atomically. Bumps ``version`` on the job, members and
        resizes it saves; raises Conflict if one changed since it was read, and
        Unavailable if the database cannot be reached."""
        ...

    def load_all(self) -> list[JobSnapshot]:
        """Every job the coordinator knows, as last committed."""
        ...


def _check_version(kind: str, key: object, stored: int | None, given: int) -> None:
    current = 0 if stored is None else stored
    if current != given:
        raise Conflict(
            f"{kind} {key} was changed by another writer (version {current}, expected {given})"
        )


class MemoryStore:
    """An in-memory store with the SQL store's semantics: atomic units, version
    checks, and reloads that return copies of what was committed."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._members: dict[str, Member] = {}
        self._generations: dict[tuple[str, int], Generation] = {}
        self._checkpoints: dict[tuple[str, int, int], Checkpoint] = {}
        self._resizes: dict[int, Resize] = {}
        self._directives: dict[tuple[str, str], Directive] = {}
        self.commits = 0

    def save(self, unit: Unit) -> None:
        # Check every version first so a conflict leaves nothing half-written.
        if unit.job is not None:
            old_job = self._jobs.get(unit.job.job_id)
            _check_version(
                "job", unit.job.job_id, old_job.version if old_job else None, unit.job.version
            )
        for m in unit.members:
            old_m = self._members.get(m.member_id)
            _check_version("member", m.member_id, old_m.version if old_m else None, m.version)
        for r in unit.resizes:
            old_r = self._resizes.get(r.decision_id)
            _check_version("resize", r.decision_id, old_r.version if old_r else None, r.version)
        if unit.job is not None:
            unit.job.version += 1
            self._jobs[unit.job.job_id] = copy.deepcopy(unit.job)
        for m in unit.members:
            m.version += 1
            self._members[m.member_id] = copy.deepcopy(m)
        for r in unit.resizes:
            r.version += 1
            self._resizes[r.decision_id] = copy.deepcopy(r)
        for g in unit.generations:
            self._generations[(g.job_id, g.generation)] = copy.deepcopy(g)
        for c in unit.checkpoints:
            self._checkpoints[(c.job_id, c.step, c.generation)] = copy.deepcopy(c)
        for d in unit.directives:
            self._directives[(d.job_id, d.directive_id)] = copy.deepcopy(d)
        self.commits += 1

    def load_all(self) -> list[JobSnapshot]:
        out = []
        for job_id, job in self._jobs.items():
            out.append(
                JobSnapshot(
                    job=copy.deepcopy(job),
                    members=[
                        copy.deepcopy(m) for m in self._members.values() if m.job_id == job_id
                    ],
                    generations=sorted(
                        (
                            copy.deepcopy(g)
                            for g in self._generations.values()
                            if g.job_id == job_id
                        ),
                        key=lambda g: g.generation,
                    ),
                    checkpoints=sorted(
                        (
                            copy.deepcopy(c)
                            for c in self._checkpoints.values()
                            if c.job_id == job_id
                        ),
                        key=lambda c: (c.step, c.generation),
                    ),
                    resizes=sorted(
                        (copy.deepcopy(r) for r in self._resizes.values() if r.job_id == job_id),
                        key=lambda r: r.started_at,
                    ),
                    directives=[
                        copy.deepcopy(d) for d in self._directives.values() if d.job_id == job_id
                    ],
                )
            )
        return out
