"""A planned resize's state goes to the newcomers alone (tide/trainer/transfer.py's Fanout): the
stayers' sockets receive nothing of it (the kernel's byte count), the newcomers get every
chunk intact from one or two senders, the small files from the source; below the size
threshold the old broadcast over the whole group still reaches every stayer (which the same
count sees); a damaged chunk makes its newcomer read the durable store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytest.importorskip("paddle")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.paddle,
    pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to count bytes"),
]

WORKER = str(Path(__file__).with_name("transfer_newcomers_worker.py"))


def test_stayers_receive_nothing_and_newcomers_get_the_sources_state(tmp_path: Path) -> None:
    world = 4
    run_ranks(WORKER, tmp_path, world, timeout_s=240)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)]
    two, one, whole, flipped = zip(*results, strict=True)
    state_bytes = two[0]["state_bytes"]
    assert state_bytes > 8 * 2**20

    for phase in (two, one, whole):
        assert [r["source"] for r in phase] == ["memory", "memory", "peer", "peer"]
        for rank, r in enumerate(phase):
            assert r["intact"] and r["digests"] == r["expected"]
            # The small files are the source's (rank 0's), not another sender's.
            assert r["rng"] == f"rng-{r['step']}-of-rank-{0 if rank != 1 else 1}"
        # Every newcomer's sockets received the whole state.
        assert all(r["socket_bytes"] >= state_bytes for r in phase[2:]), phase

    assert [r["senders"] for r in two[2:] + one[2:] + whole[2:]] == [2, 2, 1, 1, 0, 0]
    # Newcomers alone: the other stayer received nothing of it (group set-up and the
    # plan's all-gathers are a few KB), and neither did the source.
    for phase in (two, one):
        assert phase[1]["socket_bytes"] < 256 * 2**10, phase
        assert phase[0]["socket_bytes"] < 256 * 2**10, phase
    # Below the threshold: the broadcast over the whole group reaches the other stayer too.
    assert whole[1]["socket_bytes"] >= state_bytes

    # A damaged chunk (newcomer 2, from sender 0's share): detected, the source makes the
    # step durable, the newcomer reads it there; the others keep what they took.
    assert [r["source"] for r in flipped] == ["memory", "memory", "disk", "peer"]
    assert [r["intact"] for r in flipped] == [True, True, False, True]
    for r in flipped:
        assert r["step"] == 8 and r["digests"] == r["expected"]
    assert flipped[2]["durable"] == [3, 8]
