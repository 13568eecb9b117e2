"""The scaler's unit-of-work layer over the repository functions: one transaction per
call, run in a worker thread so the event loop (and with it ingestion) never
waits on SQL, and the fencing epoch of every job this scaler owns."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from tide.base.errors import InvalidArgument
from tide.services.common.clock import Clock
from tide.services.scaler.errors import DecisionInProgress, JobNotFound, StaleEpoch
from tide.services.scaler.store import decisions, jobs, pages, rollups, transitions
from tide.services.scaler.store.records import (
    DecisionDetailRecord,
    DecisionPage,
    DecisionRecord,
    DecisionState,
    JobRecord,
    RollupRecord,
)
from tide.services.store import db, leases
from tide.services.store.failures import StaleWrite

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The transitions' writer hands the loop back every this many answers of a turn.
WAKE_EVERY = 32

# A queued transition: its move, its decision's job, its caller's answer.
_Queued = tuple["transitions.Move", str, "asyncio.Future[DecisionRecord]"]


def _answer(f: asyncio.Future[DecisionRecord], r: DecisionRecord | BaseException) -> None:
    if f.done():  # its caller was cancelled; the write stands, as it would alone
        return
    if isinstance(r, asyncio.CancelledError):
        f.cancel()
    elif isinstance(r, BaseException):
        f.set_exception(r)
    else:
        f.set_result(r)


class DecisionStore:
    def __init__(self, engine: Engine, owner_id: str, clock: Clock) -> None:
        self.engine = engine
        self.factory = db.make_session_factory(engine)
        self.owner_id = owner_id
        self.clock = clock
        self.epochs: dict[str, int] = {}
        local = engine.dialect.name == "sqlite"
        self._write_lock = threading.Lock() if local else None
        # On SQLite the write a decision's latency waits on (its creation) runs on
        # the loop thread: a local file cannot hang on a network, it takes a few
        # milliseconds, and in a worker thread it gets the GIL only every other
        # slice while ingestion keeps the loop busy (bench/ingest: p50 23 ms
        # threaded, 6 ms inline). The lifecycle's later writes, every read and
        # all of PostgreSQL stay in threads: inline, they would stall ingestion.
        self.inline_creates = local
        # Where a create goes when the write lock is busy (``_run_inline``); one
        # thread, made when first needed.
        self._creates_pool: ThreadPoolExecutor | None = None
        # Group commit of the lifecycle's transitions (``transition``): the queue and
        # its writer, a task while the queue has moves.
        self._moves: list[_Queued] = []
        self._mover: asyncio.Task[None] | None = None
        # Each job with a move being written alone (``_write_alone``) and the task writing
        # it, held here: a task only the loop holds may be collected.
        self._alone: dict[str, asyncio.Task[None]] = {}

    @property
    def _creates(self) -> ThreadPoolExecutor:
        if self._creates_pool is None:
            self._creates_pool = ThreadPoolExecutor(1, thread_name_prefix="decision-create")
        return self._creates_pool

    def close(self) -> None:
        """Let the creates' thread go: its pool outlives every store otherwise, and the
        interpreter waits for it at exit. A create still running finishes first."""
        if self._creates_pool is not None:
            self._creates_pool.shutdown(wait=False)
            self._creates_pool = None

    def now(self) -> datetime:
        return db.utc_from_epoch(self.clock.now())

    async def _run(self, fn: Callable[[Session], T], *, write: bool = True, what: str = "") -> T:
        return await asyncio.to_thread(self._unit, fn, write, what or "scaler store")

    async def _run_inline(self, fn: Callable[[Session], T], *, what: str = "") -> T:
        lock = self._write_lock
        loop = asyncio.get_running_loop()
        if not self.inline_creates or lock is None:
            # PostgreSQL: a thread of the creates' own. In the default executor a
            # create queued behind the lifecycle writes of every decision in flight:
            # bench.tick's 1,000-job burst had its last batch (631 creates) wait
            # seconds behind 2,900 transitions (docs/scaler.md, "Tipping").
            return await loop.run_in_executor(
                self._creates, self._unit, fn, True, what or "scaler store"
            )
        # Inline only when the write lock is free: a lifecycle write in a thread may
        # hold it, and waiting for it here would stop the loop (ingestion, acks, every
        # other evaluation) behind that thread and behind every writer queued before
        # us. bench.tick's tipping phase, 1,000 decisions at once, spent 9 s of its
        # loop in this wait. Taken, it is ours for the transaction; busy, the write
        # waits in a thread like the others.
        if not lock.acquire(blocking=False):
            # Its own thread: the default executor's queue holds the lifecycle's
            # writes of every decision in flight, hundreds when many jobs resize.
            return await loop.run_in_executor(
                self._creates, self._unit, fn, True, what or "scaler store"
            )
        try:
            return db.unit_of_work(self.factory, fn, write=True, what=what or "scaler store")
        finally:
            lock.release()

    def _unit(self, fn: Callable[[Session], T], write: bool, what: str) -> T:
        if write and self._write_lock is not None:
            # SQLite has one writer; two of our threads racing for it would
            # meet SQLite's busy handler, which sleeps 1, 2, 5, 10... ms between
            # tries. Queueing them here hands the lock over at once instead.
            with self._write_lock:
                return db.unit_of_work(self.factory, fn, write=write, what=what)
        return db.unit_of_work(self.factory, fn, write=write, what=what)

    async def warm_up(self) -> None:
        """Run a decision's whole life once in a transaction that is rolled back.

        SQLAlchemy compiles each statement the first time it runs: tens of
        milliseconds here, spent under the write lock in the middle of the first
        real decisions otherwise (bench/ingest saw its first decisions take
        120-190 ms). Nothing of it is committed."""
        await asyncio.to_thread(self._warm_up)

    def _warm_up(self) -> None:
        job_id = "tide-warmup/job"
        now = self.now()
        # Their INFO lines would describe rows that never exist.
        quiet = [logging.getLogger(m.__name__) for m in (jobs, decisions)]
        was = [q.disabled for q in quiet]
        for q in quiet:
            q.disabled = True
        session = self.factory()
        try:
            jobs.upsert_job(session, job_id, min_replicas=1, max_replicas=2, now=now)
            epoch = jobs.acquire_job_ownership(session, job_id, self.owner_id, now=now)
            d = decisions.create_decision(
                session,
                job_id=job_id,
                from_replicas=1,
                to_replicas=2,
                reason="MANUAL",
                trigger="MANUAL",
                message="warm-up",
                inputs={"window": {"bucket_means_pct": [1.0]}},
                epoch=epoch,
                now=now,
            )
            for state in (DecisionState.PREPARING, DecisionState.ACTUATING):
                decisions.transition_decision(session, d.id, state, detail="", epoch=epoch, now=now)
            decisions.transition_decision(
                session,
                d.id,
                DecisionState.COMPLETED,
                detail="",
                epoch=epoch,
                now=now,
                pause_s=0.0,
                generation=1,
                to_replicas=2,
                lost_steps=0,
            )
            pages.list_decisions(session, job_id=job_id, page_size=1)
        except Exception:
            logger.debug("store warm-up failed; the first decisions compile instead", exc_info=True)
        finally:
            session.rollback()
            session.close()
            for q, w in zip(quiet, was, strict=True):
                q.disabled = w

    # -- leader lease ----------------------------------------------------------------

    async def try_lease(self, name: str, address: str, *, duration_s: float) -> leases.LeaseRecord:
        now = self.now()
        return await self._run(
            lambda s: leases.try_lease(
                s, name, self.owner_id, address, duration_s=duration_s, now=now
            ),
            what=f"lease {name}",
        )

    async def release_lease(self, name: str) -> bool:
        now = self.now()
        return await self._run(
            lambda s: leases.release_lease(s, name, self.owner_id, now=now),
            what=f"release lease {name}",
        )

    async def live_leases(self, prefix: str) -> list[leases.LeaseRecord]:
        now = self.now()
        return await self._run(
            lambda s: leases.live_leases(s, prefix, now=now),
            write=False,
            what=f"leases {prefix}*",
        )

    # -- jobs ----------------------------------------------------------------------

    async def acquire(self, job_id: str) -> int:
        now = self.now()
        epoch = await self._run(
            lambda s: jobs.acquire_job_ownership(s, job_id, self.owner_id, now=now),
            what=f"acquire job {job_id}",
        )
        self.epochs[job_id] = epoch
        return epoch

    async def acquire_many(self, job_ids: Sequence[str]) -> dict[str, int]:
        """Take ``job_ids`` in one transaction; returns the epochs of those found."""
        now = self.now()
        epochs = await self._run(
            lambda s: jobs.acquire_jobs_ownership(s, job_ids, self.owner_id, now=now),
            what=f"acquire {len(job_ids)} job(s)",
        )
        self.epochs.update(epochs)
        return epochs

    async def list_jobs(self) -> list[JobRecord]:
        return await self._run(jobs.list_jobs, write=False)

    async def get_job(self, job_id: str) -> JobRecord:
        return await self._run(lambda s: jobs.get_job(s, job_id), write=False)

    async def upsert_job(self, job_id: str, **kwargs: Any) -> JobRecord:
        now = self.now()
        return await self._run(
            lambda s: jobs.upsert_job(s, job_id, now=now, **kwargs), what=f"upsert job {job_id}"
        )

    async def create_started_job(
        self,
        job_id: str,
        *,
        min_replicas: int,
        max_replicas: int,
        initial_replicas: int,
        gpus_per_replica: int | None,
        policy_overrides: Mapping[str, Any],
        message: str,
        inputs: Mapping[str, Any],
    ) -> tuple[JobRecord, DecisionRecord] | None:
        """Create a new job at 0 replicas, owned by this scaler, with its PENDING
        JOB_STARTED decision 0 -> ``initial_replicas``; None (nothing written) when
        the job exists. One transaction: a crash leaves either nothing or a job whose
        start the restarted scaler resumes, never a job that nobody starts."""
        now = self.now()

        def fn(s: Session) -> tuple[JobRecord, int, DecisionRecord] | None:
            try:
                jobs.get_job(s, job_id)
                return None
            except JobNotFound:
                pass
            jobs.upsert_job(
                s,
                job_id,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                now=now,
                initial_replicas=initial_replicas,
                gpus_per_replica=gpus_per_replica,
                policy_overrides=policy_overrides,
            )
            # Nothing runs yet: the decision's completion sets the replicas it reached.
            jobs.set_job_observed(s, job_id, now=now, current_replicas=0)
            epoch = jobs.acquire_job_ownership(s, job_id, self.owner_id, now=now)
            d = decisions.create_decision(
                s,
                job_id=job_id,
                from_replicas=0,
                to_replicas=initial_replicas,
                reason="JOB_STARTED",
                trigger="MANUAL",
                message=message,
                inputs=inputs,
                epoch=epoch,
                now=now,
            )
            return jobs.get_job(s, job_id), epoch, d

        out = await self._run(fn, what=f"start job {job_id}")
        if out is None:
            return None
        job, epoch, d = out
        self.epochs[job_id] = epoch
        return job, d

    async def set_paused(self, job_id: str, paused: bool, reason: str) -> JobRecord:
        now = self.now()
        job = await self._run(
            lambda s: jobs.set_paused(s, job_id, paused=paused, reason=reason, now=now)
        )
        # After the commit: a write the store refused logs nothing it did not do.
        logger.info(
            "job %s autoscaling paused=%s (%s)", job_id, paused, reason, extra={"job_id": job_id}
        )
        return job

    # -- decisions -----------------------------------------------------------------

    async def create(
        self,
        *,
        job_id: str,
        from_replicas: int,
        to_replicas: int,
        reason: str,
        trigger: str,
        message: str,
        inputs: Mapping[str, Any],
        requested_by: str = "",
    ) -> DecisionRecord:
        epoch = self.epochs[job_id]
        now = self.now()
        return await self._run_inline(
            lambda s: decisions.create_decision(
                s,
                job_id=job_id,
                from_replicas=from_replicas,
                to_replicas=to_replicas,
                reason=reason,
                trigger=trigger,
                message=message,
                inputs=inputs,
                epoch=epoch,
                now=now,
                requested_by=requested_by,
            ),
            what=f"create decision of job {job_id}",
        )

    async def create_many(
        self, items: Sequence[Mapping[str, Any]]
    ) -> list[DecisionRecord | DecisionInProgress | StaleEpoch]:
        """Several PENDING decisions (each ``items`` entry :meth:`create`'s keywords) in
        one transaction of a few statements (``decisions.create_decisions``): one commit,
        and on SQLite one turn at the write lock, for a batch of jobs that tipped
        together instead of one each (bench.tick's tipping phase). A job refused (a
        decision in flight, a stale epoch) gets its error in its place and the others
        are written; any other error fails the whole batch."""
        now = self.now()
        epochs = {item["job_id"]: self.epochs[item["job_id"]] for item in items}
        return await self._run_inline(
            lambda s: decisions.create_decisions(s, items, epochs=epochs, now=now),
            what=f"create {len(items)} decisions",
        )

    async def transition(
        self,
        d: DecisionRecord,
        state: DecisionState,
        detail: str,
        *,
        check_state: bool = True,
        **kwargs: Any,
    ) -> DecisionRecord:
        """Move ``d`` to ``state``; with ``check_state`` the row must still be in
        ``d.state`` (DecisionChanged otherwise). Recording a failure from wherever
        the decision got to passes False.

        Group commit: the call joins the queue of transitions and one writer writes
        each turn's queue in one transaction (``transitions.transition_decisions``),
        whatever queued while the previous turn was being written; no delay, so a lone
        transition is written at once, alone. Each caller gets its own record or its
        own error, exactly as if written alone."""
        epoch, expected = self.epochs[d.job_id], d.state if check_state else None
        move = transitions.Move(d.id, state, detail, epoch, self.now(), expected, **kwargs)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[DecisionRecord] = loop.create_future()
        self._moves.append((move, d.job_id, done))
        self._start_writer(loop)
        return await done

    def _start_writer(self, loop: asyncio.AbstractEventLoop) -> None:
        """A writer for the queue, unless one serves it."""
        writer = self._mover
        if writer is not None and not writer.done() and writer.get_loop() is loop:
            return
        # A queue left by a loop that is gone (tests run one loop each) has no one
        # to answer: its futures belong to that loop.
        self._moves = [q for q in self._moves if q[2].get_loop() is loop]
        self._alone = {j: t for j, t in self._alone.items() if t.get_loop() is loop}
        # A context of its own: the first caller's (its job and decision bound for
        # the logs) would name that decision in every turn's records.
        self._mover = loop.create_task(
            self._write_moves(), name="decision-transitions", context=contextvars.Context()
        )
        self._mover.add_done_callback(self._writer_ended)

    async def _write_moves(self) -> None:
        """The transitions' writer: a turn takes the whole queue, but never two moves
        of one job (of one decision above all: they must apply in the order called;
        two ends of one job would both write its row): a second waits for the next
        turn, in its place in the queue."""
        try:
            while self._moves:
                batch: list[_Queued] = []
                rest: list[_Queued] = []
                # A job with a move being written alone is in this turn already.
                jobs_in: set[str] = set(self._alone)
                for q in self._moves:
                    if q[2].done():
                        # Its caller was cancelled before its turn: not written, as a
                        # call cancelled while queued for the executor never ran.
                        continue
                    if q[1] in jobs_in or len(batch) >= transitions.MAX_BATCH:
                        rest.append(q)
                    else:
                        jobs_in.add(q[1])
                        batch.append(q)
                self._moves = rest
                if not batch:
                    break  # all wait for moves written alone; those start the next writer
                try:
                    await self._write_turn(batch)
                finally:
                    for _, job_id, f in batch:  # an answer for every caller, come what may
                        if not f.done() and job_id not in self._alone:
                            f.cancel()  # (one written alone is answered by its task)
        finally:
            if self._mover is asyncio.current_task():
                self._mover = None

    def _writer_ended(self, writer: asyncio.Task[None]) -> None:
        """A writer cancelled (even before it ran: then none of its code does) leaves
        callers queued that no later turn answers: none may wait for ever."""
        if self._mover is not None and self._mover is not writer:
            return  # a new writer already serves the queue
        self._mover = None
        if not writer.cancelled() and writer.exception() is None:
            return  # all written, or the rest waits for moves written alone (_write_alone)
        for _, _, f in self._moves:
            if not f.done():
                f.cancel()
        self._moves = []

    async def _write_turn(self, batch: Sequence[_Queued]) -> None:
        if len(batch) == 1:
            # Alone: the single path, as cheap as before group commit, beside the next
            # turns: its check_epoch waits for a job row another transaction holds (up
            # to lock_timeout_s a try), and no other job's move may wait with it.
            self._write_alone(*batch[0])
            return
        moves = [m for m, _, _ in batch]
        results: Sequence[DecisionRecord | BaseException]
        try:
            results = await self._run(
                lambda s: transitions.transition_decisions(s, moves),
                what=f"{len(moves)} decision transitions",
            )
        except (StaleWrite, InvalidArgument) as exc:
            # Refused as a whole before anything committed (rows that kept changing;
            # InvalidArgument is defensive, the writer forms no batch it refuses): each
            # is written alone, so a move that would have succeeded alone does, and each
            # caller gets the single path's answer. A store failure is not among them:
            # its commit may have landed (the reply lost) and a move written again would
            # read DecisionChanged. Every caller gets it, the single path's answer to a
            # store that failed past its retries, and reads its row back as it would.
            logger.warning(
                "a batch of %d decision transitions failed, writing each: %s", len(moves), exc
            )
            for q in batch:  # each beside the next turns: one may wait on a held row
                self._write_alone(*q)
            return
        except Exception as exc:
            results = [exc] * len(moves)
        for n, ((m, job_id, f), r) in enumerate(zip(batch, results, strict=True), 1):
            if n % WAKE_EVERY == 0:
                # Each answer wakes its decision's task, whose next step (the actuator,
                # the coordinator, its next transition) runs on the loop: a turn of
                # hundreds woken at once would hold the loop, and the acks, meanwhile.
                await asyncio.sleep(0)
            if isinstance(r, transitions.NotBatched):
                # Its job's row is held by another transaction: written alone, beside
                # the next turns, so that only this move waits for that lock.
                self._write_alone(m, job_id, f)
                continue
            _answer(f, r)

    def _write_alone(
        self, m: transitions.Move, job_id: str, f: asyncio.Future[DecisionRecord]
    ) -> None:
        """``m`` written by the single path in a task of its own, ``f`` answered from it;
        its job's next moves wait in the queue until then."""

        async def write() -> None:
            try:
                (r,) = await asyncio.gather(self._move_alone(m), return_exceptions=True)
                _answer(f, r)
            finally:
                if not f.done():
                    f.cancel()
                self._alone.pop(job_id, None)
                if self._moves:
                    self._start_writer(asyncio.get_running_loop())

        self._alone[job_id] = asyncio.get_running_loop().create_task(
            write(), name=f"decision-transition-{m.decision_id}", context=contextvars.Context()
        )

    async def _move_alone(self, m: transitions.Move) -> DecisionRecord:
        return await self._run(
            lambda s: transitions.transition_alone(s, m),
            what=f"decision {m.decision_id} -> {m.state}",
        )

    async def non_final(self) -> list[DecisionRecord]:
        return await self._run(decisions.non_final_decisions, write=False)

    async def get_decision(self, decision_id: int) -> DecisionDetailRecord:
        return await self._run(lambda s: decisions.get_decision(s, decision_id), write=False)

    async def list_decisions(self, **kwargs: Any) -> DecisionPage:
        return await self._run(lambda s: pages.list_decisions(s, **kwargs), write=False)

    async def decision_page(
        self, convert: Callable[[Any], T], *, page_size: int, **kwargs: Any
    ) -> tuple[list[T], str]:
        """:meth:`list_decisions`' page (its filters, bound, order and tokens) as
        ``convert`` of each row of ``pages.history_table_rows`` (wide: every field of
        the API's Decision), converted in the store's thread with no record between:
        the API's ListDecisions, which `tide history --all` calls a hundred times for
        100,000 decisions (docs/cli.md)."""
        if not (1 <= page_size <= pages.MAX_PAGE_SIZE):
            raise InvalidArgument(f"page_size must be in 1..{pages.MAX_PAGE_SIZE}, got {page_size}")

        def q(s: Session) -> tuple[list[T], str]:
            rows, token = pages.history_table_rows(s, page_size=page_size, wide=True, **kwargs)
            return [convert(r) for r in rows], token

        return await self._run(q, write=False)

    async def last_completed(self, job_id: str) -> DecisionRecord | None:
        page = await self.list_decisions(
            job_id=job_id, states=(DecisionState.COMPLETED,), page_size=1
        )
        return page.decisions[0] if page.decisions else None

    async def last_completed_many(self, job_ids: Sequence[str]) -> dict[str, DecisionRecord]:
        return await self._run(
            lambda s: decisions.last_completed_decisions(s, job_ids), write=False
        )

    # -- rollups -------------------------------------------------------------------

    async def write_rollups(self, rows: Sequence[RollupRecord]) -> int:
        return await self._run(lambda s: rollups.write_rollups(s, rows), what="write rollups")

    async def rollups_between(self, job_id: str, t0: datetime, t1: datetime) -> list[RollupRecord]:
        return await self._run(lambda s: rollups.rollups_between(s, job_id, t0, t1), write=False)

    async def delete_rollups_before(self, before: datetime, *, limit: int | None = None) -> int:
        return await self._run(
            lambda s: rollups.delete_rollups_before(s, before, limit=limit),
            what="rollup retention",
        )

    async def delete_decisions_before(self, before: datetime, *, limit: int) -> int:
        return await self._run(
            lambda s: decisions.delete_decisions_before(s, before, limit=limit),
            what="decision retention",
        )

    async def seconds_between(
        self, job_id: str, t0: datetime, t1: datetime
    ) -> dict[datetime, tuple[tuple[float, ...], tuple[int, ...]]]:
        return await self._run(lambda s: rollups.seconds_between(s, job_id, t0, t1), write=False)

    async def delete_seconds_before(self, before: datetime, *, limit: int | None = None) -> int:
        return await self._run(
            lambda s: rollups.delete_seconds_before(s, before, limit=limit),
            what="per-second retention",
        )
