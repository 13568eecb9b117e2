"""The pass over every job (ScalerCore's loop): answers reused while they hold, the
decisions of a pass written together, the pass spread over the interval; and the
scaler's settings as the process reads them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.scaler.service_rig import FAST, PODS, REAL, REAL_ENV, T0, Rig, feed, final
from tests.scaler.support import report
from tests.support.poll import eventually
from tide.services.scaler import policy as pol
from tide.services.scaler.leases import ShardSettings
from tide.services.scaler.policy import PolicySettings, Reason
from tide.services.scaler.store import DecisionState
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.component


def test_scaler_settings_validate_and_feed_the_policy() -> None:
    from tide.base.errors import ConfigError
    from tide.services.common.config import load_settings
    from tide.services.scaler.settings import ScalerSettings

    s = load_settings(
        ScalerSettings, ["--sustain-s=60", "--bucket-s=10", "--max-replicas=16"], env=REAL_ENV
    )
    assert (s.policy.buckets, s.policy.max_replicas) == (6, 16)
    with pytest.raises(ConfigError, match=r"sustain_s=100\.0"):
        load_settings(ScalerSettings, [], env={**REAL_ENV, "TIDE_SUSTAIN_S": "100"})
    with pytest.raises(ConfigError, match=r"utilization_detail_retention_days=40\.0"):
        ScalerSettings(**REAL, utilization_detail_retention_days=40.0)
    with pytest.raises(ConfigError, match=r"min_scale_up_efficiency=2\.0"):
        load_settings(ScalerSettings, ["--min-scale-up-efficiency=2"], env=REAL_ENV)
    off = ScalerSettings(**REAL, policy=PolicySettings(min_scale_up_efficiency=0.0))
    assert off.policy.min_scale_up_efficiency == 0
    # The policy is one grouped setting: its fields are not ScalerSettings' own.
    with pytest.raises(TypeError, match="sustain_s"):
        ScalerSettings(**REAL, sustain_s=60.0)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="actuator"):
        ScalerSettings(coordinator="127.0.0.1:9", actuator="kubernetes")
    with pytest.raises(ConfigError, match="stale_after_s"):
        ScalerSettings(**REAL, stale_after_s=0.0)
    with pytest.raises(ConfigError, match="rollup_retention_days"):
        ScalerSettings(**REAL, rollup_retention_days=0.0)
    with pytest.raises(ConfigError, match=r"decision_retention_days=-1\.0"):
        ScalerSettings(**REAL, decision_retention_days=-1.0)
    with pytest.raises(ConfigError, match="retention_batch_rows=0"):
        ScalerSettings(**REAL, retention_batch_rows=0)
    with pytest.raises(ConfigError, match="leader_election: expected off, sql or kubernetes"):
        ScalerSettings(**REAL, leader_election="etcd")
    # A Lease lives in a namespace: no guess at one that other releases may share.
    with pytest.raises(ConfigError, match="lease_namespace: required"):
        ScalerSettings(**REAL, leader_election="kubernetes")
    lease = ScalerSettings(**REAL, leader_election="kubernetes", lease_namespace="tide")
    assert (lease.lease_name, lease.lease_kubeconfig) == ("tide-scaler", "in-cluster")
    # Sharded replicas each lead their shards: not also an elected leader.
    with pytest.raises(ConfigError, match="shards=4 with leader_election='sql'"):
        ScalerSettings(**REAL, shards=4, leader_election="sql")
    with pytest.raises(ConfigError, match="shards=5000"):
        ScalerSettings(**REAL, shards=5000)
    with pytest.raises(ConfigError, match=r"partials_ship_interval_s=0\.0"):
        ScalerSettings(**REAL, shards=4, partials_ship_interval_s=0.0)
    sharded = ScalerSettings(**REAL, shards=4, lease_duration_s=6.0, lease_renew_s=2.0)
    assert sharded.sharding() == ShardSettings(shards=4, duration_s=6.0, renew_s=2.0)
    # Each policy default is PolicySettings' own.
    assert s.policy == PolicySettings(sustain_s=60.0, bucket_s=10.0, max_replicas=16)


def test_scaler_settings_db_and_local_actuator(tmp_path: Path) -> None:
    from tide.base.errors import ConfigError
    from tide.services.common.config import load_settings
    from tide.services.scaler.actuators import make_actuator
    from tide.services.scaler.settings import DEFAULT_DB, ScalerSettings

    assert ScalerSettings(**REAL).db == DEFAULT_DB == "sqlite:///.tide/tide.db"
    url = f"sqlite:///{tmp_path}/a.db"
    flags = ["--coordinator", "127.0.0.1:9", "--actuator", f"local:{tmp_path}"]
    assert load_settings(ScalerSettings, [*flags, "--db", url], env={}).db == url
    assert load_settings(ScalerSettings, flags, env={"TIDE_DB": url}).db == url
    with pytest.raises(ConfigError, match="coordinator: required; pass --coordinator HOST:PORT"):
        ScalerSettings(actuator=f"local:{tmp_path}")
    with pytest.raises(ConfigError, match="pass --actuator local:DIR"):
        ScalerSettings(coordinator="127.0.0.1:9")
    with pytest.raises(ConfigError, match="actuator"):
        ScalerSettings(coordinator="127.0.0.1:9", actuator="local:")
    with pytest.raises(ConfigError, match="actuator"):
        ScalerSettings(coordinator="127.0.0.1:9", actuator="memory")
    s = ScalerSettings(actuator=f"local:{tmp_path}", coordinator="127.0.0.1:9", total_gpus=3)
    a = make_actuator(
        s.actuator, coordinator=s.coordinator, total_gpus=s.total_gpus, clock=FakeClock(T0)
    )
    from tide.services.scaler.actuators.local import LocalActuator

    assert isinstance(a, LocalActuator)
    assert (a.settings.state_dir, a.settings.total_gpus) == (tmp_path, 3)
    assert a.settings.coordinator == "127.0.0.1:9"


async def test_the_pass_decides_again_only_for_changed_inputs_or_a_timed_answer(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass over every job runs ``decide`` for a job only when what it reads changed,
    or when its last answer depends on the time (a cooldown running out)."""
    decided: list[Reason] = []
    real = pol.decide

    def counting(*args: Any, **kwargs: Any) -> pol.Decision:
        d = real(*args, **kwargs)
        decided.append(d.reason)
        return d

    monkeypatch.setattr(pol, "decide", counting)
    seq = feed(rig, 35, 50.0)
    await rig.core.tick()
    assert decided == [Reason.WITHIN_BAND]
    rig.clock.advance(0.2)  # time alone: the same samples, still fresh
    await rig.core.tick()
    assert decided == [Reason.WITHIN_BAND]  # not decided again...
    ev = rig.core.evaluations["ns/a"]
    assert (ev.decision.reason, ev.at_s) == (Reason.WITHIN_BAND, rig.clock.now())  # ...answered
    assert rig.core.pipeline.reused == 1
    seq = feed(rig, 1, 90.0, start_seq=seq)  # the newest bucket's mean moves
    await rig.core.tick()
    assert decided == [Reason.WITHIN_BAND] * 2

    dec = await rig.core.request_resize("ns/a", 3, "load test", "alice")
    assert await final(rig, dec.id) is DecisionState.COMPLETED
    await rig.core.tick()
    await rig.core.tick()  # the same inputs, but a cooldown's answer changes with time
    assert decided[2:] == [Reason.COOLDOWN] * 2
    feed(rig, 61, 50.0, start_seq=seq)  # past the 60 s cooldown, the samples fresh
    await rig.core.tick()
    assert decided[-1] is not Reason.COOLDOWN


@pytest.mark.parametrize("broken", [False, True])
async def test_the_pass_writes_its_decisions_in_one_batch_or_each_alone(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    """A pass's decisions go to the store together (``create_many``); should that write
    fail as a whole (here a KeyError, as for a job whose shard went meanwhile), each is
    written alone and the loop goes on."""
    await rig.core.upsert_job("ns/b", FAST, gpus_per_replica=4)
    await eventually(lambda: "uid-b-1" in rig.core.registry.by_uid)
    batches: list[list[str]] = []
    create_many = rig.store.create_many

    async def counted(items: Any) -> Any:
        batches.append(sorted(i["job_id"] for i in items))
        if broken:
            raise KeyError(items[0]["job_id"])
        return await create_many(items)

    monkeypatch.setattr(rig.store, "create_many", counted)
    nodes = {"n1": PODS, "n2": ["uid-b-0"] * 4 + ["uid-b-1"] * 4}
    streams = {n: rig.core.ingest.open_stream() for n in nodes}
    for seq in range(1, 36):
        rig.clock.advance(1.0)
        for node, pods in nodes.items():
            rig.core.ingest.process(
                streams[node], report(node, seq, t=rig.clock.now(), utils=[95.0] * 8, pods=pods)
            )
    await rig.core.tick()
    assert batches == [["ns/a", "ns/b"]]
    # Not ``set(rig.core.active)`` right after the pass: written alone, ns/a's decision
    # is handed to the driver before ns/b's write, and may run its whole lifecycle
    # (and leave ``active``) while that write waits, as on PostgreSQL under load,
    # where ns/b's write opened a new connection. Each decision's end in the store
    # and the job's new size mirrored in the book show that the driver took it.
    for task in list(rig.core.controller.tasks.values()):
        await task
    for job in ("ns/a", "ns/b"):
        page = await rig.store.list_decisions(job_id=job)
        assert [(d.reason, d.to_replicas, d.state) for d in page.decisions][:1] == [
            ("SUSTAINED_HIGH_UTILIZATION", 4, DecisionState.COMPLETED)
        ]
        assert rig.core.jobs[job].current_replicas == 4
    assert not rig.core.active


async def test_the_pass_over_many_jobs_is_spread_over_the_interval(rig: Rig) -> None:
    """Over YIELD_EVERY_JOBS jobs, ``run`` evaluates them in slices spread over the
    interval: every job once a round, no job twice, and never the whole fleet at once."""
    from tide.services.scaler.tuning import YIELD_EVERY_JOBS

    core, clock = rig.core, rig.clock
    for i in range(3 * YIELD_EVERY_JOBS):  # with ns/a: three slices
        await core.upsert_job(f"ns/many-{i}", FAST, gpus_per_replica=4)
    everyone = {j for j in core.jobs if core.acts_on(j)}
    slices: list[list[str] | None] = []
    tick = core.loop.tick

    async def record(some: Any = None) -> None:
        slices.append(None if some is None else list(some))
        await tick(some)

    core.loop.tick = record  # type: ignore[method-assign]
    loop = asyncio.create_task(core.run())
    try:
        await eventually(lambda: len(slices) == 1)
        for n in (2, 3):
            # The next slice waits for its third of the interval, not a moment less.
            clock.advance(core.evaluate_interval_s / 3 - 0.01)
            core.wakeups.wake()
            await asyncio.sleep(0.05)
            assert len(slices) == n - 1
            clock.advance(0.01)
            core.wakeups.wake()
            await eventually(lambda n=n: len(slices) == n)
        first_round = [j for s in slices for j in (s or [])]
        assert None not in slices
        assert all(0 < len(s or []) <= len(everyone) // 2 for s in slices)
        assert sorted(first_round) == sorted(everyone)  # each job once
        clock.advance(core.evaluate_interval_s / 3)
        core.wakeups.wake()
        await eventually(lambda: len(slices) == 4)
        assert slices[3] == slices[0]  # the next round starts over
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
