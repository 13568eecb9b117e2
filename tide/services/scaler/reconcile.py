"""Reconcile, don't assume: each job's size as the scaler recorded it, against what
the actuator and the coordinator report.

The scaler's view of a job is its last completed decision: ``current_replicas``
and ``generation`` in the job's row. Two other parties hold their own truth: the
actuator (the PaddleJob's replicas, the local launchers) and the coordinator
(the world size of the job's current generation). They can part from the view
without any decision of ours: someone edits the PaddleJob by hand, a restart
loses a step the scaler believes was taken, the coordinator is restored from an
older state. A scaler that only ever writes would not notice and would decide
from a size that is not there.

So, at start, on taking the lead, and every ``reconcile_interval_s``, the loop
reads both (:class:`Observed`) and :func:`compare` tells whether they drifted.
A drift is logged with the job id, counted (``tide_scaler_drift_total``) and put
right through a recorded decision (reason and trigger ``RECONCILE``) from the
observed size back to the view: the controller's ordinary road, so the history,
the feed and ``tide explain`` show it, and each step commits before it acts.
Never a silent fix.

Not drift: a job with a decision in flight (the parties are between sizes), a
coordinator that has no generation yet, and a generation newer than the last one
recorded: it re-formed without a decision of ours (a member lost without notice,
recorded as MEMBER_LOST by the loop, ``ScalerCore._record_loss``; or a member
come back). After such a loss the actuator is still asked for the size before it
(the lost pod comes back through the scale-up path), so that is what its
replicas are compared with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tide.base.errors import NotFound, TideError
from tide.services.scaler.actuators import Actuator
from tide.services.scaler.coordination import CoordinatorClient
from tide.services.scaler.policy import Decision, Reason, Trigger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Observed:
    """What the other parties report for one job; None where one could not say."""

    actuator_replicas: int | None
    coordinator_world_size: int | None
    coordinator_generation: int | None


@dataclass(frozen=True)
class Drift:
    job_id: str
    view_replicas: int
    view_generation: int
    observed: Observed
    #: Who disagrees with the view: "actuator", "coordinator", or both.
    sources: tuple[str, ...]

    @property
    def observed_replicas(self) -> int:
        """The size the correction starts from: the actuator's if it drifted, else the
        coordinator's world size."""
        o = self.observed
        if "actuator" in self.sources and o.actuator_replicas is not None:
            return o.actuator_replicas
        assert o.coordinator_world_size is not None
        return o.coordinator_world_size

    def describe(self) -> str:
        o = self.observed
        parts = []
        if "actuator" in self.sources:
            parts.append(f"the actuator runs {o.actuator_replicas} replica(s)")
        if "coordinator" in self.sources:
            parts.append(
                f"the coordinator's generation {o.coordinator_generation} has"
                f" {o.coordinator_world_size} member(s)"
            )
        return (
            f"{' and '.join(parts)}, but the last decision left {self.view_replicas}"
            f" (generation {self.view_generation}); putting back {self.view_replicas}"
        )

    def decision(self) -> Decision:
        """The corrective decision: from what was observed back to the recorded size."""
        return Decision(
            self.job_id,
            Reason.RECONCILE,
            self.describe(),
            self.observed_replicas,
            self.view_replicas,
            trigger=Trigger.RECONCILE,
            raw_target=self.view_replicas,
        )

    def inputs(self) -> dict[str, Any]:
        """What ``tide explain`` shows for the corrective decision."""
        o = self.observed
        return {
            "current_replicas": self.view_replicas,
            "drift": {
                "sources": list(self.sources),
                "view_replicas": self.view_replicas,
                "view_generation": self.view_generation,
                "actuator_replicas": o.actuator_replicas,
                "coordinator_world_size": o.coordinator_world_size,
                "coordinator_generation": o.coordinator_generation,
            },
        }


def compare(
    job_id: str,
    view_replicas: int,
    view_generation: int,
    observed: Observed,
    *,
    asked_replicas: int | None = None,
) -> Drift | None:
    """Pure: the drift between the view and ``observed``, or None when they agree.

    ``asked_replicas``: what the actuator was last asked for when that differs from
    the view, i.e. after a member was lost without notice (its pod is still asked
    for and comes back through the scale-up path); None means the view. The
    correction always goes to the view, which differs from what was observed."""
    sources: list[str] = []
    # After a loss, the actuator may run what it is asked for or the job's size now
    # (its lost pod given up): both agree with the record; anything else does not.
    agreeing = {view_replicas, view_replicas if asked_replicas is None else asked_replicas}
    if observed.actuator_replicas is not None and observed.actuator_replicas not in agreeing:
        sources.append("actuator")
    world, generation = observed.coordinator_world_size, observed.coordinator_generation
    # A generation newer than the view re-formed without a decision of ours (a member
    # lost, or come back): the loop records it; it is not ours to undo.
    if world and generation and generation <= view_generation and world != view_replicas:
        sources.append("coordinator")
    if not sources:
        return None
    return Drift(job_id, view_replicas, view_generation, observed, tuple(sources))


async def observe(job_id: str, actuator: Actuator, coordinator: CoordinatorClient) -> Observed:
    """Ask both parties. One that fails (unreachable, does not know the job) says nothing:
    a missing answer is not a drift, and the next pass asks again."""
    replicas: int | None
    try:
        replicas = await actuator.get_replicas(job_id)
    except TideError as exc:
        logger.info(
            "job %s: reconcile: no actuator replicas: %s", job_id, exc, extra={"job_id": job_id}
        )
        replicas = None
    try:
        st = await coordinator.job_status(job_id)
    except NotFound:
        return Observed(replicas, None, None)
    except TideError as exc:
        logger.info(
            "job %s: reconcile: no coordinator status: %s", job_id, exc, extra={"job_id": job_id}
        )
        return Observed(replicas, None, None)
    return Observed(replicas, st.world_size, st.generation)
