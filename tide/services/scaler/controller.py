"""Drives decisions through their lifecycle (tide/services/scaler/lifecycle.py).

One task per decision. Each step commits the state that authorizes a side
effect, then performs it; a crash anywhere is recovered by :meth:`recover`,
which re-enters the same code from the committed state. Every side effect is
idempotent (``set_replicas`` to a count; ``Resize`` keyed by decision id), so
repeating the one that may or may not have happened before the crash changes
nothing the second time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from tide.base.errors import StoreUnavailable, TideError, Unavailable
from tide.base.retry import Backoff
from tide.services.common import logs, tracing
from tide.services.common.clock import Clock
from tide.services.scaler.actuators import Actuator, acting_while, remove_pods
from tide.services.scaler.coordination import CoordinatorClient, Phase, Progress, ResizeSpec
from tide.services.scaler.errors import StaleEpoch
from tide.services.scaler.lifecycle import FaultHook
from tide.services.scaler.store import DecisionRecord, DecisionState, DecisionStore

logger = logging.getLogger(__name__)

S = DecisionState

EventSink = Callable[[DecisionRecord, str], None]


def _no_fault(point: str) -> None:
    return None


def _leaving_pods(d: DecisionRecord) -> tuple[str, ...]:
    """The pods the decision names to leave (uids or names), persisted in its inputs so
    that a restarted scaler drains and removes the same ones."""
    return tuple(str(p) for p in d.inputs.get("leaving_pods", []) or [])


def _world_multiple(d: DecisionRecord) -> int:
    """The whole groups the job's world moves by, from the policy the decision was made
    under (stored with it, so a restarted scaler asks the coordinator for the same)."""
    policy = d.inputs.get("policy") or {}
    return int(policy.get("replica_multiple", 1) or 1)


def _with_message(detail: str, p: Progress) -> str:
    """An event's detail with the coordinator's own word on the outcome, if it adds one
    (the in-memory coordinator's says that nothing moved)."""
    return f"{detail}: {p.message}" if p.message and p.message not in detail else detail


class Controller:
    def __init__(
        self,
        store: DecisionStore,
        actuator: Actuator,
        coordinator: CoordinatorClient,
        clock: Clock,
        *,
        fault: FaultHook | None = None,
        on_event: EventSink | None = None,
        on_final: Callable[[DecisionRecord], None] | None = None,
        retry_s: float = 0.5,
        retry_max_s: float = 5.0,
        wait_store: Callable[[], Awaitable[None]] | None = None,
        may_act: Callable[[], bool] | None = None,
    ) -> None:
        self.store = store
        self.actuator = actuator
        self.coordinator = coordinator
        self.clock = clock
        self.fault: FaultHook = fault or _no_fault
        self.on_event = on_event
        self.on_final = on_final
        self.retry_s = retry_s
        self.retry_max_s = retry_max_s
        #: Returns when the store answers again (tide.services.store.probe); without a
        #: probe, a fixed pause before the decision is read back and tried again.
        self.wait_store = wait_store
        #: Whether this replica still leads (tide/services/scaler/leases.py), asked right
        #: before every side effect: a leader that wakes from a pause after another
        #: took over stops here, before it acts on a state it committed earlier.
        self.may_act = may_act or (lambda: True)
        #: Whether this replica still acts on a job (sharded: holds the job's shard,
        #: tide/services/scaler/leases.py), asked with ``may_act``.
        self.may_act_on: Callable[[str], bool] = lambda _job_id: True
        self.tasks: dict[int, asyncio.Task[DecisionRecord | None]] = {}
        #: Each driven decision's root span (tide.services.common.tracing), until it is final.
        self.spans: dict[int, Any] = {}
        #: Each job's last measured checkpoint write, seconds: a preemption's margin
        #: (tide.services.scaler.preemption) is sized from it.
        self.checkpoint_s: dict[str, float] = {}
        #: Decisions a preemption supersedes, with why: one that has not reached the
        #: coordinator yet (a grow still starting its pods) ends ABORTED before Resize.
        self.superseded: dict[int, str] = {}
        #: The backoffs' jitter, one source for every decision: a Random of each
        #: backoff's own is seeded from the OS, three times a decision on the loop,
        #: for delays that are rarely drawn (docs/scaler.md, "Group commit").
        self._jitter = random.Random()

    def start(
        self,
        d: DecisionRecord,
        *,
        deadline_s: float,
        armed: bool = True,
        started_s: float | None = None,
    ) -> asyncio.Task[DecisionRecord | None]:
        """Drive ``d`` to a final state in a task. ``armed=False`` keeps the fault
        point quiet (a crash test kills once per decision, not again during recovery).
        ``started_s``: when the decision's trace starts (its tipping sample), else now."""
        task = self.tasks.get(d.id)
        if task is None or task.done():
            fault = self.fault if armed else _no_fault
            self.spans.setdefault(d.id, self._root_span(d, started_s, resumed=not armed))
            task = asyncio.create_task(self._drive(d, deadline_s, fault), name=f"decision-{d.id}")
            self.tasks[d.id] = task
            did = d.id

            def forget(_t: asyncio.Task[DecisionRecord | None]) -> None:
                self.tasks.pop(did, None)

            task.add_done_callback(forget)
        return task

    @staticmethod
    def _root_span(d: DecisionRecord, started_s: float | None, *, resumed: bool) -> Any:
        return tracing.start_span(
            "tide.decision",
            new_trace=True,  # one trace per decision
            start_ns=int(started_s * 1e9) if started_s is not None else None,
            attributes={
                "tide.job_id": d.job_id,
                "tide.decision_id": d.id,
                "tide.reason": d.reason,
                "tide.trigger": d.trigger,
                "tide.from_replicas": d.from_replicas,
                "tide.to_replicas": d.to_replicas,
                "tide.resumed": resumed,
            },
        )

    def _end_span(self, d: DecisionRecord) -> None:
        span = self.spans.pop(d.id, None)
        if span is None:
            return
        span.set_attribute("tide.state", d.state.value)
        span.set_attribute("tide.generation", d.generation)
        span.set_attribute("tide.pause_s", d.pause_s)
        if d.state is not S.COMPLETED:
            tracing.record_error(span, d.error or d.state.value)
        span.end()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _step(
        self,
        d: DecisionRecord,
        state: DecisionState,
        detail: str,
        fault: FaultHook,
        *,
        check_state: bool = True,
        **kw: object,
    ) -> DecisionRecord:
        d = await self.store.transition(d, state, detail, check_state=check_state, **kw)
        span = self.spans.get(d.id)
        if span is not None:
            span.add_event(state.value, {"tide.detail": detail})
        if self.on_event is not None:
            self.on_event(d, detail)
        fault(f"decision:{state.value}")
        if d.final:
            self._end_span(d)
            if self.on_final is not None:
                self.on_final(d)
        return d

    async def _drive(
        self, d: DecisionRecord, deadline_s: float, fault: FaultHook
    ) -> DecisionRecord | None:
        log = logger.getChild("decision")
        # This task works on one decision for its whole life: every line it (and the
        # store, the actuator, the coordinator client under it) logs carries both ids.
        logs.bind(job_id=d.job_id, decision_id=d.id)
        span = self.spans.get(d.id)
        # A preemption's barrier deadline was planned from its notice and persisted.
        deadline_s = float(d.inputs.get("barrier_deadline_s") or deadline_s)
        try:
            # The decision's span is current in its task: the actuator's and the
            # coordinator's calls are its children, and Resize carries it to the coordinator.
            with tracing.current(span) if span is not None else contextlib.nullcontext():
                while True:
                    try:
                        if d.to_replicas >= d.from_replicas:
                            return await self._grow(d, deadline_s, fault)
                        return await self._shrink(d, deadline_s, fault)
                    except StoreUnavailable as exc:
                        # A step's commit did not happen, so its side effect did not
                        # either (each commits first, then acts). Wait for the store,
                        # read back what it holds and carry on from there: the same
                        # road as recovery after a restart, without the restart.
                        log.warning(
                            "decision %d of job %s waits for the store: %s",
                            d.id,
                            d.job_id,
                            exc,
                            extra={"job_id": d.job_id, "decision_id": d.id},
                        )
                        d = await self._read_back(d)
                        if d.final:
                            return d
        except StaleEpoch as exc:
            # Another scaler took the job: it resumes the decision; we only stop.
            log.warning(
                "decision %d of job %s: fenced off (%s)",
                d.id,
                d.job_id,
                exc,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            return None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception(
                "decision %d of job %s failed",
                d.id,
                d.job_id,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            try:
                # From wherever the decision got to: ``d`` is the state it started in.
                return await self._step(
                    d, S.FAILED, "internal error", fault, check_state=False, error=str(exc)
                )
            except Exception:
                log.exception(
                    "decision %d: could not record FAILED; recovery will",
                    d.id,
                    extra={"job_id": d.job_id, "decision_id": d.id},
                )
                return None

    async def _read_back(self, d: DecisionRecord) -> DecisionRecord:
        """``d`` as the store holds it, once the store answers again."""
        backoff = Backoff(self.retry_s, self.retry_max_s, self._jitter)
        while True:
            if self.wait_store is not None:
                await self.wait_store()
            else:
                await asyncio.sleep(backoff.next_delay_s())
            try:
                return (await self.store.get_decision(d.id)).decision
            except StoreUnavailable:
                if self.wait_store is not None:
                    # The probe may not have seen the outage yet: do not spin.
                    await asyncio.sleep(backoff.next_delay_s())

    async def _grow(self, d: DecisionRecord, deadline_s: float, fault: FaultHook) -> DecisionRecord:
        if d.state is S.PENDING:
            d = await self._step(
                d, S.PREPARING, f"asking the actuator for {d.to_replicas} replica(s)", fault
            )
        if d.state is S.PREPARING:
            await self._set_replicas(d, d.to_replicas, deadline_s)
            fault("decision:PREPARING+effect")
            d = await self._step(
                d, S.ACTUATING, "replicas requested; coordinator admits the newcomers", fault
            )
        result = await self._resize(d, deadline_s)
        fault("decision:ACTUATING+effect")
        if result.phase is Phase.COMPLETED:
            world = result.world_size or d.to_replicas
            if world < d.to_replicas:
                # Proceeded with the newcomers that came: give back the rest.
                await self._set_replicas(d, world, deadline_s)
            return await self._step(
                d,
                S.COMPLETED,
                _with_message(
                    f"generation {result.generation} runs with {world} member(s)", result
                ),
                fault,
                pause_s=result.pause_s,
                generation=result.generation,
                to_replicas=world,
                lost_steps=result.lost_steps,
            )
        # Put the replicas back before the abort is recorded: ABORTED means "runs at N".
        await self._set_replicas(d, d.from_replicas, deadline_s)
        final = S.ABORTED if result.phase is Phase.ABORTED else S.FAILED
        return await self._step(
            d,
            final,
            f"coordinator: {result.phase.name}",
            fault,
            error=result.message or "aborted",
        )

    async def _shrink(
        self, d: DecisionRecord, deadline_s: float, fault: FaultHook
    ) -> DecisionRecord:
        if d.state is S.PENDING:
            d = await self._step(
                d,
                S.PREPARING,
                f"coordinated checkpoint and drain to {d.to_replicas} member(s)",
                fault,
            )
        if d.state is S.PREPARING:
            result = await self._resize(d, deadline_s)
            fault("decision:PREPARING+effect")
            if result.phase is not Phase.COMPLETED:
                final = S.ABORTED if result.phase is Phase.ABORTED else S.FAILED
                return await self._step(
                    d,
                    final,
                    f"coordinator: {result.phase.name}",
                    fault,
                    error=result.message or "aborted",
                )
            d = await self._step(
                d,
                S.ACTUATING,
                _with_message(
                    f"generation {result.generation} runs with {result.world_size};"
                    " lowering replicas",
                    result,
                ),
                fault,
                pause_s=result.pause_s,
                generation=result.generation,
                lost_steps=result.lost_steps,
            )
        # By uid and by name: either may be all that is left to find the pod by.
        leaving = tuple(
            dict.fromkeys(
                (*_leaving_pods(d), *(str(n) for n in d.inputs.get("leaving_pod_names", []) or []))
            )
        )
        with (
            tracing.tracer().start_as_current_span(
                "tide.actuator.remove_pods",
                attributes={"tide.replicas": d.to_replicas, "tide.pods": list(leaving)},
            ),
            acting_while(self._acting(d), epoch=self.store.epochs.get(d.job_id)),
        ):
            # The pods the coordinator drained, named: lowering the count alone would
            # stop the highest index, a member of the generation just formed.
            await self._act(
                d,
                lambda: remove_pods(
                    self.actuator, d.job_id, leaving, replicas=d.to_replicas, decision_id=d.id
                ),
                deadline_s,
            )
        fault("decision:ACTUATING+effect")
        named = f" ({', '.join(leaving)} removed)" if leaving else ""
        return await self._step(
            d, S.COMPLETED, f"replicas lowered to {d.to_replicas}{named}", fault
        )

    async def record_unplanned(
        self, d: DecisionRecord, *, generation: int, lost_steps: int, detail: str
    ) -> DecisionRecord:
        """A change of world size nobody decided (a member lost without notice), put
        through the lifecycle so that the history, the feed and the job's record see it
        like any other; nothing is acted on (the coordinator already re-formed)."""
        d = await self._step(d, S.PREPARING, "the coordinator recovered without it", _no_fault)
        d = await self._step(d, S.ACTUATING, detail, _no_fault)
        return await self._step(
            d,
            S.COMPLETED,
            f"generation {generation} runs with {d.to_replicas} member(s);"
            f" {lost_steps} step(s) lost",
            _no_fault,
            generation=generation,
            lost_steps=lost_steps,
        )

    def _acting(self, d: DecisionRecord) -> Callable[[], bool]:
        return lambda: self.may_act() and self.may_act_on(d.job_id)

    def _check_lead(self, d: DecisionRecord) -> None:
        if not self._acting(d)():
            raise StaleEpoch(
                f"decision {d.id}: this scaler replica no longer leads (or holds the job's shard)"
            )

    async def _set_replicas(self, d: DecisionRecord, replicas: int, deadline_s: float) -> None:
        async def once() -> None:
            with (
                tracing.tracer().start_as_current_span(
                    "tide.actuator.set_replicas", attributes={"tide.replicas": replicas}
                ),
                acting_while(self._acting(d), epoch=self.store.epochs.get(d.job_id)),
            ):
                await self.actuator.set_replicas(d.job_id, replicas, decision_id=d.id)

        await self._act(d, once, deadline_s)

    async def _act(
        self, d: DecisionRecord, once: Callable[[], Awaitable[None]], deadline_s: float
    ) -> None:
        """An actuator call, again while it answers Unavailable (the API server out of
        reach), until ``3 × deadline_s + 30 s`` as for the coordinator; then its error
        ends the decision. Each call is idempotent (a count, read before it is
        patched), so one whose answer was lost is not applied twice."""
        give_up = self.clock.monotonic() + deadline_s * 3 + 30.0
        backoff = Backoff(self.retry_s, self.retry_max_s, self._jitter)
        while True:
            self._check_lead(d)
            try:
                await once()
                return
            except StoreUnavailable:
                raise
            except Unavailable as exc:
                if self.clock.monotonic() >= give_up:
                    raise
                logger.warning(
                    "decision %d of job %s: actuator unavailable (%s); retrying",
                    d.id,
                    d.job_id,
                    exc,
                    extra={"job_id": d.job_id, "decision_id": d.id},
                )
            await self.clock.sleep(backoff.next_delay_s())

    async def _resize(self, d: DecisionRecord, deadline_s: float) -> Progress:
        self._check_lead(d)
        with tracing.tracer().start_as_current_span(
            "tide.coordinator.Resize", attributes={"tide.target_world_size": d.to_replicas}
        ) as span:
            result = await self._resize_until_final(d, deadline_s)
            span.set_attribute("tide.phase", result.phase.name)
            if result.checkpoint_write_s > 0:
                self.checkpoint_s[d.job_id] = result.checkpoint_write_s
            return result

    async def _resize_until_final(self, d: DecisionRecord, deadline_s: float) -> Progress:
        """Run (or re-attach to) the coordinator's resize until a final phase. A broken
        stream is re-attached with the same decision id until the deadline passes."""
        leaving = _leaving_pods(d)
        spec = ResizeSpec(
            decision_id=d.id,
            job_id=d.job_id,
            target_world_size=d.to_replicas,
            deadline_s=deadline_s,
            leaving_pods=leaving,
            world_multiple=_world_multiple(d),
        )
        give_up = self.clock.monotonic() + deadline_s * 3 + 30.0
        backoff = Backoff(self.retry_s, self.retry_max_s, self._jitter)
        last_err: Exception | None = None
        while self.clock.monotonic() < give_up:
            if d.id in self.superseded:
                return Progress(d.id, Phase.ABORTED, message=self.superseded[d.id])
            try:
                async for p in self.coordinator.resize(spec):
                    if p.phase.final:
                        return p
                    logger.debug("decision %d of job %s: %s", d.id, d.job_id, p.phase.name)
                last_err = Unavailable("resize stream ended without a final phase")
            except TideError as exc:
                if not isinstance(exc, Unavailable):
                    return Progress(d.id, Phase.FAILED, message=str(exc))
                last_err = exc
            logger.warning(
                "decision %d of job %s: coordinator unreachable (%s); re-attaching",
                d.id,
                d.job_id,
                last_err,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            await self.clock.sleep(backoff.next_delay_s())
        try:
            phase = await self.coordinator.abort_resize(d.id, d.job_id, "scaler gave up waiting")
        except TideError:
            phase = Phase.FAILED
        if phase is Phase.COMPLETED or not phase.final:
            # Too late to abort (it finished, or is in RENDEZVOUS and will): the
            # outcome is the coordinator's, which may be fewer members than asked.
            return await self._late_outcome(spec)
        return Progress(d.id, phase, message=f"coordinator unreachable: {last_err}")

    async def _late_outcome(self, spec: ResizeSpec) -> Progress:
        """What a resize that could no longer be aborted really did: its own final
        progress (Resize re-attaches by decision id; the coordinator answered the
        abort, so it is reachable), else the job's status after it."""
        try:
            async for p in self.coordinator.resize(spec):
                if p.phase.final:
                    return p
        except TideError as exc:
            logger.warning(
                "decision %d of job %s: no final progress after a late abort (%s);"
                " reading the job's status",
                spec.decision_id,
                spec.job_id,
                exc,
                extra={"job_id": spec.job_id, "decision_id": spec.decision_id},
            )
        try:
            st = await self.coordinator.job_status(spec.job_id)
        except TideError as exc:
            return Progress(spec.decision_id, Phase.FAILED, message=f"outcome unknown: {exc}")
        return Progress(
            spec.decision_id,
            Phase.COMPLETED,
            generation=st.generation,
            world_size=st.world_size,
            message="too late to abort; outcome read from the job's status",
        )

    async def recover(
        self, deadline_of: Callable[[str], float]
    ) -> list[asyncio.Task[DecisionRecord | None]]:
        """Resume every decision that is not final (after a restart). PENDING
        ones are resumed too: they were committed with their inputs and nothing
        acted on them yet, so carrying them out is what was decided."""
        tasks = []
        for d in await self.store.non_final():
            if d.job_id not in self.store.epochs:
                try:
                    await self.store.acquire(d.job_id)
                except TideError as exc:
                    logger.warning(
                        "decision %d: cannot take job %s: %s",
                        d.id,
                        d.job_id,
                        exc,
                        extra={"job_id": d.job_id, "decision_id": d.id},
                    )
                    continue
            logger.info(
                "resuming decision %d of job %s from %s (%d -> %d)",
                d.id,
                d.job_id,
                d.state.value,
                d.from_replicas,
                d.to_replicas,
                extra={"job_id": d.job_id, "decision_id": d.id},
            )
            tasks.append(self.start(d, deadline_s=deadline_of(d.job_id), armed=False))
        return tasks
