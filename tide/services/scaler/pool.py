"""The pool step of the scaler: ``arbitrate`` (pure: how contended free GPUs are
shared), which jobs want to grow now, and the GPUs already promised to grows
that are committed but not yet actuated.

Every evaluation of a job renews or drops its claim (``note``); a grow is then
passed through ``arbitrate`` with every current claim (``share``), so that
when more jobs want to grow than there are free GPUs, the rule in
tide/services/scaler/goodput.py decides who gets them. ScalerCore evaluates the jobs of
one tick (or of one batch of slid windows) first and commits afterwards, so the
claims of jobs whose condition holds at the same moment are all known when any
of them is shared. Only the claims are looked at: O(jobs that want to grow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tide.services.scaler import policy as pol
from tide.services.scaler.goodput import Claim, PoolRule, allocate

#: Reasons that mean "this job wants to grow" (it grows, or there is no room).
WANTING = frozenset({*(r for r in pol.Reason if r.grows), pol.Reason.NO_CAPACITY})


def arbitrate(
    d: pol.Decision, job: pol.JobState, claims: Sequence[Claim], rule: PoolRule = PoolRule.MARGINAL
) -> pol.Decision:
    """The pool step after ``decide``: ``d`` is a grow of ``job`` and ``claims`` are every
    job that wants to grow now (``job``'s own included). When the free GPUs cannot serve
    them all, each next replica goes by ``rule`` (the scaler's: the highest throughput
    the replica adds per GPU, tide/services/scaler/goodput.py); ``d`` keeps what it was
    granted, or becomes POOL_CONTENDED."""
    free = job.free_gpus
    if free is None or not d.reason.grows or not d.resize:
        return d
    if sum(c.wanted_gpus for c in claims) <= free:
        return d
    granted = allocate(free, claims, rule)
    mine = granted.get(job.job_id, 0)
    shares = [
        {
            "job_id": c.job_id,
            "wanted_gpus": c.wanted_gpus,
            "next_efficiency": round(c.next_efficiency(c.current_replicas), 4),
            "granted_gpus": granted.get(c.job_id, 0) * c.gpus_per_replica,
        }
        for c in sorted(claims, key=lambda c: c.job_id)
    ]
    evidence = {"free_gpus": free, "rule": rule.value, "claims": shares}
    inputs = {**d.inputs, "pool": evidence}
    others = ", ".join(
        f"{s['job_id']} {s['granted_gpus']} (next replica {s['next_efficiency']:.2f})"
        for s in shares
        if s["job_id"] != job.job_id and s["granted_gpus"]
    )
    cur = job.current_replicas
    if mine <= 0:
        return replace(
            d,
            reason=pol.Reason.POOL_CONTENDED,
            message=f"{d.message}; but {free} free GPU(s) are wanted by "
            f"{len(claims)} jobs and go to {others or 'none'} by the {rule.value} rule",
            to_replicas=cur,
            inputs=inputs,
        )
    to = min(d.to_replicas, cur + mine)
    note = (
        f"; {mine * job.gpus_per_replica} of {free} contended free GPU(s) by the {rule.value} rule"
    )
    if others:
        note += f" (others: {others})"
    return replace(d, to_replicas=to, message=d.message + note, inputs=inputs)


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
        return arbitrate(d, state, tuple(self.claims.values()))

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
