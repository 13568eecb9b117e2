"""How the scaler changes a job's pod count: the Actuator interface.

One module per real actuator sits next to this one (``local.py``: launcher
processes on this machine; the Kubernetes one patches a PaddleJob). The
in-memory and file-backed doubles are in tide.services.testing.actuators; one
contract suite (tests/scaler/test_actuator_contract.py) runs over all of them.

``set_replicas`` is idempotent: asking for the count a job already has is not
a change, so a resumed decision may repeat it safely.

An actuator that can stop named pods (not only the highest indexes) also
implements :class:`PodRemover`; the controller goes through
:func:`remove_pods`, which falls back to ``set_replicas`` for one that cannot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Protocol, runtime_checkable

from tide.services.scaler.errors import StaleEpoch

#: Whether the scaler replica that asked for this change still leads
#: (tide/services/scaler/leases.py), for the actuator to ask before each write it
#: retries. The controller asks right before it calls the actuator; but an
#: actuator that read, lost a race (409, a changed file), and read again, would
#: otherwise apply a paused old leader's change on top of what the new leader did
#: meanwhile (bench.failover saw exactly that). A context variable rather than a
#: parameter: it reaches the worker threads (asyncio.to_thread copies the context)
#: and the retry loops inside each actuator without changing the interface.
_may_act: ContextVar[Callable[[], bool]] = ContextVar("tide_actuator_may_act")
#: The owner epoch (tide/services/scaler/store) under which the asking replica holds the
#: job. An actuator whose target can carry it (the Kubernetes one: an annotation on
#: the PaddleJob) writes it with each change and refuses to write under an older
#: one: fencing by data, where ``may_act`` is the replica's own view of its lease.
_owner_epoch: ContextVar[int | None] = ContextVar("tide_actuator_owner_epoch", default=None)


@contextlib.contextmanager
def acting_while(may_act: Callable[[], bool], *, epoch: int | None = None) -> Iterator[None]:
    """Actuator calls inside this block check ``may_act`` before each write, and carry
    ``epoch`` (the job's owner epoch) where the actuator fences by it."""
    token = _may_act.set(may_act)
    epoch_token = _owner_epoch.set(epoch)
    try:
        yield
    finally:
        _owner_epoch.reset(epoch_token)
        _may_act.reset(token)


def owner_epoch() -> int | None:
    """The job's owner epoch given to :func:`acting_while`; None outside it or unknown."""
    return _owner_epoch.get()


def check_still_leading(job_id: str, decision_id: int) -> None:
    """Before each write of an actuator (the first and every retry): StaleEpoch if the
    replica that asked no longer leads. Outside :func:`acting_while`, nothing to check."""
    may_act = _may_act.get(None)
    if may_act is not None and not may_act():
        raise StaleEpoch(
            f"job {job_id}: decision {decision_id}: this scaler replica no longer leads;"
            " the change is not applied"
        )


class Actuator(Protocol):
    def adopt(self, job_id: str, *, replicas: int, gpus_per_replica: int) -> None:
        """The scaler owns this job, recorded at ``replicas`` pods of
        ``gpus_per_replica`` GPUs; called at start and whenever the job's record
        changes. An actuator that keeps its own record of the job (the local
        one's replicas file, a PaddleJob's spec) ignores what it already knows;
        none may change any pod here: only ``set_replicas`` does."""
        ...

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        """Ask for ``replicas`` pods of the job; returns once the request is accepted."""
        ...

    async def get_replicas(self, job_id: str) -> int | None:
        """Replicas the job is asked to run; None when the actuator does not know the job."""
        ...

    async def free_gpus(self) -> int | None:
        """GPUs free for growth in the cluster; None when unknown."""
        ...


@runtime_checkable
class PodRemover(Protocol):
    """The optional capability a preemption needs (docs/preemption.md): the pods on a
    dying node go, not whichever have the highest indexes, which would stop a member
    of the generation that just formed without them."""

    async def remove_pods(
        self, job_id: str, pods: Sequence[str], *, replicas: int, decision_id: int
    ) -> None:
        """Ask for ``replicas`` pods of the job, stopping ``pods`` (names or uids) first
        and the highest indexes only for the rest. Idempotent: a named pod already
        gone is not a change, and neither is a repeat."""
        ...


async def remove_pods(
    actuator: Actuator, job_id: str, pods: Sequence[str], *, replicas: int, decision_id: int
) -> None:
    """Lower the job to ``replicas``, the named ``pods`` first where the actuator can
    name them; otherwise by count, which is all an index-ordered operator offers."""
    if pods and isinstance(actuator, PodRemover):
        await actuator.remove_pods(job_id, pods, replicas=replicas, decision_id=decision_id)
    else:
        await actuator.set_replicas(job_id, replicas, decision_id=decision_id)
