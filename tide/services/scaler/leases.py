"""Leases and leaders of the scaler, in one place: who may decide which jobs.

Two ways for several replicas to share the work, each on leases in the store's
lease table (tide/services/store/leases.py: compare-and-set, an epoch per change of
holder), either way fenced by the store's per-job owner epochs:

**Leader election** (:class:`LeaderElector`, ``--leader-election sql|kubernetes``).
The leader takes every job (bumping each job's owner epoch, the fencing token its
writes carry), resumes their decisions and evaluates them. The others follow: they
serve health and reads, and take over once the lease has expired. Either lease
backend (SQL row or Kubernetes Lease), the fencing epochs are the store's: whoever
is elected takes every job in SQL before it acts.

**Shards** (:class:`ShardLeases`, ``--shards N``).
Every job belongs to one of ``shards`` shards (a hash of its id), and a replica
decides a job only while it holds the job's shard lease. The leases are rows of
the leader lease's table, taken and renewed with the same compare-and-set
(tide/services/store/leases.py), so a shard changes hands only once its lease
was released or ran out, and every takeover bumps the shard's epoch.

Which replica should hold which shard is a pure function of the live replicas
(:func:`assign`, rendezvous hashing: a replica joining or leaving moves only the
shards it gains or held). Replicas are live while their member lease (one row
each, renewed on every round) is. Each round a replica

1. renews its member lease and reads the live members;
2. gives up the shards it holds that now belong to another replica: it stops
   acting on them first, then releases them, so their new owner takes them on
   its next round;
3. takes or renews the shards assigned to it (a shard still leased by its old
   holder is taken once that holder lets it go or its lease runs out).

A replica counts each shard's deadline from before the renewing call, so its
own view never outlasts the store's: when a lease runs out in the store, its
old holder has already stopped deciding (the same rule as leader election).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tide.base.errors import ConfigError, TideError
from tide.services.common.clock import Clock
from tide.services.scaler.store import DecisionStore
from tide.services.store.leader import LeaderElector as _Elector
from tide.services.store.leader import LeaseBackend, LeaseSettings
from tide.services.store.leases import LeaseRecord

__all__ = [
    "LEASE_NAME",
    "SHARDS_MAX",
    "SHARD_LEASE_PREFIX",
    "LeaderElector",
    "LeaseBackend",
    "LeaseRecord",
    "LeaseSettings",
    "ShardLeases",
    "ShardSettings",
    "assign",
    "shard_of",
]

logger = logging.getLogger(__name__)

LEASE_NAME = "tide-scaler"


class LeaderElector(_Elector):
    """The shared elector under the scaler's lease name."""

    def __init__(
        self,
        backend: LeaseBackend,
        clock: Clock,
        settings: LeaseSettings,
        *,
        address: str,
        name: str = LEASE_NAME,
    ) -> None:
        super().__init__(backend, clock, settings, address=address, name=name)


SHARD_LEASE_PREFIX = "tide-scaler-shard-"
MEMBER_LEASE_PREFIX = "tide-scaler-member-"
#: The most shards: a round renews each held one in its own transaction.
SHARDS_MAX = 4096


@dataclass(frozen=True)
class ShardSettings:
    #: Shards the jobs are spread over: the most replicas that can share the work.
    shards: int = 16
    #: How long a shard or member lease lasts without renewal: the longest a dead
    #: replica's jobs wait for a new owner.
    duration_s: float = 15.0
    #: How often a replica renews its leases and rebalances.
    renew_s: float = 5.0

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= SHARDS_MAX:
            raise ConfigError(f"shards={self.shards!r}: must be 1..{SHARDS_MAX}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ConfigError(f"shard_lease_duration_s={self.duration_s!r}: must be > 0")
        if not (0 < self.renew_s < self.duration_s):
            raise ConfigError(
                f"shard_lease_renew_s={self.renew_s!r}: must be in (0, {self.duration_s})"
            )


def shard_of(job_id: str, shards: int) -> int:
    """The job's shard: the same on every replica and across restarts."""
    return zlib.crc32(job_id.encode()) % shards


def _weight(shard: int, member: str) -> int:
    # Not crc32: it is linear, so members whose names differ in one character (r0,
    # r1; pod names) got skewed shares (8 shards: all to one of two replicas).
    return int.from_bytes(hashlib.blake2b(f"{shard}/{member}".encode(), digest_size=8).digest())


def assign(shards: int, members: Sequence[str]) -> dict[int, str]:
    """Shard → the member that should hold it (rendezvous hashing); {} with no member."""
    if not members:
        return {}
    return {k: max(members, key=lambda m: (_weight(k, m), m)) for k in range(shards)}


class ShardLeases:
    """This replica's shard leases; :meth:`step` is one round, :meth:`run` loops."""

    def __init__(
        self, store: DecisionStore, clock: Clock, settings: ShardSettings, *, address: str
    ) -> None:
        self.store = store
        self.clock = clock
        self.settings = settings
        self.address = address
        #: shard → (lease epoch, monotonic deadline by this replica's clock)
        self.held: dict[int, tuple[int, float]] = {}
        self.members: list[str] = []
        #: The live shard leases as last read: who holds each shard and at what
        #: address (where partials go, and what a refused write names).
        self.owners: dict[int, LeaseRecord] = {}
        #: Told of shards this replica stops acting on, before they are released:
        #: it must stop (cancel what acts on their jobs) before returning.
        self.on_stop: Callable[[set[int]], Awaitable[None]] | None = None
        #: Rounds that reached the store (readiness: a replica that runs rounds).
        self.rounds_ok = 0

    @property
    def me(self) -> str:
        return self.store.owner_id

    def shard_of(self, job_id: str) -> int:
        return shard_of(job_id, self.settings.shards)

    def owns(self, job_id: str) -> bool:
        """Whether this replica may decide the job now, by its own clock."""
        held = self.held.get(self.shard_of(job_id))
        return held is not None and self.clock.monotonic() < held[1]

    def owner_of(self, job_id: str) -> LeaseRecord | None:
        """The job's shard lease as last read, whoever holds it; None if nobody does."""
        return self.owners.get(self.shard_of(job_id))

    def owned_shards(self) -> set[int]:
        now = self.clock.monotonic()
        return {k for k, (_, deadline) in self.held.items() if now < deadline}

    async def step(self) -> tuple[set[int], set[int]]:
        """One round; returns (shards gained, shards given up or lost)."""
        s = self.settings
        started = self.clock.monotonic()
        gained: set[int] = set()
        lost = {k for k, (_, deadline) in self.held.items() if started >= deadline}
        for k in lost:
            del self.held[k]  # not renewed in time: stop acting before anyone takes it
        if lost:
            await self._stop(lost)
        try:
            await self.store.try_lease(
                MEMBER_LEASE_PREFIX + self.me, self.address, duration_s=s.duration_s
            )
            live = await self.store.live_leases(MEMBER_LEASE_PREFIX)
        except TideError as exc:
            logger.warning("shard leases: round failed: %s", exc)
            return gained, lost
        self.members = sorted({r.holder for r in live} | {self.me})
        want = {k for k, m in assign(s.shards, self.members).items() if m == self.me}
        give_up = set(self.held) - want
        for k in give_up:
            del self.held[k]
        if give_up:
            # Stop acting first, then hand over: the new owner may take it at once.
            await self._stop(give_up)
        for k in sorted(give_up):
            lost.add(k)
            try:
                await self.store.release_lease(SHARD_LEASE_PREFIX + str(k))
            except TideError as exc:
                logger.warning("shard %d: not released (%s); it runs out", k, exc)
        for k in sorted(want):
            try:
                rec = await self.store.try_lease(
                    SHARD_LEASE_PREFIX + str(k), self.address, duration_s=s.duration_s
                )
            except TideError as exc:
                logger.warning("shard %d: renewal failed: %s", k, exc)
                continue
            was = self.held.get(k)
            if rec.held_by(self.me) and (was is None or was[0] == rec.epoch):
                self.held[k] = (rec.epoch, started + s.duration_s)
                if was is None:
                    gained.add(k)
            elif was is not None:
                del self.held[k]
                lost.add(k)
                await self._stop({k})
        try:
            self.owners = {
                int(r.name.removeprefix(SHARD_LEASE_PREFIX)): r
                for r in await self.store.live_leases(SHARD_LEASE_PREFIX)
            }
        except TideError as exc:
            logger.warning("shard leases: owners not read: %s", exc)
        self.rounds_ok += 1
        if gained or lost:
            logger.info(
                "shards: %s holds %d of %d (gained %s, gave up %s; %d replicas)",
                self.me,
                len(self.held),
                s.shards,
                sorted(gained),
                sorted(lost),
                len(self.members),
            )
        return gained, lost

    async def _stop(self, shards: set[int]) -> None:
        if self.on_stop is not None:
            await self.on_stop(shards)

    async def leave(self) -> None:
        """A clean shutdown: stop acting, then hand every shard and the member lease back."""
        held, self.held = sorted(self.held), {}
        if held:
            await self._stop(set(held))
        for name in [SHARD_LEASE_PREFIX + str(k) for k in held] + [MEMBER_LEASE_PREFIX + self.me]:
            try:
                await self.store.release_lease(name)
            except TideError as exc:
                logger.warning("lease %s: not released (%s); it runs out", name, exc)

    async def run(self) -> None:
        """Rounds every ``renew_s`` until cancelled."""
        while True:
            await self.step()
            await asyncio.sleep(self.settings.renew_s)
