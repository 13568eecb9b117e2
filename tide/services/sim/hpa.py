"""The Kubernetes HPA path and static allocation, as the simulator runs them.

The HPA's rules, from its documentation and kubernetes/kubernetes
pkg/controller/podautoscaler (replica_calculator.go, horizontal.go), with the
defaults of pkg/apis/autoscaling/v2 (docs/simulate.md cites each):

1. every ``sync_s`` (15 s) the metric is read: the pods' GPU utilization as the
   DCGM exporter collected it (every 30 s) and Prometheus scraped it (every
   60 s): a value up to a minute and a half old;
2. ``desired = ceil(current × metric / target)``, unless the ratio is within
   ``tolerance`` (0.1) of 1, then ``current``;
3. stabilization: the result is kept between the lowest recommendation of the
   scale-up window (0 s) and the highest of the scale-down window (300 s);
4. rate: up to max(+4 pods, +100 %) per 15 s, down to -100 % per 15 s,
   counted from the size at the start of the period; then min/max replicas.

What the replica change then does is the path's real cost: an elastic
PaddleJob (or PyTorchJob) restarts every worker when its world size changes,
from the last periodic checkpoint: work since then is lost and the relaunch
is paid, on every change, up or down.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tide.services.sim.scenario import Hpa
from tide.services.sim.simulation import Run, Simulation


@dataclass
class HpaState:
    desired: int = 0
    recs: list[tuple[float, int]] = field(default_factory=list)
    ups: list[tuple[float, int]] = field(default_factory=list)
    downs: list[tuple[float, int]] = field(default_factory=list)
    # Phases of the periodic parts, so that jobs do not all sync in the same instant.
    sync_phase: float = 0.0
    collect_phase: float = 0.0
    scrape_phase: float = 0.0
    # How long after what prompted it the HPA first asked for pods not yet joined.
    pending_reaction_s: float | None = None


def recommend(cur: int, metric: float, hpa: Hpa) -> int:
    """Step 2: the replica calculator's answer for one utilization metric."""
    ratio = metric / hpa.target_util_pct
    if abs(1.0 - ratio) <= hpa.tolerance:
        return cur
    return max(0, math.ceil(cur * ratio))


def normalize(st: HpaState, cur: int, desired: int, now: float, hpa: Hpa, lo: int, hi: int) -> int:
    """Steps 3 and 4: stabilization and rate limits, then the bounds. Records the
    recommendation (``st.recs``); the caller records the scale event it makes."""
    up_cut = now - hpa.upscale_stabilization_s
    down_cut = now - hpa.downscale_stabilization_s
    up_rec = desired
    down_rec = desired
    for t, r in st.recs:
        if t > up_cut:
            up_rec = min(up_rec, r)
        if t > down_cut:
            down_rec = max(down_rec, r)
    st.recs = [(t, r) for t, r in st.recs if t > min(up_cut, down_cut)]
    st.recs.append((now, desired))
    rec = cur
    if rec < up_rec:
        rec = up_rec
    if rec > down_rec:
        rec = down_rec
    period = now - hpa.period_s
    st.ups = [(t, n) for t, n in st.ups if t > period]
    st.downs = [(t, n) for t, n in st.downs if t > period]
    start = cur - sum(n for _, n in st.ups) + sum(n for _, n in st.downs)
    if rec > cur:
        limit = max(start + hpa.scale_up_pods, math.ceil(start * (1 + hpa.scale_up_percent / 100)))
        rec = min(rec, max(limit, cur), hi)
    elif rec < cur:
        limit = int(start * (1 - hpa.scale_down_percent / 100))
        rec = max(rec, min(limit, cur), lo)
    return max(lo, min(hi, rec))


class HpaPath:
    """The HPA fed by DCGM through Prometheus, scaling an elastic job that restarts."""

    name = "hpa"

    def attach(self, sim: Simulation) -> None:
        self.sim = sim
        self.hpa = sim.s.hpa
        self.rng = random.Random(sim.s.seed + 1)

    def _st(self, r: Run) -> HpaState:
        st = r.ctl.get("hpa")
        if st is None:
            h = self.hpa
            st = r.ctl["hpa"] = HpaState(
                desired=r.spec.initial_replicas,
                sync_phase=self.rng.uniform(0, h.sync_s),
                collect_phase=self.rng.uniform(0, h.dcgm_collect_s),
                scrape_phase=self.rng.uniform(0, h.scrape_s),
            )
        return st

    def on_arrival(self, r: Run) -> None:
        self._st(r)
        self._start_queued()

    def _start_queued(self) -> None:
        sim = self.sim
        for r in list(sim.queue):
            st = self._st(r)
            n = min(st.desired, sim.cluster.fits(st.desired, r.gpr))
            if n < r.spec.min_replicas or not sim.launch(r, n):
                return  # first come, first served
            first = sim.now + st.sync_phase
            sim.at(first, self._sync, r)

    def metric(self, r: Run, st: HpaState, now: float) -> float | None:
        """The utilization the HPA sees at ``now``: collected by DCGM, then scraped."""
        h = self.hpa
        scraped = math.floor((now - st.scrape_phase) / h.scrape_s) * h.scrape_s + st.scrape_phase
        collected = (
            math.floor((scraped - st.collect_phase) / h.dcgm_collect_s) * h.dcgm_collect_s
            + st.collect_phase
        )
        if r.started_at is None or collected < r.started_at:
            return None
        return r.util_at(collected)

    def _sync(self, r: Run) -> None:
        sim = self.sim
        if r.state != "running":
            return
        sim.after(self.hpa.sync_s, self._sync, r)
        st = self._st(r)
        m = self.metric(r, st, sim.now)
        if m is None:
            return
        cur = st.desired
        spec = r.spec
        want = recommend(cur, m, self.hpa)
        new = normalize(st, cur, want, sim.now, self.hpa, spec.min_replicas, spec.max_replicas)
        if new == cur:
            return
        (st.ups if new > cur else st.downs).append((sim.now, abs(new - cur)))
        st.desired = new
        # A decision on metrics older than the job's last change is not a reaction to it.
        reaction = sim.now - r.trigger_at if r.trigger_at <= sim.now else None
        if new < r.held:
            # Pods are deleted; the job restarts without them.
            sim.release(r, r.held - new)
            sim.restart(r, min(r.world, new), f"hpa {cur} -> {new}", reaction)
        else:
            if st.pending_reaction_s is None:
                st.pending_reaction_s = reaction
            self._place(r)

    def _place(self, r: Run) -> None:
        """Pods of the desired count that fit are created; once they have started the job
        restarts with every pod it has (elastic Paddle re-forms on a membership change)."""
        st = self._st(r)
        add = st.desired - r.held
        if add <= 0:
            return
        placed = self.sim.place(r, add)
        if placed:
            self.sim.after(self.sim.s.pauses.pod_start_s, self._joined, r, r.held)

    def _joined(self, r: Run, held: int) -> None:
        sim = self.sim
        if r.state != "running" or r.held != held or r.world == held:
            return
        st = self._st(r)
        sim.restart(r, held, f"hpa {r.world} -> {held}", st.pending_reaction_s)
        st.pending_reaction_s = None

    def on_capacity(self) -> None:
        self._start_queued()
        for r in self.sim.runs:
            if r.state == "running" and self._st(r).desired > r.held:
                self._place(r)

    def on_changed(self, r: Run) -> None:
        return None

    def on_notice(self, r: Run, replicas: int, deadline_s: float, node: int | None) -> None:
        # Nothing to coordinate: the pods are killed at the deadline (the engine does it),
        # the job restarts from its last checkpoint, and the HPA's count stays as it was.
        return None


class Static:
    """Each job gets its static_replicas when they fit, first come first served, and keeps
    them; a replica lost with a node is replaced when GPUs come free (a restart)."""

    name = "static"

    def attach(self, sim: Simulation) -> None:
        self.sim = sim

    def on_arrival(self, r: Run) -> None:
        self.on_capacity()

    def on_capacity(self) -> None:
        sim = self.sim
        for r in list(sim.queue):
            if not sim.launch(r, r.spec.static_replicas):
                break
        for r in sim.runs:
            if r.state == "running" and r.held < r.spec.static_replicas and not r.resizing:
                placed = sim.place(r, r.spec.static_replicas - r.held)
                if placed:
                    sim.after(sim.s.pauses.pod_start_s, self._rejoin, r, r.held)

    def _rejoin(self, r: Run, held: int) -> None:
        if r.state == "running" and r.held == held and r.world != held:
            self.sim.restart(r, held, "replaced")

    def on_changed(self, r: Run) -> None:
        return None

    def on_notice(self, r: Run, replicas: int, deadline_s: float, node: int | None) -> None:
        return None
