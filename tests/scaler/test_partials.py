"""Sharded ingest (tide/services/scaler/partials.py): the same stream of reports, split across
replicas that ship partial aggregates to the job's owner, gives the owner the windows,
coverage and rollups that one replica given every report holds."""

from __future__ import annotations

import pytest

from tide.services.testing.shards import compare_sharded

pytestmark = pytest.mark.component


@pytest.mark.parametrize(("replicas", "ship_every_s", "seed"), [(3, 3, 5), (2, 1, 6), (4, 7, 7)])
def test_sharded_windows_match_a_single_replica(
    replicas: int, ship_every_s: int, seed: int
) -> None:
    assert compare_sharded(replicas=replicas, ship_every_s=ship_every_s, seed=seed) == []


def test_partials_survive_the_wire() -> None:
    """What ShipPartials carries is what take_partials gave (tide/services/scaler/peers.py)."""
    from tide.services.scaler.partials import JobPartial
    from tide.services.scaler.peers import partial_from_proto, partial_to_proto
    from tide.v1 import peers_pb2

    p = JobPartial(
        "ns/a",
        2.0,
        3,
        slots={7: [181.5, 2.0, 1.0, 35.0, 12.5], -1: [0.0, 1.0, 0.0, 0.0, 0.0]},
        seconds={1_800_000_014: [181.5, 2.0, 81.5, 100.0]},
        seen_s={("n1", 0): 1_800_000_014.25, ("n2", 7): 1_800_000_013.5},
    )
    wire = peers_pb2.ShipPartialsRequest(sender="r0", jobs=[partial_to_proto(p)])
    back = peers_pb2.ShipPartialsRequest.FromString(wire.SerializeToString())
    assert partial_from_proto(back.jobs[0]) == p
