"""The state's way to newcomers over a real gloo group (tide/trainer/transfer.py, restore.py):
stayers keep their own, the newcomer receives chunked and checked tensors, and a damaged
chunk makes the newcomer read the durable store while the stayers keep what they took."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.ranks import run_ranks

pytest.importorskip("paddle")

pytestmark = [pytest.mark.integration, pytest.mark.paddle]

WORKER = str(Path(__file__).with_name("transfer_worker.py"))


def test_newcomers_get_checked_chunks_and_a_damaged_one_falls_back_to_disk(
    tmp_path: Path,
) -> None:
    world = 3
    run_ranks(WORKER, tmp_path, world)
    disk, clean, flipped = zip(
        *(json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(world)),
        strict=True,
    )

    # After a crash: rank 0 reads the raw checkpoint and sends its arrays as tensors (its
    # state.tensors decoded, not a file inside the packed blob); the others receive them.
    assert [r["source"] for r in disk] == ["disk", "peer", "peer"]
    for r in disk:
        assert (r["step"], r["intact"], r["rng"]) == (3, True, "rng-3")
        assert r["digests"] == r["expected"] and not r["tensors_file"]

    # A planned resize: the stayers take their own, the newcomer gets the same bytes.
    assert [r["source"] for r in clean] == ["memory", "memory", "peer"]
    for r in clean:
        assert (r["step"], r["intact"], r["rng"]) == (5, True, "rng-5")
        assert r["digests"] == r["expected"]
    assert clean[2]["durable"] == [3]
    # The newcomer's live tensor received its bytes in place.
    assert clean[2]["live_is_result"] and clean[2]["live"] == clean[2]["expected"]["model/w"]

    # A damaged chunk: detected; the source makes the step durable, the newcomer reads it.
    assert [r["source"] for r in flipped] == ["memory", "memory", "disk"]
    assert [r["intact"] for r in flipped] == [True, True, False]
    for r in flipped:
        assert (r["step"], r["rng"]) == (6, "rng-6")
        assert r["digests"] == r["expected"], "a rank went on with damaged state"
    assert flipped[2]["durable"] == [3, 6]
