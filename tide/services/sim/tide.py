"""Tide in the simulator: the scaler's real window, policy and pool step on generated
telemetry.

Each job has a ``tide.services.scaler.windows.JobWindow`` fed one sample per GPU per
telemetry interval with what its GPUs show (0 while a resize pauses it); each
evaluation builds the same ``JobState``/``History`` the scaler builds and calls
``policy.decide``; jobs evaluated at the same instant are decided first and then
shared by ``pool.arbitrate`` (the pool rule; ``tide-fcfs`` swaps in first come,
first served for the comparison). The throughput the goodput guard sees is the
job's rate at each size it ran at, once the size has settled
(``goodput.SETTLE_S``), as the coordinator would report it.

A job is evaluated only while its decision can change: around the moment its
window may come to hold its sustain condition (a load change, a resize's end,
a cooldown's end, each plus the sustain, give or take a bucket), at the end of
a cooldown, and when GPUs come free while it wants them. Between those the
answer cannot move, so no evaluation is skipped that could have acted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tide.services.scaler import goodput as gp
from tide.services.scaler import policy as pol
from tide.services.scaler.pool import arbitrate
from tide.services.scaler.windows import JobWindow
from tide.services.sim.simulation import Run, Simulation

_WAKE_ON_CAPACITY = frozenset({pol.Reason.NO_CAPACITY, pol.Reason.POOL_CONTENDED})


@dataclass
class TideState:
    # The policy with the job's own bounds (as the scaler merges a job's min/max).
    policy: pol.PolicySettings
    window: JobWindow
    fed_to: float = -math.inf
    recs: list[tuple[float, int]] = field(default_factory=list)
    last_end: float | None = None
    last_dir: int = 0
    last_from: int = 0
    curve: dict[int, float] = field(default_factory=dict)
    next_eval: float | None = None
    claim_since: float | None = None
    reason: pol.Reason | None = None
    notice: tuple[int, float, int | None] | None = None
    # Agents attribute a GPU to the job once its pod is a member: from its first step.
    members_since: float = math.inf


class TideController:
    def __init__(self, rule: gp.PoolRule = gp.PoolRule.MARGINAL) -> None:
        self.rule = rule
        self.name = "tide" if rule is gp.PoolRule.MARGINAL else "tide-fcfs"
        self.evaluations = 0

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        self.p = sim.s.tide.policy
        self.interval = sim.s.tide.telemetry_interval_s
        self.step = sim.s.tide.eval_step_s
        self._tick_at: float | None = None
        self.claims: dict[str, gp.Claim] = {}

    def _st(self, r: Run) -> TideState:
        st = r.ctl.get("tide")
        if st is None:
            p = self.p.with_overrides(
                {"min_replicas": r.spec.min_replicas, "max_replicas": r.spec.max_replicas}
            )
            st = r.ctl["tide"] = TideState(p, JobWindow(p.bucket_s, p.buckets))
        return st

    # -- the engine's calls ----------------------------------------------------------------------

    def on_arrival(self, r: Run) -> None:
        self._start_queued()

    def _start_queued(self) -> None:
        """A new job starts at its initial size, or at what fits down to its minimum
        (the JOB_STARTED decision; pods that do not fit would wait), in arrival order."""
        sim = self.sim
        for r in list(sim.queue):
            spec = r.spec
            n = min(spec.initial_replicas, sim.cluster.fits(spec.initial_replicas, r.gpr))
            if n < spec.min_replicas or not sim.launch(r, n):
                return
            self._st(r).members_since = r.paused_until
            if self.p.scaled_on is pol.Signal.THROUGHPUT:
                # It grows from the size it started at: that one is measured too (the
                # figures of the other signals keep the seed's model: resizes only).
                sim.at(r.paused_until + gp.SETTLE_S, self._measure, r, n)
            self._wake(r, r.paused_until)

    def on_capacity(self) -> None:
        self._start_queued()
        for r in self.sim.runs:
            st = r.ctl.get("tide")
            if r.state == "running" and st is not None and st.reason in _WAKE_ON_CAPACITY:
                r.trigger_at = self.sim.now
                self._wake(r, self.sim.now)

    def on_changed(self, r: Run) -> None:
        st = self._st(r)
        sim = self.sim
        if r.resizes and not r.resizing and r.resizes[-1].at_s >= (st.last_end or -math.inf):
            last = r.resizes[-1]
            st.last_end = sim.now
            st.last_dir = (last.to_replicas > last.from_replicas) - (
                last.to_replicas < last.from_replicas
            )
            st.last_from = last.from_replicas
            st.recs.clear()
            sim.after(gp.SETTLE_S, self._measure, r, r.world)
        if st.notice is not None and not r.resizing:
            replicas, deadline, node = st.notice
            st.notice = None
            if sim.now < deadline:
                self.on_notice(r, replicas, deadline, node)
        self._wake(r, sim.now)

    def on_notice(self, r: Run, replicas: int, deadline_s: float, node: int | None) -> None:
        st = self._st(r)
        if r.resizing:
            st.notice = (replicas, deadline_s, node)  # after the resize in progress
            return
        state = pol.JobState(
            r.name,
            r.world,
            r.gpr,
            terminating_replicas=replicas,
            terminating_node=f"node-{node}" if node is not None else "(preempted)",
            terminating_deadline_s=deadline_s,
        )
        d = pol.decide(
            state, self._view(r, st, self.sim.now), st.policy, self._history(st), self.sim.now
        )
        self.evaluations += 1
        if d.resize:
            self.sim.shrink(r, d.to_replicas, d.reason.name, {node} if node is not None else None)

    def _measure(self, r: Run, world: int) -> None:
        if r.state == "running" and r.world == world and not r.resizing:
            self._st(r).curve[world] = r.rate(self.sim.now)
            self._wake(r, self.sim.now)

    # -- evaluation ----------------------------------------------------------------------------------

    def _wake(self, r: Run, t: float) -> None:
        st = self._st(r)
        if st.next_eval is None or t < st.next_eval:
            st.next_eval = t
        self._arm(t)

    def _arm(self, t: float) -> None:
        t = math.ceil(t / self.step - 1e-9) * self.step
        if self._tick_at is None or t < self._tick_at:
            self._tick_at = t
            self.sim.at(t, self._tick, t)

    def _tick(self, t: float) -> None:
        if self._tick_at != t:
            return  # superseded by an earlier tick
        self._tick_at = None
        sim = self.sim
        due = [
            r
            for r in sim.runs
            if r.state == "running"
            and (st := r.ctl.get("tide")) is not None
            and st.next_eval is not None
            and st.next_eval <= t + 1e-9
        ]
        staged = [(r, *self._decide(r, t)) for r in due]
        for r, d, state, view, hist in staged:
            free = sim.cluster.free_gpus()
            if d.wanted_replicas and free != state.free_gpus:
                # Grows of this same instant took GPUs: decide with what is left (as the
                # scaler does within one batch).
                state = pol.JobState(r.name, r.world, r.gpr, free_gpus=free)
                d = pol.decide(state, view, self._st(r).policy, hist, t)
            self._apply(r, self._share(d, state), t, (state, view, hist))
        nxt = [
            st.next_eval
            for r in sim.runs
            if r.state == "running"
            and (st := r.ctl.get("tide")) is not None
            and st.next_eval is not None
        ]
        if nxt:
            self._arm(max(min(nxt), t + self.step))

    def _feed(self, r: Run, st: TideState, t: float) -> None:
        """One sample per telemetry interval up to ``t``: what the job's GPUs showed."""
        w = st.window
        span = (self.p.buckets + 1) * self.p.bucket_s
        first = max(st.fed_to, t - span, st.members_since - self.interval)
        k = math.floor(first / self.interval) + 1
        ts = k * self.interval
        segs = r.segments
        sm_ratio, tensor_ratio = r.spec.sm_active_ratio, r.spec.tensor_active_ratio
        gpm = sm_ratio is not None and tensor_ratio is not None
        sm_ratio = sm_ratio or 0.0
        tensor_ratio = tensor_ratio or 0.0
        i = 0
        while ts <= t:
            while i + 1 < len(segs) and segs[i + 1][0] <= ts:
                i += 1
            u = segs[i][1] if segs and segs[0][0] <= ts else 0.0
            if gpm:
                w.add(w.slot_of(ts), u, 1, 1, u * sm_ratio, u * tensor_ratio)
            else:
                w.add(w.slot_of(ts), u, 1)
            ts += self.interval
        st.fed_to = max(st.fed_to, t)

    def _view(self, r: Run, st: TideState, t: float) -> pol.WindowView:
        self._feed(r, st, t)
        gpus = r.world * r.gpr
        return st.window.view(t, self.p.buckets, gpus, gpus)

    def _history(self, st: TideState) -> pol.History:
        return pol.History(
            st.last_end,
            st.last_dir,
            tuple(st.recs),
            last_from_replicas=st.last_from,
            throughput=tuple(sorted(st.curve.items())),
        )

    def _decide(
        self, r: Run, t: float
    ) -> tuple[pol.Decision, pol.JobState, pol.WindowView, pol.History]:
        st = self._st(r)
        free = self.sim.cluster.free_gpus()
        state = pol.JobState(r.name, r.world, r.gpr, resize_in_progress=r.resizing, free_gpus=free)
        view, hist = self._view(r, st, t), self._history(st)
        d = pol.decide(state, view, st.policy, hist, t)
        self.evaluations += 1
        if d.recommendation is not None:
            st.recs.append((t, d.recommendation))
            horizon = t - st.policy.scale_down_stabilization_s
            while st.recs and st.recs[0][0] < horizon:
                st.recs.pop(0)
        wanting = d.wanted_replicas and (d.reason.grows or d.reason is pol.Reason.NO_CAPACITY)
        if wanting:
            st.claim_since = st.claim_since if st.claim_since is not None else t
            self.claims[r.name] = gp.Claim(
                r.name,
                r.world,
                d.wanted_replicas,
                r.gpr,
                tuple(sorted(st.curve.items())),
                st.claim_since,
            )
        else:
            st.claim_since = None
            self.claims.pop(r.name, None)
        return d, state, view, hist

    def _share(self, d: pol.Decision, state: pol.JobState) -> pol.Decision:
        live = [c for name, c in self.claims.items() if self.sim.by_name[name].state == "running"]
        if len(live) < 2 or d.job_id not in self.claims:
            return d
        return arbitrate(d, state, live, self.rule)

    def _apply(
        self,
        r: Run,
        d: pol.Decision,
        t: float,
        inputs: tuple[pol.JobState, pol.WindowView, pol.History],
    ) -> None:
        st = self._st(r)
        st.reason = d.reason
        st.next_eval = None
        sim = self.sim
        if d.resize:
            self.claims.pop(r.name, None)
            st.claim_since = None
            reaction = t - r.trigger_at
            if d.direction > 0:
                sim.grow(r, d.to_replicas, d.reason.name, reaction)
            else:
                sim.shrink(r, d.to_replicas, d.reason.name)
                r.resizes[-1].reaction_s = reaction
            return
        st.next_eval = self._next(r, st, d, t, inputs)

    def _next(
        self,
        r: Run,
        st: TideState,
        d: pol.Decision,
        t: float,
        inputs: tuple[pol.JobState, pol.WindowView, pol.History],
    ) -> float | None:
        """When this job's decision could next differ (None: not until something happens):
        what the time alone changes, the policy says (``policy.answer_holds_until``); what
        the simulated load changes, its segments."""
        p = st.policy
        if d.reason is pol.Reason.RESIZE_IN_PROGRESS or d.reason in _WAKE_ON_CAPACITY:
            return None
        state, view, hist = inputs
        until = pol.answer_holds_until(d, state, view, p, hist, t, exact=False)
        if until <= t:
            return t + self.step
        held = until if until < math.inf else None
        # The sustain condition can start to hold a sustain after what the GPUs show last
        # changed (a load change, a pause's start or end), after the last resize ended,
        # or after its cooldown ended (a reversal), give or take a bucket (the oldest
        # bucket may hold a few earlier samples).
        # Only a load outside the band can come to hold a sustain condition: a job whose
        # GPUs now show a level inside it needs no evaluation until that changes (a
        # condition can stop holding on its own, never start).
        sig = p.scaled_on
        if sig is pol.Signal.THROUGHPUT:
            return held  # the curve changes only when measured (_measure wakes the job)
        shown = r.util_at(t)
        if sig.gpm:
            ratio = (
                r.spec.sm_active_ratio
                if sig is pol.Signal.SM_ACTIVE
                else r.spec.tensor_active_ratio
            )
            if ratio is None:
                return held  # NO_SIGNAL until the GPUs change: they never do here
            shown *= ratio
        down, _, up = p.band
        if down <= shown <= up:
            return held
        recent = t - p.sustain_s - p.bucket_s
        anchors = [start for start, _ in r.segments if start >= recent]
        if st.last_end is not None:
            anchors += [st.last_end, st.last_end + p.cooldown_s]
        nxt = held
        for a in anchors:
            lo, hi = a + p.sustain_s - p.bucket_s, a + p.sustain_s + p.bucket_s
            cand = max(lo, t + self.step)
            if cand <= hi and (nxt is None or cand < nxt):
                nxt = cand
        return nxt
