"""A job's shard moves mid-window (tide/services/scaler/partials.py ``Shipped``): every replica
replays the window slots it shipped to the old owner to the new one, and the new owner
adds the slots it shipped itself, so its window is the one a single replica given every
report holds, less only the samples the killed old owner's own agents had sent it. An
old owner that gives the shard up hands its own agents' samples over too.

The replicas here are ingest engines shipping as Sharding.ship does (the same
``Shipped`` calls, in the same order), without processes or a store."""

from __future__ import annotations

import math
import random

import pytest

from tide.services.scaler.ingest import Ingest, IngestSettings
from tide.services.scaler.members import Member
from tide.services.scaler.partials import JobPartial, Shipped
from tide.services.scaler.windows import slots_per_bucket
from tide.services.testing.clock import FakeClock
from tide.services.testing.members import InMemoryMemberRegistry
from tide.services.testing.shards import T0, _report

pytestmark = pytest.mark.component

JOB = "ns/j0"
SHAPE = (10.0, 3)  # 3 buckets of 10 s: a 40 s ring, so a move at 25 s is mid-window


def two(slots: dict[int, list[float]]) -> dict[int, list[float]]:
    """Slots as [sum, samples]: these tests carry no GPM (its three numbers stay 0)."""
    assert all(not any(v[2:]) for v in slots.values()), slots
    return {k: v[:2] for k, v in slots.items()}


def _engine(clock: FakeClock) -> Ingest:
    reg = InMemoryMemberRegistry()
    reg.set_members(JOB, [Member(f"j0-p{i}", f"j0-p{i}") for i in range(4)])
    return Ingest(IngestSettings(stale_after_s=5.0), reg, clock, window_shape=lambda _j: SHAPE)


class World:
    """Replicas forwarding one job to ``owner``, shipping every ``ship_every_s``."""

    def __init__(self, names: list[str], owner: str) -> None:
        self.clock = FakeClock(T0)
        self.engines = {n: _engine(self.clock) for n in names}
        self.shipped = {n: Shipped() for n in names}
        self.owner = owner
        for name, e in self.engines.items():
            e.forward = lambda _job, me=name: self.owner != me
        self.streams: dict[tuple[str, int], object] = {}
        self.handover = True

    def process(self, at: str, node: int, seq: int, t: float, utils: list[float]) -> None:
        e = self.engines[at]
        st = self.streams.get((at, node))
        if st is None:
            st = self.streams[(at, node)] = e.open_stream()
        e.process(st, _report(node, seq, t, utils))  # type: ignore[arg-type]

    def ship(self) -> None:
        for name, e in self.engines.items():
            if name == self.owner:
                continue
            s = self.shipped[name]
            parts = e.take_partials()
            out = [s.outgoing(p, self.owner) for p in parts]
            out += s.moved(lambda _j: self.owner, {p.job_id for p in parts})
            self.engines[self.owner].merge_partials(name, out)

    def move(self, to: str, *, kill: bool) -> None:
        """The shard moves to ``to``: the old owner is killed (its window dies with it)
        or gives the shard up (drops the window); ``to`` takes the job."""
        old = self.owner
        if kill:
            del self.engines[old]
            del self.shipped[old]
        else:
            # As Sharding._stop: the old owner's own agents' samples are retained for the
            # next owner, then its window is dropped.
            own = self.engines[old].own_partial(JOB) if self.handover else None
            if own is not None:
                self.shipped[old].retain(own)
            self.engines[old].reshape(JOB)
        self.owner = to
        new = self.engines[to]
        # As Sharding.ship then _absorb: what it gathered and never shipped, then all of
        # its retained slots, into its own window.
        s = self.shipped[to]
        for p in new.take_partials():
            s.outgoing(p, to)
        taken = s.take(JOB)
        if taken is not None:
            new.merge_partials(to, [taken], own=True)


def _means(e: Ingest, now: float) -> tuple[float, ...]:
    w = e.windows[JOB]
    return w.means(w.slot_of(now) + 1, SHAPE[1] + 1)


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(
        (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-9 for x, y in zip(a, b, strict=True)
    )


def _run(
    world: World, at: dict[int, str], moves: dict[int, tuple[str, bool]]
) -> tuple[Ingest, Ingest, Ingest]:
    """40 s of reports of nodes 0 and 1 (the job's), node ``n`` streaming to ``at[n]``;
    at second ``s`` in ``moves`` the shard moves. Returns the last owner's engine, a
    single replica given every report, and one given every report not sent to a killed
    owner."""
    rng = random.Random(11)
    single, survived = _engine(world.clock), _engine(world.clock)
    s_streams = [single.open_stream() for _ in range(2)]
    v_streams = [survived.open_stream() for _ in range(2)]
    killed: set[str] = set()
    for sec in range(40):
        if sec in moves:
            to, kill = moves[sec]
            if kill:
                killed.add(world.owner)
            world.move(to, kill=kill)
            for n, r in at.items():
                if r in killed:
                    at[n] = to  # a reconnect behind the Service
        for n in (0, 1):
            t = T0 + sec + rng.uniform(0.0, 0.99)
            utils = [rng.uniform(0.0, 100.0) for _ in range(8)]
            single.process(s_streams[n], _report(n, sec + 1, t, utils))
            world.process(at[n], n, sec + 1, t, utils)
            if not _will_die(at[n], sec, moves, world.owner):
                survived.process(v_streams[n], _report(n, sec + 1, t, utils))
        world.clock.advance(1.0)
        if sec % 3 == 2:
            world.ship()
    world.ship()
    return world.engines[world.owner], single, survived


def _will_die(replica: str, sec: int, moves: dict[int, tuple[str, bool]], owner: str) -> bool:
    """Whether a sample processed at ``replica`` at second ``sec`` lands in a window that
    a later kill destroys: the replica owns the job then and is killed later on."""
    if replica != owner:
        return False
    later = sorted(s for s in moves if s > sec)
    return bool(later) and moves[later[0]][1]


def test_a_new_owner_after_a_kill_has_the_single_window_less_the_dead_owners_own() -> None:
    world = World(["a", "b", "c"], owner="a")
    got, single, survived = _run(world, {0: "b", 1: "a"}, {25: ("b", True)})
    now = world.clock.now()
    want = _means(survived, now)
    assert not any(math.isnan(m) for m in want)
    assert _same(_means(got, now), want), (_means(got, now), want)
    # Node 1's samples went to the killed owner's window: those alone are missing.
    assert not _same(_means(got, now), _means(single, now))


def test_a_new_owner_has_the_whole_window_when_the_dead_owner_held_no_nodes() -> None:
    world = World(["a", "b", "c"], owner="a")
    got, single, _ = _run(world, {0: "b", 1: "c"}, {25: ("b", True)})
    now = world.clock.now()
    assert _same(_means(got, now), _means(single, now)), (_means(got, now), _means(single, now))


def test_without_the_replay_a_new_owner_misses_the_window() -> None:
    """The check above can fail: a new owner that only gets increments lacks the past."""
    world = World(["a", "b", "c"], owner="a")
    for s in world.shipped.values():
        s.moved = lambda _owner_of, _skip: []  # type: ignore[method-assign]
        s.outgoing = lambda p, _owner: p  # type: ignore[method-assign]
    got, single, _ = _run(world, {0: "b", 1: "c"}, {25: ("b", True)})
    now = world.clock.now()
    assert not _same(_means(got, now), _means(single, now))


def test_two_moves_count_each_sample_once() -> None:
    """a → b (given up) → c: c adds what it shipped to a and to b, d replays the same to c."""
    world = World(["a", "b", "c", "d"], owner="a")
    got, single, _ = _run(world, {0: "c", 1: "d"}, {14: ("b", False), 27: ("c", False)})
    now = world.clock.now()
    assert _same(_means(got, now), _means(single, now)), (_means(got, now), _means(single, now))


def test_the_retained_slots_are_pruned_to_the_window_span() -> None:
    s = Shipped()
    bucket_s, buckets = SHAPE
    n = (buckets + 1) * slots_per_bucket(bucket_s, buckets) + 1
    for slot in range(10 * n):
        s.outgoing(JobPartial(JOB, bucket_s, buckets, slots={slot: [50.0, 1.0]}), "a:1")
        assert len(s.slots_of(JOB)) <= n
    assert sorted(s.slots_of(JOB)) == list(range(9 * n, 10 * n))
    # A reshaped window starts over: slots of the old shape mean nothing to the owner.
    s.outgoing(JobPartial(JOB, 2.0, 3, slots={5: [1.0, 1.0]}), "a:1")
    assert two(s.slots_of(JOB)) == {5: [1.0, 1.0]}
    s.keep(set())
    assert two(s.slots_of(JOB)) == {}


def test_a_replay_goes_once_per_owner_change() -> None:
    s = Shipped()
    p = JobPartial(JOB, 10.0, 3, slots={1: [10.0, 1.0]})
    assert two(s.outgoing(p, "a:1").slots) == {1: [10.0, 1.0]}
    # Moved: the new increment rides with everything shipped before.
    q = s.outgoing(JobPartial(JOB, 10.0, 3, slots={1: [5.0, 1.0], 2: [7.0, 1.0]}), "b:1")
    assert two(q.slots) == {1: [15.0, 2.0], 2: [7.0, 1.0]}
    assert two(s.outgoing(JobPartial(JOB, 10.0, 3, slots={3: [1.0, 1.0]}), "b:1").slots) == {
        3: [1.0, 1.0]
    }
    # Moved again with nothing new here: the slots alone, once.
    replays = s.moved(lambda _j: "c:1", set())
    assert [two(r.slots) for r in replays] == [{1: [15.0, 2.0], 2: [7.0, 1.0], 3: [1.0, 1.0]}]
    assert replays[0].seconds == {}
    assert s.moved(lambda _j: "c:1", set()) == []


def test_slots_never_sent_go_to_the_next_owner_once() -> None:
    """No live lease (a shard moving) or the owner's last shipment still in flight: the
    increment is not sent, and the next owner gets it in its replay, not the current."""
    s = Shipped()
    s.outgoing(JobPartial(JOB, 10.0, 3, slots={1: [10.0, 1.0]}), "a:1")
    s.retain(JobPartial(JOB, 10.0, 3, slots={2: [20.0, 1.0]}))  # a:1 busy
    assert s.moved(lambda _j: "a:1", set()) == []
    assert two(s.outgoing(JobPartial(JOB, 10.0, 3, slots={3: [1.0, 1.0]}), "a:1").slots) == {
        3: [1.0, 1.0]
    }
    s.retain(JobPartial(JOB, 10.0, 3, slots={4: [4.0, 1.0]}))  # no owner: a:1 died
    [r] = s.moved(lambda _j: "b:1", set())
    assert two(r.slots) == {1: [10.0, 1.0], 2: [20.0, 1.0], 3: [1.0, 1.0], 4: [4.0, 1.0]}
    # A replica that only ever retained (no lease yet): its first owner gets them.
    t = Shipped()
    t.retain(JobPartial(JOB, 10.0, 3, slots={1: [10.0, 1.0]}))
    assert two(t.outgoing(JobPartial(JOB, 10.0, 3, slots={2: [2.0, 1.0]}), "a:1").slots) == {
        1: [10.0, 1.0],
        2: [2.0, 1.0],
    }


def test_a_graceful_move_hands_the_old_owners_own_samples_over() -> None:
    """Node 1 streams to the owner a; a gives the shard up at 25 s: b's window is the
    single replica's, a's own agents' samples before the move included."""
    world = World(["a", "b", "c"], owner="a")
    got, single, _ = _run(world, {0: "c", 1: "a"}, {25: ("b", False)})
    now = world.clock.now()
    assert _same(_means(got, now), _means(single, now)), (_means(got, now), _means(single, now))


def test_without_the_handover_a_graceful_move_loses_the_old_owners_own() -> None:
    """The check above can fail: without the handover, b lacks node 1's samples."""
    world = World(["a", "b", "c"], owner="a")
    world.handover = False
    got, single, _ = _run(world, {0: "c", 1: "a"}, {25: ("b", False)})
    now = world.clock.now()
    assert not _same(_means(got, now), _means(single, now))


def test_graceful_moves_and_a_return_count_each_sample_once() -> None:
    """a → b → a → c, every owner with a node of its own: each sample once at the end."""
    world = World(["a", "b", "c"], owner="a")
    got, single, _ = _run(
        world, {0: "a", 1: "b"}, {10: ("b", False), 18: ("a", False), 30: ("c", False)}
    )
    now = world.clock.now()
    assert _same(_means(got, now), _means(single, now)), (_means(got, now), _means(single, now))


def test_own_partial_is_the_window_less_what_others_shipped() -> None:
    clock = FakeClock(T0)
    e = _engine(clock)
    e.forward = lambda _job: False
    st = e.open_stream()
    e.process(st, _report(0, 1, T0 + 0.5, [50.0] * 8))  # type: ignore[arg-type]
    w = e.windows[JOB]
    slot = w.slot_of(T0 + 0.5)
    e.merge_partials("b", [JobPartial(JOB, *SHAPE, {slot: [80.0, 2.0], slot - 1: [10.0, 1.0]})])
    own = e.own_partial(JOB)
    assert own is not None
    assert (own.bucket_s, own.buckets) == SHAPE
    # The slot's samples less the 2 shipped in; the slot before held only shipped ones.
    assert set(own.slots) == {slot}
    total, count = own.slots[slot][:2]
    assert count == w.slots()[slot][1] - 2.0
    assert total == pytest.approx(w.slots()[slot][0] - 80.0)
    e.reshape(JOB)
    assert e.own_partial(JOB) is None
    assert JOB not in e.merged


@pytest.mark.parametrize("own", [False, True])
def test_every_slot_a_merged_partial_opens_wakes_the_policy(own: bool) -> None:
    """A shipment opens slots of the owner's window as its own reports do: each new slot
    is one ``on_slot`` call, whether others shipped it or it is this replica's own."""
    clock = FakeClock(T0)
    e = _engine(clock)
    opened: list[tuple[str, float]] = []
    e.on_slot = lambda job, t: opened.append((job, t))
    e.merge_partials("b", [JobPartial(JOB, *SHAPE, {100: [50.0, 1.0]})], own=own)
    assert opened == []  # the window's first slot: nothing slid
    e.merge_partials("b", [JobPartial(JOB, *SHAPE, {101: [50.0, 1.0], 102: [50.0, 1.0]})], own=own)
    w = e.windows[JOB]
    assert opened == [(JOB, w.offset_s + 101 * w.slot_s), (JOB, w.offset_s + 102 * w.slot_s)]
    assert (JOB in e.merged and set(e.merged[JOB].slots()) == {100, 101, 102}) is not own
