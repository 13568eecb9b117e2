"""One leader among a service's replicas: a lease renewed in the store or the API server.

Every replica runs an elector. The one holding the lease leads; the others follow
and take over once the lease has expired. Two services elect with it: the scaler
(tide/services/scaler/leases.py: the leader takes every job, bumping each job's owner
epoch, the fencing token its writes carry) and the coordinator
(tide/services/coordinator/__main__.py: the leader loads the jobs from SQL, and the
lease's own epoch fences its writes, tide/services/store/leases.py ``check_fence``).

A leader that cannot renew in time, or finds the lease in other hands, stops
acting at once (:attr:`on_lost`; both services exit the process, and the
kubelet starts it again as a follower). It counts its lease from *before* the
renewing call, so its own view of the deadline is never later than the
store's. A leader paused (SIGSTOP, a long GC, a frozen VM) may wake after
another took over and run a few callbacks before its elector notices; those
ask :meth:`may_act` before a side effect, and every write they attempt carries
a stale fencing token, which the store refuses (the scaler's StaleEpoch, the
coordinator's StaleLeader).

The lease lives behind :class:`LeaseBackend`, with these implementations: a row
in the store every replica already shares (``--leader-election sql``:
:class:`~tide.services.store.leases.SqlLease`, and the scaler's DecisionStore) and,
for the scaler, a ``coordination.k8s.io/v1`` Lease (``--leader-election
kubernetes``, tide/services/scaler/kube/lease.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tide.base.errors import ConfigError, TideError
from tide.services.common.clock import Clock
from tide.services.store.leases import LeaseRecord

logger = logging.getLogger(__name__)
#: A follower tries this long after the lease it saw runs out (clock rounding).
_EXPIRY_MARGIN_S = 0.05


@dataclass(frozen=True)
class LeaseSettings:
    #: How long a lease lasts without renewal: the longest a dead leader blocks a
    #: takeover. Kubernetes' controllers use 15 s.
    duration_s: float = 15.0
    #: How often the leader renews, and a follower tries; a third of the lease
    #: leaves two tries before it runs out.
    renew_s: float = 5.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ConfigError(f"lease_duration_s: must be > 0, got {self.duration_s!r}")
        if not (0 < self.renew_s < self.duration_s):
            raise ConfigError(
                f"lease_renew_s: must be in (0, lease_duration_s={self.duration_s}), "
                f"got {self.renew_s!r}"
            )


class LeaseBackend(Protocol):
    """Where the lease lives. ``try_lease`` renews it if ``owner_id`` holds it, takes
    it if it expired or was released, and returns it as it stands after, whoever
    holds it; of two replicas taking it at once exactly one gets it. Each take is a
    new, higher epoch."""

    owner_id: str

    async def try_lease(self, name: str, address: str, *, duration_s: float) -> LeaseRecord: ...

    async def release_lease(self, name: str) -> bool: ...


class LeaderElector:
    def __init__(
        self,
        backend: LeaseBackend,
        clock: Clock,
        settings: LeaseSettings,
        *,
        address: str,
        name: str,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.settings = settings
        self.address = address
        self.name = name
        self.leading = False
        self.epoch = 0
        #: The lease as last read: who leads (for followers' health and errors).
        self.current: LeaseRecord | None = None
        self._deadline = -math.inf
        self._elected = asyncio.Event()

    def may_act(self) -> bool:
        """Whether this replica still holds the lease by its own clock."""
        return self.leading and self.clock.monotonic() < self._deadline

    async def wait_elected(self) -> None:
        await self._elected.wait()

    def follower_message(self) -> str:
        lease = self.current
        if lease is None or lease.held_by(self.backend.owner_id):
            return "no leader yet"
        return f"following {lease.holder} at {lease.address or '?'} (lease epoch {lease.epoch})"

    async def _try(self) -> LeaseRecord | None:
        try:
            return await asyncio.wait_for(
                self.backend.try_lease(
                    self.name, self.address, duration_s=self.settings.duration_s
                ),
                self.settings.renew_s,
            )
        except (TideError, TimeoutError) as exc:
            logger.warning("lease %s: renewal failed: %s", self.name, exc)
            return None

    async def run(
        self,
        on_elected: Callable[[LeaseRecord], Awaitable[None]],
        on_lost: Callable[[str], None],
        on_follow: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """Elect and renew until cancelled; ``on_lost`` must stop this replica acting."""
        me = self.backend.owner_id
        while True:
            if self.leading and self.clock.monotonic() >= self._deadline:
                on_lost("the lease ran out before it could be renewed")
                return
            started = self.clock.monotonic()
            lease = await self._try()
            if lease is not None:
                self.current = lease
            if self.leading:
                if lease is None:
                    pass  # the deadline check above ends leadership in time
                elif lease.held_by(me) and lease.epoch == self.epoch:
                    self._deadline = started + self.settings.duration_s
                else:
                    on_lost(f"the lease is now {lease.holder}'s (epoch {lease.epoch})")
                    return
            elif lease is not None and lease.held_by(me):
                self.leading, self.epoch = True, lease.epoch
                self._deadline = started + self.settings.duration_s
                logger.warning("leading as %s (lease %s, epoch %d)", me, self.name, lease.epoch)
                self._elected.set()
                await on_elected(lease)
            elif on_follow is not None:
                await on_follow(self.follower_message())
            await asyncio.sleep(self._pause_s(lease))

    def _pause_s(self, lease: LeaseRecord | None) -> float:
        """Until the next try: a renew period, or for a follower until the lease it
        saw runs out, if sooner. Trying every renew period took over up to one period
        after the expiry (a paused leader's takeover took lease + renew + election,
        9.25 s of a 9 s bound under load)."""
        renew_s = self.settings.renew_s
        if self.leading or lease is None or lease.held_by(self.backend.owner_id):
            return renew_s
        left_s = lease.expires_at.timestamp() - self.clock.now()
        if left_s <= 0:
            return renew_s  # ran out by our clock yet not ours: skew; no hammering
        return min(renew_s, left_s + _EXPIRY_MARGIN_S)

    async def release(self) -> None:
        """Hand the lease back (a clean shutdown): a follower leads within its next try."""
        if self.leading:
            self.leading = False
            try:
                await self.backend.release_lease(self.name)
            except TideError as exc:
                logger.warning("lease %s: not released (%s); it runs out", self.name, exc)
