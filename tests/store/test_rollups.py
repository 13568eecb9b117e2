"""The scaler's repository on both engines: utilization rollups and their per-second detail."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest
from sqlalchemy.orm import Session, sessionmaker

from tests.store.support import tx
from tide.base.errors import InvalidArgument
from tide.services.scaler import store as repo

pytestmark = pytest.mark.integration

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
JOB = "ml/resnet"

R = TypeVar("R")

Factory = sessionmaker[Session]


# --- rollups --------------------------------------------------------------------------------


def _rollup(
    minute: datetime, mean: float, lo: float, hi: float, n: int, replicas: int = 2
) -> repo.RollupRecord:
    return repo.RollupRecord(JOB, minute, mean, lo, hi, n, replicas)


def test_rollup_upsert_merges_a_minute_written_twice(factory: Factory) -> None:
    m0, m1 = T0, T0 + timedelta(minutes=1)
    assert tx(factory, lambda s: repo.write_rollups(s, [_rollup(m0, 50, 40, 60, 10)])) == 1
    # The rest of minute 0 arrives with minute 1; minute 1 also comes in two parts in one batch.
    batch = [
        _rollup(m0, 80, 70, 95, 30, replicas=3),
        _rollup(m1, 20, 10, 30, 5),
        _rollup(m1, 40, 35, 45, 15),
    ]
    assert tx(factory, lambda s: repo.write_rollups(s, batch)) == 2
    got = tx(factory, lambda s: repo.rollups_between(s, JOB, m0, m1 + timedelta(minutes=1)))
    assert len(got) == 2
    first, second = got
    assert first.minute == m0
    assert first.mean_pct == pytest.approx((50 * 10 + 80 * 30) / 40)
    assert (first.min_pct, first.max_pct, first.samples, first.replicas) == (40, 95, 40, 3)
    assert second.mean_pct == pytest.approx((20 * 5 + 40 * 15) / 20)
    assert (second.min_pct, second.max_pct, second.samples) == (10, 45, 20)


def test_rollups_between_is_half_open_and_per_job(factory: Factory) -> None:
    rows = [_rollup(T0 + timedelta(minutes=i), 50, 50, 50, 1) for i in range(5)]
    other = repo.RollupRecord("ml/other", T0, 1, 1, 1, 1, 1)
    tx(factory, lambda s: repo.write_rollups(s, [*rows, other]))
    got = tx(
        factory,
        lambda s: repo.rollups_between(
            s, JOB, T0 + timedelta(minutes=1), T0 + timedelta(minutes=3)
        ),
    )
    assert [r.minute for r in got] == [T0 + timedelta(minutes=1), T0 + timedelta(minutes=2)]
    removed = tx(factory, lambda s: repo.delete_rollups_before(s, T0 + timedelta(minutes=2)))
    assert removed == 3  # minutes 0 and 1 of JOB, and ml/other's minute 0


def test_per_second_detail_is_stored_in_parts_and_added_up(factory: Factory) -> None:
    sums, counts = [0.0] * 60, [0] * 60
    sums[0], counts[0], sums[59], counts[59] = 190.0, 2, 95.0, 1
    part1 = replace(
        _rollup(T0, 95, 95, 95, 3), second_sums=tuple(sums), second_counts=tuple(counts)
    )
    late = [0.0] * 60
    late_counts = [0] * 60
    late[59], late_counts[59] = 85.0, 1
    part2 = replace(
        _rollup(T0, 85, 85, 85, 1), second_sums=tuple(late), second_counts=tuple(late_counts)
    )
    minutes_only = _rollup(T0 + timedelta(minutes=1), 50, 50, 50, 1)
    tx(factory, lambda s: repo.write_rollups(s, [part1, minutes_only]))
    tx(factory, lambda s: repo.write_rollups(s, [part2]))
    got = tx(factory, lambda s: repo.seconds_between(s, JOB, T0, T0 + timedelta(minutes=2)))
    assert list(got) == [T0]  # the minute without detail has none
    s2, c2 = got[T0]
    assert (s2[0], c2[0], s2[59], c2[59], sum(c2)) == (190.0, 2, 180.0, 2, 4)
    assert tx(factory, lambda s: repo.delete_seconds_before(s, T0 + timedelta(minutes=1))) == 2
    assert tx(factory, lambda s: repo.seconds_between(s, JOB, T0, T0 + timedelta(hours=1))) == {}


def test_per_second_detail_must_match_its_minute(factory: Factory) -> None:
    bad = replace(_rollup(T0, 50, 50, 50, 3), second_sums=(150.0,) * 60, second_counts=(1,) * 60)
    with pytest.raises(InvalidArgument, match="add up to samples=3"):
        tx(factory, lambda s: repo.write_rollups(s, [bad]))
    short = replace(_rollup(T0, 50, 50, 50, 1), second_sums=(50.0,), second_counts=(1,))
    with pytest.raises(InvalidArgument, match="60 sums and 60 counts"):
        tx(factory, lambda s: repo.write_rollups(s, [short]))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (_rollup(T0 + timedelta(seconds=30), 50, 40, 60, 1), "start of a minute"),
        (_rollup(T0, math.nan, 40, 60, 1), "finite"),
        (_rollup(T0, 101, 40, 101, 1), "finite in 0..100"),
        (_rollup(T0, 30, 40, 60, 1), "min <= mean <= max"),
        (_rollup(T0, 50, 40, 60, 0), "samples"),
        (_rollup(T0.replace(tzinfo=None), 50, 40, 60, 1), "timezone-aware"),
    ],
)
def test_bad_rollups_are_rejected_and_nothing_is_written(
    factory: Factory, row: repo.RollupRecord, match: str
) -> None:
    good = _rollup(T0 + timedelta(minutes=5), 50, 40, 60, 1)
    with pytest.raises(InvalidArgument, match=match):
        tx(factory, lambda s: repo.write_rollups(s, [good, row]))
    assert tx(factory, lambda s: repo.rollups_between(s, JOB, T0, T0 + timedelta(hours=1))) == []
