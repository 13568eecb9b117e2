"""Which jobs this replica acts on, one interface for the three ways a replica runs:

- alone: every job it has taken (all of them at start);
- elected (tide/services/scaler/leases.py): the same, while it leads; a follower
  refuses writes, naming the leader;
- sharded (tide/services/scaler/leases.py): the jobs of the shards it holds, once taken
  (a new owner epoch, their state read back).

Either way a job another scaler took (the store refused this one's epoch:
StaleEpoch) is fenced off: no longer evaluated here until taken again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping

from tide.services.scaler.errors import NotLeader, NotOwner
from tide.services.scaler.leases import LeaderElector, ShardLeases

logger = logging.getLogger(__name__)


class Ownership:
    def __init__(self) -> None:
        #: Jobs another scaler took (StaleEpoch): no longer evaluated here.
        self.fenced: set[str] = set()
        #: Leader election: None when this replica is the only one.
        self.leader: LeaderElector | None = None
        #: Sharded: this replica acts only on the jobs of the shards it holds; None:
        #: on every job (alone, or as the elected leader).
        self.shards: ShardLeases | None = None
        #: Sharded: the jobs taken since their shard was gained. Between a round
        #: gaining a shard and the take, not acted on.
        self.taken: set[str] = set()

    def acts_on(self, job_id: str) -> bool:
        """Whether this replica evaluates and acts on the job now: not fenced off and,
        sharded, its shard held (by this replica's clock)."""
        if job_id in self.fenced:
            return False
        return self.shards is None or (job_id in self.taken and self.shards.owns(job_id))

    def accepts(self, job_id: str) -> bool:
        """Whether another replica's partials of the job are kept here: acted on, or its
        shard held but not yet taken (a sender replays a moved job's slots as soon as it
        reads the new lease, which may be before this replica's round takes the job)."""
        return self.acts_on(job_id) or (
            self.shards is not None and job_id not in self.fenced and self.shards.owns(job_id)
        )

    def must_take(self, job_id: str, epochs: Mapping[str, int]) -> bool:
        """Whether a write of ``job_id`` made here needs a new owner epoch first."""
        untaken = self.shards is not None and job_id not in self.taken
        return job_id not in epochs or job_id in self.fenced or untaken

    def took(self, job_ids: Iterable[str]) -> None:
        """``job_ids`` have a new owner epoch of this replica's: acted on from now on."""
        for job_id in job_ids:
            self.fenced.discard(job_id)
            self.taken.add(job_id)

    def dropped(self, job_ids: Collection[str]) -> None:
        self.taken.difference_update(job_ids)

    def fence(self, job_id: str, why: BaseException) -> None:
        """Another scaler took the job; stop deciding for it (once, not every tick)."""
        self.fenced.add(job_id)
        logger.warning(
            "job %s: fenced off, no longer deciding for it: %s",
            job_id,
            why,
            extra={"job_id": job_id},
        )

    def require(self, job_id: str) -> None:
        """A write of ``job_id`` asked of this replica: NotLeader or NotOwner, naming
        who decides it, unless this replica does."""
        if self.leader is not None and not self.leader.may_act():
            raise NotLeader(f"this scaler replica does not lead: {self.leader.follower_message()}")
        shards = self.shards
        if shards is not None and not shards.owns(job_id):
            owner = shards.owner_of(job_id)
            where = (
                f"owned by {owner.holder} at {owner.address or '?'}"
                if owner is not None and not owner.held_by(shards.me)
                else "its shard has no owner yet"
            )
            raise NotOwner(
                f"job {job_id!r} (shard {shards.shard_of(job_id)}) is decided by another"
                f" scaler replica: {where}"
            )
