"""Scenarios: every default written once, variants and overrides, errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tide.base.errors import ConfigError
from tide.services.sim import model
from tide.services.sim import scenario as sc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

MINIMAL: dict[str, Any] = {
    "duration": "2d",
    "jobs": [{"name": "a", "work": {"hours": 2, "at_replicas": 2}, "min_replicas": 2}],
}


def test_every_scenario_in_the_repository_loads_with_each_variant() -> None:
    files = sorted((ROOT / "scenarios").glob("*.yaml"))
    assert {f.stem for f in files} >= {"ecommerce", "pool", "contention"}
    for f in files:
        s = sc.load(f)
        for v in s.variants:
            assert sc.load(f, v).variant == v


def test_defaults_and_work_in_samples() -> None:
    s = sc.parse(MINIMAL)
    (job,) = s.jobs
    assert s.duration_s == 2 * 86400 and s.policies == ("static", "hpa", "tide")
    # 2 hours at 2 replicas of the default curve (100 samples/s per replica, linear).
    assert job.work_samples == pytest.approx(2 * 3600 * 200)
    assert (s.pauses.tide_grow_s, s.pauses.tide_shrink_s, s.pauses.relaunch_s) == (
        1.36,
        0.61,
        4.32,
    )
    assert (s.hpa.sync_s, s.hpa.tolerance, s.hpa.downscale_stabilization_s) == (15, 0.1, 300)


def test_arrivals() -> None:
    daily = sc.parse(
        {
            **MINIMAL,
            "duration": "3d",
            "jobs": [{**MINIMAL["jobs"][0], "arrive": {"daily_at": "01:30"}}],
        }
    )
    assert [j.arrive_s for j in daily.jobs] == [5400, 5400 + 86400, 5400 + 2 * 86400]
    poisson = sc.parse(
        {
            **MINIMAL,
            "jobs": [{**MINIMAL["jobs"][0], "count": 50, "arrive": {"poisson_per_day": 20}}],
        }
    )
    assert len(poisson.jobs) == 50 and len({j.name for j in poisson.jobs}) == 50
    assert all(0 <= j.arrive_s < 2 * 86400 for j in poisson.jobs)


def test_curves() -> None:
    amdahl = model.Curve(per_replica=1000, serial=1 / 33)
    assert amdahl.at(16) / amdahl.at(4) == pytest.approx(3.0, rel=1e-3)
    peaked = model.Curve(per_replica=1000, serial=0.03, comm=0.012)
    assert peaked.best == 9 and peaked.at(16) < peaked.at(8)
    pts = model.Curve(points=((2, 200.0), (4, 300.0)))
    assert (pts.at(1), pts.at(3), pts.at(8)) == (100.0, 250.0, 300.0)


def test_daily_profile_wraps_at_midnight() -> None:
    d = model.parse_daily("x", [[6, 10], [18, 30]])
    assert d.at(6 * 3600) == 10 and d.at(12 * 3600) == 20
    assert d.at(0) == pytest.approx(20.0)  # halfway from 18:00 (30) to 06:00 (10)


def test_variant_and_overrides() -> None:
    doc = {**MINIMAL, "variants": {"big": {"set": {"pool.nodes": 9}}}}
    assert sc.parse(doc, "big").pool.nodes == 9
    assert sc.parse(doc, "big", {"pool.nodes": 3}).pool.nodes == 3
    with pytest.raises(ConfigError, match=r"--variant 'nope'.*\['big'\]"):
        sc.parse(doc, "nope")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"duration": "soon"}, "duration='soon'"),
        ({"pool": {"nodes": -1}}, "pool.nodes=-1"),
        ({"pool": {"gpu": 1}}, "pool: unknown key(s) ['gpu']"),
        ({"tide": {"policy": {"sustain_s": 7}}}, "policy.sustain_s=7"),
        ({"policies": ["hpa", "magic"]}, "unknown policy 'magic'"),
        ({"jobs": [{"work": {}}]}, "jobs[0].work"),
        (
            {"jobs": [{"work": {"samples": 1}, "min_replicas": 40, "max_replicas": 40}]},
            "needs 40 GPUs",
        ),
        ({"bogus": 1}, "unknown key(s) ['bogus']"),
    ],
)
def test_bad_values_name_the_key(change: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        sc.parse({**MINIMAL, **change})
    assert says in str(err.value)
