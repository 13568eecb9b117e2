"""The discrete-event simulation of one policy on one scenario.

Time jumps from event to event (a heap). Between events every job trains at a
constant rate, so its progress, GPU-seconds and busy GPU-seconds are integrated
exactly when something changes (``advance``). The random parts (background
noise, spot reclaims) are drawn once from the scenario's seed before the run, so
every policy meets the same cluster.

A policy is a :class:`Controller`: the engine tells it what happened (a job
arrived, GPUs came free, a node will go) and it acts through the engine's
verbs: ``launch``, ``grow``/``shrink`` (Tide's coordinated resize: newcomers
warm up while training goes on, then one pause, no lost step) and ``restart``
(the kill-and-relaunch of the HPA path: lose what was done since the last
periodic checkpoint, pay a relaunch).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tide.services.sim.cluster import BACKGROUND, Cluster
from tide.services.sim.scenario import JobSpec, Scenario

#: Two resizes of one job in opposite directions within this long are a flap.
FLAP_WINDOW_S = 900.0


@dataclass
class Resize:
    at_s: float
    from_replicas: int
    to_replicas: int
    why: str
    # Seconds from what prompted it (a load change, GPUs coming free) to the decision.
    reaction_s: float | None = None


@dataclass
class Run:
    """One job in one simulation."""

    spec: JobSpec
    state: str = "waiting"  # waiting (not arrived), queued, running, done
    world: int = 0  # replicas training in the current generation
    held: int = 0  # replicas holding GPUs (the world and newcomers warming up)
    samples: float = 0.0
    t_acc: float = 0.0
    paused_until: float = 0.0
    ckpt_clock: float = 0.0  # training seconds since the last checkpoint
    util: float = 0.0  # GPU utilization while training, percent
    util_since: float = 0.0
    trigger_at: float = 0.0
    version: int = 0
    resizing: bool = False
    started_at: float | None = None
    done_at: float | None = None
    gpu_s: float = 0.0
    busy_gpu_s: float = 0.0
    lost_samples: float = 0.0
    pause_s: float = 0.0
    resizes: list[Resize] = field(default_factory=list)
    worlds: list[tuple[float, int]] = field(default_factory=list)
    # (start, util) segments of what the GPUs showed, recent ones only (telemetry).
    segments: list[tuple[float, float]] = field(default_factory=list)
    # Policy state (the controller's own).
    ctl: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def gpr(self) -> int:
        return self.spec.gpus_per_replica

    def rate(self, t: float) -> float:
        """Samples/s the job trains at with its world, input pipeline permitting."""
        r = self.spec.curve.at(self.world)
        if self.spec.input_per_s is not None:
            r = min(r, self.spec.input_per_s.at(t))
        return r

    def util_at(self, t: float) -> float:
        """What the job's GPUs showed at ``t`` (0 while paused)."""
        u = 0.0
        for start, v in self.segments:
            if start > t:
                break
            u = v
        return u


class Controller(Protocol):
    name: str

    def attach(self, sim: Simulation) -> None: ...

    def on_arrival(self, run: Run) -> None: ...

    def on_capacity(self) -> None:
        """GPUs came free (a job ended or shrank, the background gave some back)."""
        ...

    def on_changed(self, run: Run) -> None:
        """The job's world or load changed (a resize ended, its input rate moved)."""
        ...

    def on_notice(self, run: Run, replicas: int, deadline_s: float, node: int | None) -> None:
        """``replicas`` of the job must be gone by ``deadline_s`` (preemption, spot)."""
        ...


class Simulation:
    def __init__(self, scenario: Scenario, controller: Controller) -> None:
        self.s = scenario
        self.ctl = controller
        self.now = 0.0
        pool = scenario.pool
        self.cluster = Cluster(pool.nodes, pool.gpus_per_node, pool.spot_nodes)
        dedicated = scenario.static_dedicated_gpus
        self.dedicated = Cluster(1, dedicated, 0) if dedicated else None
        self.runs = [Run(j) for j in scenario.jobs]
        self.by_name = {r.name: r for r in self.runs}
        self.queue: list[Run] = []
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0
        self.bg_pending = 0
        self.bg_unmet_gpu_s = 0.0
        self._bg_t = 0.0
        self.held_gpus = 0
        self._held_t = 0.0
        self.gpu_s_over = 0.0  # held GPU-seconds above elastic_reserved_gpus
        self.timeline: list[tuple[float, int, int]] = []  # (t, job GPUs, background GPUs)

    # -- events -----------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def run(self) -> None:
        rng = random.Random(self.s.seed)
        self._schedule_background(random.Random(rng.random()))
        self._schedule_spot(random.Random(rng.random()))
        for r in self.runs:
            self.at(r.spec.arrive_s, self._arrive, r)
            if r.spec.input_per_s is not None:
                self.at(r.spec.arrive_s + 900.0, self._input_step, r)
        self.ctl.attach(self)
        end = self.s.duration_s
        heap = self._heap
        while heap and heap[0][0] <= end:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        self.now = end
        for r in self.runs:
            if r.state == "running":
                self.advance(r, end)
        self._tally(end)
        self._bg_tally(end)

    # -- accounting ---------------------------------------------------------------------------

    def advance(self, r: Run, t: float) -> None:
        dt = t - r.t_acc
        if dt <= 0:
            return
        r.gpu_s += r.held * r.gpr * dt
        start = max(r.t_acc, r.paused_until)
        running = t - start
        if running > 0 and r.world > 0:
            r.samples += r.rate(start) * running
            r.busy_gpu_s += r.util / 100.0 * r.world * r.gpr * running
            interval = r.spec.checkpoint_interval_s
            r.ckpt_clock = (r.ckpt_clock + running) % interval if interval > 0 else 0.0
        r.t_acc = t

    def _tally(self, t: float) -> None:
        dt = t - self._held_t
        if dt > 0:
            self.gpu_s_over += max(0, self.held_gpus - self.s.pricing.elastic_reserved_gpus) * dt
        self._held_t = t

    def _held(self, r: Run, replicas: int) -> None:
        """The job now holds ``replicas`` replicas' GPUs."""
        self._tally(self.now)
        self.advance(r, self.now)
        self.held_gpus += (replicas - r.held) * r.gpr
        r.held = replicas
        self.timeline.append((self.now, self.held_gpus, self.cluster.replicas_of(BACKGROUND)))

    def _set_world(self, r: Run, world: int) -> None:
        self.advance(r, self.now)
        r.world = world
        r.worlds.append((self.now, world))
        self._set_util(r)

    def _set_util(self, r: Run) -> None:
        t = self.now
        if r.world > 0:
            rate = r.rate(t)
            full = r.spec.curve.at(r.world)
            u = r.spec.busy_util_pct * (rate / full if full > 0 else 0.0)
        else:
            u = 0.0
        if u != r.util:
            r.util, r.util_since, r.trigger_at = u, t, t
        shown = 0.0 if t < r.paused_until else u
        self._segment(r, t, shown)
        if r.paused_until > t:
            self._segment(r, r.paused_until, u)

    def _segment(self, r: Run, t: float, v: float) -> None:
        segs = r.segments
        while segs and segs[-1][0] >= t:
            segs.pop()
        segs.append((t, v))
        if len(segs) > 64:
            del segs[:32]

    def _pause(self, r: Run, seconds: float, *, lose: bool) -> None:
        """Training stops for ``seconds`` from now; with ``lose`` the work since the last
        periodic checkpoint is lost (a kill), else a checkpoint is taken (coordinated)."""
        self.advance(r, self.now)
        if lose and r.world > 0:
            lost = min(r.samples, r.ckpt_clock * r.rate(self.now))
            r.samples -= lost
            r.lost_samples += lost
        r.ckpt_clock = 0.0
        r.paused_until = max(r.paused_until, self.now) + seconds
        r.pause_s += seconds
        self._segment(r, self.now, 0.0)
        self._segment(r, r.paused_until, r.util)

    def _reschedule(self, r: Run) -> None:
        """(Re)plan the job's completion after a change."""
        r.version += 1
        if r.state != "running" or r.world <= 0:
            return
        t = max(self.now, r.paused_until)
        rate = r.rate(t)
        if rate <= 0:
            return
        left = max(0.0, r.spec.work_samples - r.samples)
        self.at(t + left / rate, self._done, r, r.version)

    # -- verbs for controllers ------------------------------------------------------------------

    def free_gpus(self, r: Run | None = None) -> int:
        """Free GPUs for the job (the dedicated reservation for a static job, if any)."""
        return self._pool_of(r).free_gpus()

    def _pool_of(self, r: Run | None) -> Cluster:
        if self.dedicated is not None and r is not None and self.ctl.name == "static":
            return self.dedicated
        return self.cluster

    def launch(self, r: Run, replicas: int) -> bool:
        """Start a queued job with ``replicas`` (new pods start, then the processes launch)."""
        pool = self._pool_of(r)
        if pool.fits(replicas, r.gpr) < replicas:
            return False
        pool.take(r.name, replicas, r.gpr)
        if r in self.queue:
            self.queue.remove(r)
        r.state = "running"
        if r.started_at is None:
            r.started_at = self.now
        r.t_acc = self.now
        self._held(r, replicas)
        r.paused_until = self.now + self.s.pauses.pod_start_s + self.s.pauses.relaunch_s
        self._set_world(r, replicas)
        r.trigger_at = r.paused_until
        self._reschedule(r)
        return True

    def grow(self, r: Run, to: int, why: str, reaction_s: float | None) -> int:
        """Tide's grow: newcomers start and warm up while training goes on, then the job
        checkpoints, pauses once and goes on at ``to``. Returns the target placed."""
        pool = self._pool_of(r)
        placed = pool.take(r.name, to - r.held, r.gpr)
        if placed <= 0:
            return r.held
        to = r.held + placed
        frm = r.world
        self._held(r, to)
        r.resizing = True
        r.resizes.append(Resize(self.now, frm, to, why, reaction_s))
        self.at(
            self.now + self.s.pauses.pod_start_s, self._switch, r, to, self.s.pauses.tide_grow_s
        )
        return to

    def shrink(self, r: Run, to: int, why: str, prefer_nodes: set[int] | None = None) -> None:
        """Tide's shrink: checkpoint at one step, the leavers drain, the rest re-form."""
        r.resizes.append(Resize(self.now, r.world, to, why))
        r.resizing = True
        self._switch(r, to, self.s.pauses.tide_shrink_s, prefer_nodes)

    def _switch(self, r: Run, to: int, pause_s: float, prefer: set[int] | None = None) -> None:
        if r.state != "running":
            return
        to = min(to, r.held)  # replicas lost meanwhile (a node went) are not there to join
        self._pause(r, pause_s, lose=False)
        self._set_world(r, to)
        self._reschedule(r)
        self.at(r.paused_until, self._switched, r, to, prefer)

    def _switched(self, r: Run, to: int, prefer: set[int] | None) -> None:
        if r.held > to:
            self._pool_of(r).give(r.name, r.held - to, prefer)
            self._held(r, to)
            self.capacity_changed()
        r.resizing = False
        r.trigger_at = self.now
        self.ctl.on_changed(r)

    def restart(self, r: Run, world: int, why: str, reaction_s: float | None = None) -> None:
        """Paddle's way (the HPA path): every worker is killed and relaunched at ``world``,
        from the last periodic checkpoint."""
        if world != r.world:
            r.resizes.append(Resize(self.now, r.world, world, why, reaction_s))
        self._pause(r, self.s.pauses.relaunch_s, lose=True)
        self._set_world(r, world)
        r.trigger_at = r.paused_until
        self._reschedule(r)

    def place(self, r: Run, replicas: int) -> int:
        """Add pods (the HPA path); returns how many were placed. They start training only
        when the controller restarts the job with them."""
        placed = self._pool_of(r).take(r.name, replicas, r.gpr)
        if placed:
            self._held(r, r.held + placed)
        return placed

    def release(self, r: Run, replicas: int, prefer: set[int] | None = None) -> None:
        if replicas <= 0:
            return
        self._pool_of(r).give(r.name, replicas, prefer)
        self._held(r, r.held - replicas)
        self.capacity_changed()

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    # -- lifecycle ----------------------------------------------------------------------------------

    def _arrive(self, r: Run) -> None:
        r.state = "queued"
        r.t_acc = self.now
        self.queue.append(r)
        self.ctl.on_arrival(r)

    def _done(self, r: Run, version: int) -> None:
        if version != r.version or r.state != "running":
            return
        self.advance(r, self.now)
        r.samples = r.spec.work_samples
        r.state = "done"
        r.done_at = self.now
        self._pool_of(r).give(r.name, r.held)
        self._held(r, 0)
        r.world = 0
        r.worlds.append((self.now, 0))
        self.capacity_changed()

    def _input_step(self, r: Run) -> None:
        if r.state == "done":
            return
        if r.state == "running":
            self.advance(r, self.now)
            before = r.util
            self._set_util(r)
            self._reschedule(r)
            if r.util != before:
                self.ctl.on_changed(r)
        self.after(900.0, self._input_step, r)

    def capacity_changed(self) -> None:
        self._feed_background()
        self.ctl.on_capacity()

    # -- background and spot ------------------------------------------------------------------------

    def _schedule_background(self, rng: random.Random) -> None:
        bg = self.s.background
        t = 0.0
        while t < self.s.duration_s:
            noise = rng.gauss(0.0, bg.noise_gpus) if bg.noise_gpus else 0.0
            want = max(0, min(self.cluster.capacity, round(bg.gpus.at(t) + noise)))
            self.at(t, self._background, want)
            t += bg.step_s

    def _bg_tally(self, t: float) -> None:
        self.bg_unmet_gpu_s += self.bg_pending * max(0.0, t - self._bg_t)
        self._bg_t = t

    def _background(self, want: int) -> None:
        self._bg_tally(self.now)
        have = self.cluster.replicas_of(BACKGROUND)
        if want < have:
            self.bg_pending = 0
            self.cluster.give(BACKGROUND, have - want)
            self.capacity_changed()
            return
        self.bg_pending = want - have
        self._feed_background()
        if self.bg_pending > 0 and self.ctl.name != "static":
            self._preempt(self.bg_pending)

    def _feed_background(self) -> None:
        if self.bg_pending > 0:
            self._bg_tally(self.now)
            got = self.cluster.take(BACKGROUND, self.bg_pending, 1)
            self.bg_pending -= got

    def _preempt(self, gpus: int) -> None:
        """Other tenants come first: elastic jobs give up replicas (largest jobs first,
        none below one replica) within the pods' termination grace period."""
        deadline = self.now + self.s.pool.preempt_grace_s
        victims = sorted(
            (r for r in self.runs if r.state == "running" and r.held > 1),
            key=lambda r: (-r.held, r.name),
        )
        asked: dict[str, int] = {}
        while gpus > 0 and victims:
            progressed = False
            for r in victims:
                if gpus <= 0:
                    break
                if r.held - asked.get(r.name, 0) > 1:
                    asked[r.name] = asked.get(r.name, 0) + 1
                    gpus -= r.gpr
                    progressed = True
            if not progressed:
                break
        for name, n in asked.items():
            r = self.by_name[name]
            self.ctl.on_notice(r, n, deadline, None)
            self.at(deadline, self._enforce, r, r.held - n, None)

    def _enforce(self, r: Run, keep: int, node: int | None) -> None:
        """The deadline of a notice: what the job still holds beyond ``keep`` is killed."""
        if r.state != "running" or r.held <= keep:
            return
        self.kill(r, r.held - keep, {node} if node is not None else None)

    def kill(self, r: Run, replicas: int, nodes: set[int] | None = None) -> None:
        """Replicas lost without a coordinated checkpoint: the job restarts without them."""
        self._pool_of(r).give(r.name, replicas, nodes)
        self._held(r, r.held - replicas)
        self._lost(r)
        self.capacity_changed()

    def _lost(self, r: Run) -> None:
        """After replicas went without a checkpoint: restart with the rest, or, with none
        left, back to the queue to be started again from its last checkpoint."""
        self.restart(r, min(r.world, r.held), "lost")
        if r.held == 0:
            r.state = "queued"
            r.resizing = False
            r.version += 1
            self.queue.append(r)
            self.queue.sort(key=lambda q: (q.spec.arrive_s, q.name))
        self.ctl.on_changed(r)

    def _schedule_spot(self, rng: random.Random) -> None:
        pool = self.s.pool
        if not pool.spot_nodes or pool.spot_reclaims_per_node_day <= 0:
            return
        rate = pool.spot_reclaims_per_node_day / 86400.0
        for node in range(pool.nodes, pool.nodes + pool.spot_nodes):
            t = rng.expovariate(rate)
            while t < self.s.duration_s:
                self.at(t, self._spot_notice, node)
                t += pool.spot_notice_s + pool.spot_replace_s + rng.expovariate(rate)

    def _spot_notice(self, node: int) -> None:
        n = self.cluster.nodes[node]
        if not n.up:
            return
        n.doomed = True
        deadline = self.now + self.s.pool.spot_notice_s
        for owner, replicas in self.cluster.holders_on(node).items():
            r = self.by_name.get(owner)
            if r is not None and r.state == "running":
                self.ctl.on_notice(r, replicas, deadline, node)
        self.at(deadline, self._spot_down, node)

    def _spot_down(self, node: int) -> None:
        self._bg_tally(self.now)
        lost = self.cluster.go_down(node)
        for owner, replicas in lost.items():
            r = self.by_name.get(owner)
            if r is None:
                self.bg_pending += replicas
                continue
            # The pods went with the node without a coordinated checkpoint.
            self._held(r, r.held - replicas)
            self._lost(r)
        self.capacity_changed()
        self.after(self.s.pool.spot_replace_s, self._spot_up, node)

    def _spot_up(self, node: int) -> None:
        self.cluster.come_up(node)
        self.capacity_changed()

    # -- results --------------------------------------------------------------------------------

    def flaps(self, r: Run) -> int:
        n = 0
        for a, b in zip(r.resizes, r.resizes[1:], strict=False):
            da = (a.to_replicas > a.from_replicas) - (a.to_replicas < a.from_replicas)
            db = (b.to_replicas > b.from_replicas) - (b.to_replicas < b.from_replicas)
            if da and db and da != db and b.at_s - a.at_s <= FLAP_WINDOW_S:
                n += 1
        return n


def hours(seconds: float) -> float:
    return seconds / 3600.0


def nan_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
