"""Sharded ingest (services/scaler/partials.py): the same stream of reports, split across
replicas that ship partial aggregates to the job's owner, gives the owner the windows,
coverage and rollups that one replica given every report holds."""

from __future__ import annotations

import pytest

from services.testing.shards import compare_sharded

pytestmark = pytest.mark.component


@pytest.mark.parametrize(("replicas", "ship_every_s", "seed"), [(3, 3, 5), (2, 1, 6), (4, 7, 7)])
def test_sharded_windows_match_a_single_replica(
    replicas: int, ship_every_s: int, seed: int
) -> None:
    assert compare_sharded(replicas=replicas, ship_every_s=ship_every_s, seed=seed) == []
