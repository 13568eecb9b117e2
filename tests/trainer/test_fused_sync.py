"""Fleet's stage-1 gradient reduce and parameter broadcast bundled (tide/trainer/fused_sync.py):
over a real gloo group of 3 ranks, the parameters of fleet's own per-tensor path, every rank
alike, in far fewer collectives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.ranks import run_ranks
from tide.trainer.fused_sync import runs_by_dtype

pytestmark = [pytest.mark.integration, pytest.mark.paddle]

WORKER = str(Path(__file__).with_name("fused_sync_worker.py"))


class _P:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def test_runs_keep_order_and_split_where_the_dtype_changes() -> None:
    ps = [_P("f32"), _P("f32"), _P("f16"), _P("f32")]
    assert [[ps.index(p) for p in run] for run in runs_by_dtype(ps)] == [[0, 1], [2], [3]]
    assert runs_by_dtype([]) == []


def test_bundled_collectives_give_fleets_parameters_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("paddle")
    world = 3
    run_ranks(WORKER, tmp_path, world)
    first = np.load(tmp_path / "fused-0.npz")
    for rank in range(world):
        plain, fused = (
            np.load(tmp_path / f"plain-{rank}.npz"),
            np.load(tmp_path / f"fused-{rank}.npz"),
        )
        assert len(plain.files) == len(fused.files) == 8
        for name in plain.files:
            # Every rank holds the owners' bytes (a broadcast copies them)...
            assert fused[name].tobytes() == first[name].tobytes(), (rank, name)
            # ...and they are fleet's, up to the order gloo adds a bundle's elements in.
            np.testing.assert_allclose(fused[name], plain[name], rtol=1e-5, atol=1e-6)
        calls = json.loads((tmp_path / f"calls-{rank}.json").read_text())
        # fleet: a reduce and a broadcast per parameter and step (2 x 8 x 3); bundled: the
        # 1 MiB weight alone, each owner's small ones together.
        assert calls["plain"] == 2 * 8 * 3, calls
        assert calls["fused"] <= 2 * 4 * 3, calls
