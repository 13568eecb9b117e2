"""One job's state as the engine holds it in memory, and the questions asked of it.

Read-only here: the phase handlers and the recovery rules read a :class:`JobState`
to decide, and only :mod:`tide.services.coordinator.engine.outbox` changes it (the
heartbeat's in-memory progress aside, which is never persisted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tide.services.coordinator.domain import (
    Checkpoint,
    Directive,
    DirectiveKind,
    Generation,
    JobRecord,
    Member,
    MemberState,
    RendezvousInfo,
    Resize,
    WorkerPhase,
    rank_order,
)
from tide.services.coordinator.errors import UnknownMember
from tide.services.coordinator.store import JobSnapshot


@dataclass
class JobState:
    job: JobRecord
    members: dict[str, Member] = field(default_factory=dict)
    generations: dict[int, Generation] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    resizes: dict[int, Resize] = field(default_factory=dict)
    # Committed directives, by id; streams only ever see these.
    directives: dict[str, Directive] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, snap: JobSnapshot) -> JobState:
        return cls(
            job=snap.job,
            members={m.member_id: m for m in snap.members},
            generations={g.generation: g for g in snap.generations},
            checkpoints=list(snap.checkpoints),
            resizes={r.decision_id: r for r in snap.resizes},
            directives={d.directive_id: d for d in sorted(snap.directives, key=lambda d: d.seq)},
        )

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def member(self, member_id: str) -> Member:
        m = self.members.get(member_id)
        if m is None:
            raise UnknownMember(f"member {member_id!r} is not known in job {self.job_id}")
        return m

    def active_resize(self) -> Resize | None:
        for r in self.resizes.values():
            if not r.phase.final:
                return r
        return None

    def current_members(self) -> list[Member]:
        """Members of the current generation still in it, in rank order."""
        ms = [
            m for m in self.members.values() if m.rank is not None and m.state != MemberState.GONE
        ]
        return sorted(ms, key=lambda m: m.rank or 0)

    def actives(self) -> list[Member]:
        return [m for m in self.current_members() if m.state == MemberState.ACTIVE]

    def standby(self) -> list[Member]:
        ms = [m for m in self.members.values() if m.state == MemberState.STANDBY]
        return sorted(ms, key=lambda m: (m.pod_index, m.pod_name))

    def running(self, m: Member) -> bool:
        return m.reported_generation == self.job.generation and m.phase in (
            WorkerPhase.RUNNING,
            WorkerPhase.HOLDING,
        )

    def last_good_step(self) -> int:
        return max((c.step for c in self.checkpoints if c.good), default=0)

    def checkpoint(self, step: int, generation: int) -> Checkpoint | None:
        for ck in self.checkpoints:
            if ck.step == step and ck.generation == generation:
                return ck
        return None

    def pending_directives(self, member_id: str) -> list[Directive]:
        """Unacknowledged committed directives of a member, in the order they were sent."""
        ds = [d for d in self.directives.values() if d.member_id == member_id and d.pending]
        return sorted(ds, key=lambda d: d.seq)

    def leavers_gone(self, r: Resize, besides: Sequence[str] = ()) -> bool:
        """Every leaver of ``r`` is GONE, or about to be (``besides``: leaving in this unit)."""
        return all(self.members[i].state == MemberState.GONE or i in besides for i in r.leaving)

    def next_members(self, r: Resize) -> tuple[Member, ...]:
        """g+1 of ``r`` in rank order: its participants that stay, then its newcomers."""
        stayers = [
            self.members[i]
            for i in r.participants
            if i not in r.leaving and self.members[i].state == MemberState.ACTIVE
        ]
        joining = [
            self.members[i] for i in r.newcomers if self.members[i].state == MemberState.STANDBY
        ]
        return rank_order(stayers, joining)

    def _barrier_checkpoints(self, r: Resize) -> list[Directive]:
        """The CHECKPOINTs of ``r``'s barrier (a resize has one barrier at most)."""
        return [
            d
            for d in self.directives.values()
            if d.kind == DirectiveKind.CHECKPOINT
            and d.member_id in r.participants
            and d.created_at >= r.started_at
        ]

    def barrier_commits(self, r: Resize) -> bool:
        """The barrier of ``r`` is a commit point: its CHECKPOINTs carried g+1's prepared
        RENDEZVOUS (overlap mode), so a member may have switched to its prepared worker at
        its hold, and g cannot be resumed once one held at (or past) the barrier's step."""
        return any(d.rendezvous is not None for d in self._barrier_checkpoints(r))

    def barrier_step(self, r: Resize) -> int:
        """The step ``r``'s CHECKPOINTs named: ``r.checkpoint_step`` unless the barrier moved
        to a later step where g held (a CHECKPOINT that came after g passed it)."""
        return min(
            (d.checkpoint_step for d in self._barrier_checkpoints(r)), default=r.checkpoint_step
        )

    def prepared_rendezvous(
        self, r: Resize, member_ids: Sequence[str]
    ) -> tuple[RendezvousInfo, ...]:
        """What the PREPAREs of ``r`` told ``member_ids`` (g+1 in rank order), if every one
        of them acked its PREPARE: their standby workers hold g+1's group. Empty otherwise
        (no PREPARE, a nack, a fallback that superseded one, another membership)."""
        g = self.job.generation + 1
        out: list[RendezvousInfo] = []
        for rank, mid in enumerate(member_ids):
            acked = [
                d
                for d in self.directives.values()
                if d.member_id == mid
                and d.kind == DirectiveKind.PREPARE
                and d.created_at >= r.started_at
                and d.acked
                and d.ack_ok
                and not d.superseded
                and d.rendezvous is not None
                and d.rendezvous.generation == g
            ]
            if not acked:
                return ()
            info = max(acked, key=lambda d: d.seq).rendezvous
            assert info is not None
            if info.rank != rank or info.world_size != len(member_ids):
                return ()
            out.append(info)
        if len({(i.master_endpoint, i.trainer_endpoints) for i in out}) != 1:
            return ()
        return tuple(out)

    def finished_members(self) -> list[Member]:
        """Members that finished the job in the current generation (GONE with a rank)."""
        return [
            m for m in self.members.values() if m.state == MemberState.GONE and m.rank is not None
        ]

    def finished(self) -> bool:
        return bool(self.finished_members()) and not self.current_members()

    def finished_step(self) -> int:
        return max((m.step for m in self.finished_members()), default=0) or self.last_good_step()

    def generation_before(self, m: Member, generation: int) -> int:
        """The newest generation before ``generation`` that ``m`` was in; 0 if none."""
        return max(
            (
                g.generation
                for g in self.generations.values()
                if g.generation < generation and m.member_id in g.member_ids
            ),
            default=0,
        )
