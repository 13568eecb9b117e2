"""Which jobs the scaler evaluates at once, between its once-a-second ticks.

Ingestion reports every slot a job's window slides by (the first sample of a
slot) and every node notice; :class:`Triggers` keeps them until the loop takes
them, and lets through the jobs whose window has just come to meet their
policy's sustain condition (``policy.sustained``: a few µs on the window
alone), and every job with a notice. The tick sees the rest: what time alone
changes (a cooldown ending) and a condition that goes on holding (a job at its
maximum).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping

from tide.services.scaler import policy as pol

#: The window of a job slid to a time, for the check (no coverage needed).
ViewAt = Callable[[str, float], pol.WindowView]


class Triggers:
    def __init__(self) -> None:
        self._dirty: dict[str, float] = {}
        self._urgent: set[str] = set()
        self._sustained: dict[str, int] = {}
        # When ingestion saw each tipping sample (the decision latency's parts).
        self.seen_at: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self._dirty)

    def slot_opened(self, job_id: str, t: float, now: float) -> None:
        if job_id not in self._dirty:
            self._dirty[job_id] = t
            self.seen_at[job_id] = now

    def noticed(self, job_id: str, now: float) -> None:
        self._urgent.add(job_id)
        self.slot_opened(job_id, now, now)

    def take(
        self,
        view_at: ViewAt,
        policies: Mapping[str, pol.PolicySettings],
        resizing: Container[str],
        now: float,
    ) -> list[tuple[str, float]]:
        """The (job, tipping time) pairs to evaluate now; the others are dropped."""
        dirty = list(self._dirty.items())
        urgent = self._urgent
        self._dirty = {}
        self._urgent = set()
        due = []
        for job_id, t in dirty:
            if job_id in urgent or self._tipped(job_id, t, view_at, policies, resizing, now):
                due.append((job_id, t))
            else:
                self.seen_at.pop(job_id, None)
        return due

    def _tipped(
        self,
        job_id: str,
        t: float,
        view_at: ViewAt,
        policies: Mapping[str, pol.PolicySettings],
        resizing: Container[str],
        now: float,
    ) -> bool:
        p = policies.get(job_id)
        if p is None:
            return False
        holds = pol.sustained(view_at(job_id, max(t, now)), p)
        before = self._sustained.get(job_id, 0)
        self._sustained[job_id] = holds
        return holds != 0 and holds != before and job_id not in resizing
