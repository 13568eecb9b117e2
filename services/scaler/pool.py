"""The pool step of the scaler: which jobs want to grow now, and the GPUs already
promised to grows that are committed but not yet actuated.

Every evaluation of a job renews or drops its claim (``note``); a grow is then
passed through ``policy.arbitrate`` with every current claim (``share``), so that
when more jobs want to grow than there are free GPUs, the rule in
services/scaler/goodput.py decides who gets them. ScalerCore evaluates the jobs of
one tick (or of one batch of slid windows) first and commits afterwards, so the
claims of jobs whose condition holds at the same moment are all known when any
of them is shared. Only the claims are looked at: O(jobs that want to grow).
"""

from __future__ import annotations

from services.scaler import policy as pol
from services.scaler.goodput import Claim

#: Reasons that mean "this job wants to grow" (it grows, or there is no room).
WANTING = frozenset({pol.Reason.SUSTAINED_HIGH_UTILIZATION, pol.Reason.NO_CAPACITY})


class PoolClaims:
    def __init__(self, stale_after_s: float) -> None:
        # A claim its job's evaluations (at least one a tick) stopped renewing is gone.
        self.stale_after_s = stale_after_s
        self.claims: dict[str, Claim] = {}
        self._renewed: dict[str, float] = {}
        # GPUs of committed grows the actuator does not count yet (PENDING decisions).
        self._promised: dict[str, int] = {}

    def note(
        self,
        d: pol.Decision,
        state: pol.JobState,
        curve: tuple[tuple[int, float], ...],
        at: float,
    ) -> None:
        """Renew, make or drop ``d``'s job's claim after its evaluation at ``at``."""
        job_id = d.job_id
        if not d.wanted_replicas or d.reason not in WANTING:
            self.drop(job_id)
            return
        old = self.claims.get(job_id)
        self.claims[job_id] = Claim(
            job_id,
            state.current_replicas,
            d.wanted_replicas,
            state.gpus_per_replica,
            curve,
            old.since_s if old is not None else at,
        )
        self._renewed[job_id] = at
        for other, seen in list(self._renewed.items()):
            if at - seen > self.stale_after_s:
                self.drop(other)

    def share(self, d: pol.Decision, state: pol.JobState) -> pol.Decision:
        if len(self.claims) < 2 or d.job_id not in self.claims:
            return d
        return pol.arbitrate(d, state, tuple(self.claims.values()))

    def drop(self, job_id: str) -> None:
        self.claims.pop(job_id, None)
        self._renewed.pop(job_id, None)

    def promise(self, job_id: str, gpus: int) -> None:
        """A grow of ``gpus`` GPUs was committed; the actuator counts them once it acts."""
        self._promised[job_id] = gpus
        self.drop(job_id)

    def fulfilled(self, job_id: str) -> None:
        self._promised.pop(job_id, None)

    def free(self, actuator_free: int | None) -> int | None:
        """The free GPUs the policy may hand out: the actuator's, less those promised."""
        if actuator_free is None:
            return None
        return max(0, actuator_free - sum(self._promised.values()))
