"""A sharded scaler replica: its shard rounds acted on, its partials shipped.

With ``--shards N`` every replica runs (tide/services/scaler/app.py):

- **rounds** (:meth:`Sharding.round`): one :class:`~tide.services.scaler.leases.ShardLeases`
  step every ``lease_renew_s``. A shard given up or lost is stopped first
  (:meth:`ScalerCore.drop_jobs` cancels and awaits what acts on its jobs), then
  released; a shard gained has its jobs taken (a new owner epoch each, so
  whatever the last owner still writes is refused), their open decisions resumed
  and evaluated on the next pass. Each round also reads the jobs from the store
  (new jobs, and those other replicas write, for the read API and attribution).
- **shipping** (:meth:`Sharding.shipping`): every ``partials_ship_interval_s``
  the partial aggregates of jobs owned elsewhere go to each owner, at the
  address its shard lease names, with that interval as the deadline. Bounded:
  at most one shipment per owner in flight; a shipment that finds the previous
  one still on its way, or a job whose shard has no live lease, is dropped and
  counted (``tide_scaler_partials_dropped_total{reason}``), never queued.
- **notices**: a node's termination notice or cordon seen here, for a job owned
  elsewhere, rides every shipment to the job's owner until its deadline passes (so
  a shipment lost, or a shard that moved, costs at most one interval), and a new
  one triggers a shipment at once: the owner has seconds to act on it, and notices
  are rare (docs/preemption.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

from tide.base.errors import TideError
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.leases import ShardLeases, shard_of
from tide.services.scaler.partials import JobPartial, NodeNotice, Shipped
from tide.services.scaler.peers import PeerLink

logger = logging.getLogger(__name__)


class Sharding:
    def __init__(
        self,
        core: ScalerCore,
        leases: ShardLeases,
        peers: PeerLink,
        *,
        ship_interval_s: float,
    ) -> None:
        self.core = core
        self.leases = leases
        self.peers = peers
        self.ship_interval_s = ship_interval_s
        #: Shards held as of the last round: the ingest hot path's forward test
        #: (a set lookup per job and report, no clock read).
        self._owned: set[int] = set()
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._ship_soon = False
        #: The window slots shipped so far, per job forwarded: replayed to a new owner.
        self.shipped = Shipped()
        shards = leases.settings.shards
        owned = self._owned
        core.ownership.shards = leases
        core.controller.may_act_on = leases.owns
        core.ingest.forward = lambda job: shard_of(job, shards) not in owned
        core.ingest.on_forward_notice = self._notice_soon
        leases.on_stop = self._stop

    async def _stop(self, shards: set[int]) -> None:
        self._owned.difference_update(shards)
        self.core.metrics.shards_held.set(len(self._owned))
        dropped = [j for j in self.core.jobs if self.leases.shard_of(j) in shards]
        await self.core.drop_jobs(dropped)
        ingest = self.core.ingest
        for j in dropped:
            # Its new owner gets the other replicas' slots replayed; a window kept here
            # would count them twice should the shard come back. This replica's own
            # agents' samples in it are retained and replayed to the new owner as the
            # others' are (or put back here, should the shard come back first).
            own = ingest.own_partial(j)
            if own is not None:
                self.shipped.retain(own)
            ingest.reshape(j)

    async def round(self) -> None:
        """One round: leases, then the jobs of the shards held here and not yet taken
        (those of a shard gained, one made since, one whose take failed) taken."""
        await self.leases.step()
        try:
            await self.core.refresh_jobs()
        except TideError as exc:
            logger.warning("sharded: jobs not refreshed from the store: %s", exc)
        held = self.leases.owned_shards()
        pending = [
            j
            for j in self.core.jobs
            if self.leases.shard_of(j) in held and not self.core.acts_on(j)
        ]
        if pending:
            try:
                await self.core.take_jobs(pending)
            except TideError as exc:
                # Not acted on until taken; the next round tries again.
                logger.warning("%d job(s) not taken (%s); next round", len(pending), exc)
        self._absorb()
        self.shipped.keep(self.core.jobs)
        self._owned.clear()
        self._owned.update(self.leases.owned_shards())
        self.core.metrics.shards_held.set(len(self._owned))
        self.peers.keep(
            r.address for r in self.leases.owners.values() if not r.held_by(self.leases.me)
        )

    def ship(self) -> None:
        """Hand what was gathered since the last shipment, and every active node notice
        of jobs owned elsewhere, to each owner (one task per owner, at most one in
        flight)."""
        self._ship_soon = False
        parts = self.core.ingest.take_partials()
        notices = self.core.ingest.take_notices(self.core.clock.now())

        def ready(job_id: str) -> str | None:
            """The job's owner's address when a shipment may go there now."""
            address = self._address_of(job_id)
            return None if address is None or self._busy(address) else address

        # The slots of jobs whose shard moved since they were shipped, to the new owner.
        replays = self.shipped.moved(ready, {p.job_id for p in parts})
        if not parts and not notices and not replays:
            return
        m = self.core.metrics
        by_owner: dict[str, tuple[list[JobPartial], list[NodeNotice]]] = defaultdict(
            lambda: ([], [])
        )
        mine = False
        for p in parts:
            address = self._address_of(p.job_id)
            if address is None:
                if self.leases.owns(p.job_id):
                    # Gathered before this replica's forward test learned it holds the
                    # shard: retained, and added to its own window once it takes the job.
                    self.shipped.outgoing(p, self.leases.me)
                    mine = True
                    continue
                # Not sent; kept for the job's next owner (a shard without a live lease
                # is one moving: its new owner gets them in the replay).
                self.shipped.retain(p)
                m.partials_dropped.labels("no_owner").inc()
                continue
            if self._busy(address):
                # Partials are not queued for this owner; kept for the job's next one.
                self.shipped.retain(p)
                m.partials_dropped.labels("busy").inc()
                continue
            # A failed or refused shipment stays in the retained slots: it reaches the
            # job's next owner (a replay) but not this one.
            by_owner[address][0].append(self.shipped.outgoing(p, address))
        for p in replays:
            address = self._address_of(p.job_id)
            if address is not None:
                by_owner[address][0].append(p)
        if mine:
            self._absorb()
        for n in notices:
            # No owner now: resent next shipment, when the shard may have one.
            address = self._address_of(n.job_id)
            if address is not None:
                by_owner[address][1].append(n)
        for address, (batch, noticed) in by_owner.items():
            if self._busy(address):
                continue  # notices only (partials were kept above): resent next shipment
            task = asyncio.create_task(self._ship(address, batch, noticed), name=f"ship-{address}")
            self._in_flight[address] = task

    def _busy(self, address: str) -> bool:
        """The last shipment to ``address`` is still on its way (at most one in flight)."""
        running = self._in_flight.get(address)
        return running is not None and not running.done()

    def _absorb(self) -> None:
        """The jobs acted on here now (their shard gained and taken): this replica shipped
        its own agents' samples of them to their old owner until now; those slots go into
        its window, beside the ones other replicas replay to it."""
        for job_id in [j for j in self.shipped.jobs() if self.core.acts_on(j)]:
            p = self.shipped.take(job_id)
            if p is not None:
                self.core.ingest.merge_partials(self.leases.me, [p], own=True)

    def _address_of(self, job_id: str) -> str | None:
        owner = self.leases.owner_of(job_id)
        if owner is None or owner.held_by(self.leases.me) or not owner.address:
            return None
        return owner.address

    def _notice_soon(self) -> None:
        """A notice for a job owned elsewhere: shipped now, not up to an interval later
        (once per loop turn however many notices land in it)."""
        if self._ship_soon:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a replay outside one): the next shipment carries it
        self._ship_soon = True
        loop.call_soon(self.ship)

    async def _ship(self, address: str, batch: list[JobPartial], notices: list[NodeNotice]) -> None:
        m = self.core.metrics
        try:
            sent, refused = await self.peers.ship(
                address, self.leases.me, batch, notices, timeout_s=self.ship_interval_s
            )
        except TideError as exc:
            m.partials_dropped.labels("failed").inc(len(batch))
            logger.debug("partials to %s dropped: %s", address, exc)
            return
        m.partials_shipped.inc(len(batch) - refused)
        m.partials_shipped_bytes.inc(sent)
        m.notices_shipped.inc(len(notices))
        if refused:
            m.partials_dropped.labels("refused").inc(refused)

    async def shipping(self) -> None:
        """Ships every ``ship_interval_s`` until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.ship_interval_s)
                self.ship()
        finally:
            for t in self._in_flight.values():
                t.cancel()

    async def leave(self) -> None:
        """A clean stop: every shard handed back at once, not a lease later."""
        with contextlib.suppress(TideError):
            await self.leases.leave()
        await self.peers.close()
