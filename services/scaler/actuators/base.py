"""How the scaler changes a job's pod count: the Actuator interface.

One module per real actuator sits next to this one (``local.py``: launcher
processes on this machine; the Kubernetes one patches a PaddleJob). The
in-memory and file-backed doubles are in services.testing.actuators; one
contract suite (tests/scaler/test_actuator_contract.py) runs over all of them.

``set_replicas`` is idempotent: asking for the count a job already has is not
a change, so a resumed decision may repeat it safely.

An actuator that can stop named pods (not only the highest indexes) also
implements :class:`PodRemover`; the controller goes through
:func:`remove_pods`, which falls back to ``set_replicas`` for one that cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


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
