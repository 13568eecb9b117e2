"""The ingestion engine without sockets: sequence numbers, validation, attribution, windows."""

from __future__ import annotations

import math

import pytest

from tests.scaler.support import report
from tide.base.timeconv import ts_from_seconds
from tide.services.scaler.ingest import Ingest, IngestSettings, InvalidStream, Rejection
from tide.services.scaler.members import Member
from tide.services.scaler.partials import NodeNotice
from tide.services.testing.clock import FakeClock
from tide.services.testing.members import InMemoryMemberRegistry
from tide.v1 import telemetry_pb2

pytestmark = pytest.mark.component

T0 = 1_800_000_000.0  # FakeClock's start, a multiple of 30 s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def engine(clock: FakeClock) -> Ingest:
    reg = InMemoryMemberRegistry()
    reg.set_members("ns/a", [Member("a-0", "a-0"), Member("a-1", "a-1")])
    return Ingest(IngestSettings(stale_after_s=10.0, stagger_slots=False), reg, clock)


PODS = ["a-0", "a-0", "a-0", "a-0", "a-1", "a-1", "a-1", "a-1"]


def test_duplicates_and_replays_are_acked_and_ignored(engine: Ingest) -> None:
    st = engine.open_stream()
    for seq in (1, 2, 3):
        assert engine.process(st, report(seq=seq, t=T0, pods=PODS)) == ("b1", seq)
    assert engine.process(st, report(seq=2, t=T0, pods=PODS)) == ("b1", 3)
    assert engine.reports_accepted == 3
    assert engine.reports_duplicate == 1
    assert engine.samples_accepted == 24


def test_gap_is_counted_and_filled_late(engine: Ingest) -> None:
    st = engine.open_stream()
    engine.process(st, report(seq=1, t=T0))
    assert engine.process(st, report(seq=4, t=T0)) == ("b1", 1)
    assert engine.seq_gaps == 2
    assert engine.process(st, report(seq=2, t=T0)) == ("b1", 2)
    assert engine.process(st, report(seq=3, t=T0)) == ("b1", 4)
    assert engine.process(st, report(seq=3, t=T0)) == ("b1", 4)
    assert engine.reports_duplicate == 1


def test_gap_given_up_past_the_reorder_limit(clock: FakeClock) -> None:
    e = Ingest(IngestSettings(reorder_limit=3), InMemoryMemberRegistry(), clock)
    st = e.open_stream()
    e.process(st, report(seq=1, t=T0))
    for seq in (3, 4, 5):
        assert e.process(st, report(seq=seq, t=T0))[1] == 1
    assert e.process(st, report(seq=6, t=T0))[1] == 6


def test_new_boot_id_restarts_the_sequence(engine: Ingest) -> None:
    st = engine.open_stream()
    engine.process(st, report(seq=5, t=T0))
    assert engine.process(st, report(seq=1, boot="b2", t=T0)) == ("b2", 1)
    assert engine.reports_accepted == 2


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("utilization_pct", math.nan, Rejection.NON_FINITE),
        ("utilization_pct", math.inf, Rejection.NON_FINITE),
        ("utilization_pct", -1.0, Rejection.UTILIZATION_OUT_OF_RANGE),
        ("utilization_pct", 100.5, Rejection.UTILIZATION_OUT_OF_RANGE),
        ("power_w", math.nan, Rejection.NON_FINITE),
        ("temperature_c", -math.inf, Rejection.NON_FINITE),
        ("memory_used_bytes", 17 << 30, Rejection.MEMORY_USED_EXCEEDS_TOTAL),
        ("index", 9, Rejection.GPU_INDEX_OUT_OF_RANGE),
        ("index", 1, Rejection.DUPLICATE_GPU_INDEX),
    ],
)
def test_bad_sample_is_dropped_under_its_reason(
    engine: Ingest, field: str, value: float, reason: Rejection
) -> None:
    st = engine.open_stream()
    r = report(seq=1, t=T0, utils=[90.0] * 8, pods=PODS)
    setattr(r.gpus[0], field, value)
    engine.process(st, r)
    assert engine.rejected[reason] == 1
    assert sum(engine.rejected.values()) == 1
    assert engine.samples_accepted == 7
    # Nothing invalid reaches the window: the mean is still exactly 90.
    view = engine.window_view("ns/a", T0, 8, 8)
    assert view.bucket_means[-1] == 90.0


@pytest.mark.parametrize(
    ("t", "reason"),
    [
        (T0 + 60, Rejection.TIMESTAMP_IN_FUTURE),
        (0.0, Rejection.TIMESTAMP_MISSING),
        (T0 - 5, Rejection.TIMESTAMP_OUT_OF_ORDER),
    ],
)
def test_bad_timestamp_drops_the_report(engine: Ingest, t: float, reason: Rejection) -> None:
    st = engine.open_stream()
    engine.process(st, report(seq=1, t=T0, pods=PODS))
    assert engine.process(st, report(seq=2, t=t, utils=[100.0] * 8, pods=PODS)) == ("b1", 2)
    assert engine.rejected[reason] == 1
    assert engine.reports_dropped == 1
    assert engine.window_view("ns/a", T0, 8, 8).bucket_means[-1] == 50.0


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"utils": [1.0] * 9, "capacity": 8}, Rejection.TOO_MANY_GPUS),
        ({"utils": [1.0] * 2, "capacity": 65}, Rejection.TOO_MANY_GPUS),
        ({"node": ""}, Rejection.MISSING_IDENTITY),
        ({"boot": ""}, Rejection.MISSING_IDENTITY),
        ({"seq": 0}, Rejection.BAD_SEQUENCE),
    ],
)
def test_broken_stream_is_refused(
    engine: Ingest, kwargs: dict[str, object], reason: Rejection
) -> None:
    st = engine.open_stream()
    args: dict[str, object] = {"seq": 1, "t": T0, **kwargs}
    with pytest.raises(InvalidStream) as err:
        engine.process(st, report(**args))  # type: ignore[arg-type]
    assert err.value.reason is reason
    assert engine.rejected[reason] == 1
    assert engine.samples_accepted == 0


def test_stream_cannot_change_node(engine: Ingest) -> None:
    st = engine.open_stream()
    engine.process(st, report("n1", 1, t=T0))
    with pytest.raises(InvalidStream, match="node_changed"):
        engine.process(st, report("n2", 1, t=T0))


def test_attribution_and_unattributed_gpus(engine: Ingest, clock: FakeClock) -> None:
    st = engine.open_stream()
    pods = ["a-0", "a-0", "other", "", "a-1", "a-1", "", ""]
    engine.process(st, report(seq=1, t=T0, utils=[80, 80, 10, 10, 60, 60, 0, 0], pods=pods))
    assert engine.samples_unattributed == 4
    assert engine.fresh_gpus(T0) == {"ns/a": 4}
    view = engine.window_view("ns/a", T0, 4, 4)
    assert view.bucket_means[-1] == 70.0
    assert len(engine.node_view()) == 8
    clock.advance(11)
    assert engine.fresh_gpus(clock.now()) == {}


def test_window_memory_does_not_grow_with_the_report_rate(engine: Ingest) -> None:
    st = engine.open_stream()
    for seq in range(1, 2001):
        engine.process(st, report(seq=seq, t=T0 - 25 + seq * 0.01, pods=PODS))
    assert engine.reports_accepted == 2000
    w = engine.windows["ns/a"]
    # 10 buckets of 30 s, 60 slots of 0.5 s each, one bucket more and the slot being filled.
    assert (w.k, w.slot_s, w.n) == (60, 0.5, 661)
    assert engine.rollups.pending_minutes() == 1


def test_a_new_slot_notifies_once_per_slot(clock: FakeClock) -> None:
    reg = InMemoryMemberRegistry()
    reg.set_members("ns/a", [Member("a-0", "a-0")])
    opened: list[float] = []
    e = Ingest(
        IngestSettings(stagger_slots=False),
        reg,
        clock,
        on_slot=lambda _j, t: opened.append(t - T0),
    )
    st = e.open_stream()
    for seq, dt in enumerate([0, 0.1, 0.4, 0.5, 0.9, 3.0, 3.2], start=1):
        clock.advance(dt - (clock.now() - T0))
        e.process(st, report(seq=seq, t=T0 + dt, utils=[50.0], pods=["a-0"]))
    assert opened == [0.5, 3.0]


def test_buckets_slide_with_the_slots(clock: FakeClock) -> None:
    from tide.services.scaler.windows import JobWindow

    w = JobWindow(bucket_s=2.0, buckets=3)  # slots of 0.5 s, 4 per bucket
    means = {}
    for i in range(24):  # 12 s of one sample per slot: 10 % for 6 s, then 90 %
        w.add(i, 10.0 if i < 12 else 90.0, 1)
        means[i] = w.view(i * 0.5 + 0.1, 3, 1, 1).bucket_means
    # At 5.6 s: [0, 2) [2, 4) [4, 6): all 10 %, the newest bucket still being filled.
    assert means[11] == (10.0, 10.0, 10.0)
    # At 6.6 s the buckets slid by two slots: [0.5, 2.5) ... [4.5, 6.5) holds 90 % twice.
    assert means[13] == (10.0, 10.0, 50.0)
    # At 11.6 s the window starts at 6 s: every bucket is 90 %, not a bucket later.
    assert means[23] == (90.0, 90.0, 90.0)
    assert means[22][0] < 90.0
    assert w.view(6.6, 3, 1, 1).end_s == 7.0


def test_late_samples_land_and_too_late_ones_are_refused() -> None:
    from tide.services.scaler.windows import JobWindow

    w = JobWindow(bucket_s=1.0, buckets=2)  # slots of 0.5 s; the ring holds 7
    assert w.add(10, 50.0, 1)
    assert w.add(8, 30.0, 1)  # late, still held
    assert not w.add(3, 30.0, 1)  # left the ring
    older, late, newest = w.means(11, 3)
    assert (late, newest) == (30.0, 50.0) and math.isnan(older)
    assert w.add(30, 70.0, 1)  # a jump clears what the ring held a lap ago
    a, b, c = w.means(31, 3)
    assert math.isnan(a) and math.isnan(b) and c == 70.0


def test_termination_notice_marks_the_jobs_replicas(engine: Ingest) -> None:
    from tide.v1 import telemetry_pb2

    st = engine.open_stream()
    r = report(seq=1, t=T0, pods=PODS)
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    ev.deadline.CopyFrom(ts_from_seconds(T0 + 120))
    engine.process(st, r)
    assert engine.terminating("ns/a") == (2, "n1", T0 + 120)
    r2 = report(seq=2, t=T0)
    r2.events.add(kind=telemetry_pb2.NodeEvent.KIND_UNCORDONED)
    engine.process(st, r2)
    assert engine.terminating("ns/a")[0] == 0


def test_rollups_per_minute(engine: Ingest, clock: FakeClock) -> None:
    st = engine.open_stream()
    engine.process(st, report(seq=1, t=T0, utils=[10.0] * 8, pods=PODS))
    clock.advance(30)
    engine.process(st, report(seq=2, t=T0 + 30, utils=[30.0] * 8, pods=PODS))
    clock.advance(31)
    engine.process(st, report(seq=3, t=T0 + 61, utils=[90.0] * 8, pods=PODS))
    rows = engine.rollups.take_complete(T0 + 70, {"ns/a": 2})
    assert [(r.mean_pct, r.min_pct, r.max_pct, r.samples, r.replicas) for r in rows] == [
        (20.0, 10.0, 30.0, 16, 2)
    ]
    assert engine.rollups.pending_minutes() == 1


def test_staggered_slot_grids_open_at_different_instants(clock: FakeClock) -> None:
    from tide.services.scaler.windows import stagger_offset

    offsets = {stagger_offset(f"ns/j{i}", 0.5) for i in range(20)}
    assert len(offsets) > 15 and all(0 <= o < 0.5 for o in offsets)
    reg = InMemoryMemberRegistry()
    reg.set_members("ns/a", [Member("a-0", "a-0")])
    e = Ingest(IngestSettings(), reg, clock)
    st = e.open_stream()
    e.process(st, report(seq=1, t=T0, utils=[50.0], pods=["a-0"]))
    off = stagger_offset("ns/a", 0.5)
    view = e.window_view("ns/a", T0 + 60, 1, 1)
    assert (view.end_s - off) % 0.5 == pytest.approx(0.0, abs=1e-6)


def test_a_jobs_freshness_reads_its_own_nodes_and_agrees_with_the_fleet_count(
    clock: FakeClock,
) -> None:
    import random

    reg = InMemoryMemberRegistry()
    jobs = {"ns/a": ["a-0", "a-1"], "ns/b": ["b-0"], "ns/c": ["c-0", "c-1"]}
    for job, pods in jobs.items():
        reg.set_members(job, [Member(p, p) for p in pods])
    e = Ingest(IngestSettings(stale_after_s=10.0, stagger_slots=False), reg, clock)
    rng = random.Random(7)
    streams = {f"n{i}": e.open_stream() for i in range(12)}
    every = [p for pods in jobs.values() for p in pods] + ["", "stranger"]
    for step in range(1, 120):
        clock.advance(rng.choice([0.5, 1.0, 3.0]))
        # Some nodes report, with GPUs that move between jobs, go idle or stop.
        for name in rng.sample(sorted(streams), 5):
            n = rng.randint(1, 8)
            pods = [rng.choice(every) for _ in range(n)]
            e.process(streams[name], report(name, step, t=clock.now(), utils=[50.0] * n, pods=pods))
        now = clock.now()
        fleet = e.fresh_gpus(now)
        for job in jobs:
            assert e.fresh_gpus_of(job, now) == fleet.get(job, 0), (step, job)
    # What a job's evaluation reads: only nodes that hold one of its GPUs.
    for job, nodes in e.job_nodes.items():
        e.fresh_gpus_of(job, clock.now())
        for node in nodes.values():
            assert job in node.gpus.job
    assert e.fresh_gpus_of("ns/none", clock.now()) == 0


def test_terminating_pods_are_found_on_the_jobs_nodes_only(engine: Ingest) -> None:
    from tide.v1 import telemetry_pb2

    reg = engine.registry
    assert isinstance(reg, InMemoryMemberRegistry)
    reg.set_members("ns/b", [Member("b-0", "b-0")])
    a, b = engine.open_stream(), engine.open_stream()
    engine.process(a, report("n1", 1, t=T0, pods=PODS))
    r = report("n2", 1, t=T0, pods=["b-0"] * 8)
    r.events.add(kind=telemetry_pb2.NodeEvent.KIND_CORDONED, detail="drain")
    engine.process(b, r)
    assert engine.terminating("ns/a") == (0, "", None)
    assert engine.terminating("ns/b") == (1, "n2", None)
    assert set(engine.job_nodes["ns/a"]) == {"n1"} and set(engine.job_nodes["ns/b"]) == {"n2"}
    # The job's pods move off the cordoned node: it is no longer the job's.
    engine.process(b, report("n2", 2, t=T0 + 1, pods=["a-0"] * 8))
    assert engine.terminating("ns/b") == (0, "", None)
    assert engine.terminating("ns/a") == (1, "n2", None)


def test_a_shipped_notice_counts_once_and_runs_out_unless_resent(
    engine: Ingest, clock: FakeClock
) -> None:
    """Owner side of a sharded notice: its pods count as terminating with its deadline,
    a resend or a node this replica noticed itself is a duplicate, and a notice not
    resent for stale_after_s is over."""
    woken: list[str] = []
    engine.on_notice = woken.append
    kind = telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE
    n = NodeNotice("ns/a", "n9", kind, T0 + 30.0, frozenset({"a-1", "not-a-member"}))
    assert engine.merge_notices([n]) == (1, 0)
    assert engine.merge_notices([n]) == (0, 1)
    assert woken == ["ns/a"]
    assert engine.terminating_pods("ns/a") == ({"a-1"}, "n9", T0 + 30.0)
    # This replica's own stream noticed n1 with the same pod: nothing new to apply.
    st = engine.open_stream()
    r = report("n1", 1, t=T0, pods=PODS)
    r.events.add(kind=kind, detail="spot")
    engine.process(st, r)
    assert engine.merge_notices([NodeNotice("ns/a", "n1", kind, None, frozenset({"a-1"}))]) == (
        0,
        1,
    )
    clock.advance(11.0)
    assert engine.terminating_pods("ns/a")[0] == {"a-0", "a-1"}  # n1's own notice stays
    assert "n9" not in engine.remote_notices["ns/a"]


def test_take_notices_ships_each_active_notice_per_forwarded_job_until_its_deadline(
    engine: Ingest, clock: FakeClock
) -> None:
    engine.forward = lambda job: True
    shipped: list[int] = []
    engine.on_forward_notice = lambda: shipped.append(1)
    st = engine.open_stream()
    r = report("n1", 1, t=T0, pods=PODS)
    ev = r.events.add(kind=telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE, detail="spot")
    ev.deadline.FromNanoseconds(int((T0 + 5.0) * 1e9))
    engine.process(st, r)  # the notice in the node's first report: attributed already
    assert shipped == [1]
    want = [NodeNotice("ns/a", "n1", ev.kind, T0 + 5.0, frozenset({"a-0", "a-1"}))]
    assert engine.take_notices(clock.now()) == want
    assert engine.take_notices(clock.now()) == want  # resent every shipment
    clock.advance(6.0)
    assert engine.take_notices(clock.now()) == []
    assert not engine.noticed


def test_gpm_rides_the_window_and_absent_is_not_zero(engine: Ingest, clock: FakeClock) -> None:
    """SM/tensor activity means are over the samples that carried GPM; a GPU without it
    lowers the bucket's GPM fraction instead of adding a zero."""
    st = engine.open_stream()
    r = report(seq=1, t=T0, utils=[95.0] * 8, pods=PODS)
    for g in r.gpus[:6]:
        g.sm_active_pct = 30.0
        g.tensor_active_pct = 10.0
    r.gpus[6].sm_active_pct = 130.0  # out of range, and no tensor activity: not measured
    engine.process(st, r)
    view = engine.window_view("ns/a", T0, 8, 8)
    assert view.bucket_means[-1] == 95.0
    assert view.sm_active_means[-1] == 30.0 and view.tensor_active_means[-1] == 10.0
    assert view.gpm_fractions[-1] == 6 / 8
    assert math.isnan(view.gpm_fractions[0])  # an empty bucket: no sample at all
    clock.advance(30)
    engine.process(st, report(seq=2, t=T0 + 30, utils=[95.0] * 8, pods=PODS))  # an old agent
    later = engine.window_view("ns/a", T0 + 30, 8, 8)
    assert later.gpm_fractions[-1] == 0.0 and math.isnan(later.sm_active_means[-1])


def test_a_measured_zero_counts_and_half_a_gpm_reading_does_not(
    engine: Ingest, clock: FakeClock
) -> None:
    """GPM read 0.0 (idle SMs) is a measurement and lowers the means; a sample with SM
    activity but no tensor activity (against the all-four rule) is not measured, and
    neither counts nor reads as 0."""
    st = engine.open_stream()
    r = report(seq=1, t=T0, utils=[95.0] * 8, pods=PODS)
    for g in r.gpus[:4]:
        g.sm_active_pct = 40.0
        g.tensor_active_pct = 20.0
    for g in r.gpus[4:6]:
        g.sm_active_pct = 0.0
        g.tensor_active_pct = 0.0
    r.gpus[6].sm_active_pct = 50.0
    r.gpus[7].tensor_active_pct = 50.0
    engine.process(st, r)
    view = engine.window_view("ns/a", T0, 8, 8)
    assert view.gpm_fractions[-1] == 6 / 8
    assert view.sm_active_means[-1] == pytest.approx(160.0 / 6)
    assert view.tensor_active_means[-1] == pytest.approx(80.0 / 6)


def test_a_report_whose_gpus_alternate_between_jobs_sums_each_job_once(
    clock: FakeClock,
) -> None:
    """A report's samples are summed per run of one job and the runs folded together:
    interleaved jobs and unattributed GPUs still give each job its own mean, min, max
    and count."""
    reg = InMemoryMemberRegistry()
    reg.set_members("ns/a", [Member("a-0", "a-0")])
    reg.set_members("ns/b", [Member("b-0", "b-0")])
    engine = Ingest(IngestSettings(stagger_slots=False), reg, clock)
    pods = ["a-0", "b-0", "a-0", "", "b-0", "a-0", "b-0", "x"]
    utils = [40.0, 90.0, 20.0, 5.0, 70.0, 60.0, 80.0, 1.0]
    engine.process(engine.open_stream(), report(seq=1, t=T0, utils=utils, pods=pods))
    rows = engine.rollups.take_complete(T0 + 70, {})
    got = {r.job_id: (r.mean_pct, r.min_pct, r.max_pct, r.samples) for r in rows}
    assert got == {"ns/a": (40.0, 20.0, 60.0, 3), "ns/b": (80.0, 70.0, 90.0, 3)}
    assert engine.samples_unattributed == 2
    assert engine.samples_accepted == 8
