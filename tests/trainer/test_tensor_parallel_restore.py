"""A tensor-parallel job's restore (tide/trainer/slices.py locate_slice), every rank of a world
at once as threads (tide/services/testing/collectives.py fakes the world group's collectives):
memory that cannot serve every slice, a damaged slice transfer, slice stores at different
steps, and an error on one rank before a collective. Never a silent restart from scratch, never
a rank left waiting."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tide.base.errors import ConfigError
from tide.services.testing.collectives import ThreadWorld
from tide.trainer import slices
from tide.trainer.checkpoint import CheckpointNotFound, CheckpointStore
from tide.trainer.handover import ShmHandover
from tide.trainer.layout import ModelParallel, RankLayout, slice_name
from tide.trainer.rawstate import StateFiles
from tide.trainer.restore import Located

pytestmark = pytest.mark.unit

MP2 = ModelParallel(mp_degree=2)


def _state(layout: RankLayout, step: int) -> StateFiles:
    """Rank ``layout.rank``'s state at ``step``: its slice's values (equal across replicas)."""
    value = 100.0 * step + layout.coord.mp
    return StateFiles(
        {**slices.layout_file(layout), "meta.json": b"{}"},
        {"w": np.full(4, value, np.float32)},
    )


def _value(located: Located) -> float:
    arrays: dict[str, Any] = getattr(located.files, "arrays", {})
    return float(arrays["w"][0])


class _Job:
    """A job's slice stores under ``root/ckpt`` and one handover directory per pod."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def store(self, part: tuple[int, int, int]) -> CheckpointStore:
        return CheckpointStore(self.root / "ckpt" / slice_name(part))

    def write(self, step: int, old: RankLayout) -> None:
        self.store(old.coord.slice).write(step, _state(old, step), {"step": step})

    def handover(self, pod: int) -> ShmHandover:
        return ShmHandover(self.root / f"pod{pod}")

    def hand_over(self, pod: int, step: int, old: RankLayout) -> None:
        self.handover(pod).put(step, _state(old, step), {})

    def restore(
        self,
        world: int,
        pods: list[int] | None = None,
        damaged: tuple[int, ...] = (),
        monkeypatch: pytest.MonkeyPatch | None = None,
    ) -> list[Located | BaseException]:
        """locate_slice on every rank of a new world of ``world`` ranks; rank r's pod is
        ``pods[r]`` (its handover directory; default: one pod per rank)."""
        assert monkeypatch is not None
        fake = ThreadWorld(world, damaged, timeout_s=5.0)
        for name in ("gather_ints", "agree", "send_state"):
            monkeypatch.setattr(slices, name, getattr(fake, name))
        where = pods or list(range(world))

        def one(rank: int) -> Located:
            layout = RankLayout(MP2, world, rank)
            live = {"w": np.zeros(4, np.float32)}
            return slices.locate_slice(
                layout,
                self.handover(where[rank]),
                self.store(layout.coord.slice),
                into=lambda: live,
                slice_stores=self.store,
            )

        return fake.run(one)


def _located(results: list[Located | BaseException]) -> list[Located]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, Located)]


def test_a_grow_sends_each_newcomer_its_slice_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(tmp_path)
    for rank in range(2):
        job.hand_over(rank, 5, RankLayout(MP2, 2, rank))
    got = _located(job.restore(4, monkeypatch=monkeypatch))
    assert [(g.step, g.source) for g in got] == [
        (5, "memory"),
        (5, "memory"),
        (5, "peer"),
        (5, "peer"),
    ]
    assert [_value(g) for g in got] == [500.0, 501.0, 500.0, 501.0]
    assert job.store((0, 0, 0)).list_steps() == []


def test_a_pod_of_two_workers_resumes_the_handed_step_from_memory_and_its_writer_s_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pod runs the whole replica: its handover holds its first worker's slice (mp 0)
    only, both workers take it, and slice mp 1's writer made it durable at the hold
    (session_control.py). Memory's step 5, not the stores' common step (none)."""
    job = _Job(tmp_path)
    job.hand_over(0, 5, RankLayout(MP2, 2, 0))
    job.write(5, RankLayout(MP2, 2, 1))
    got = _located(job.restore(2, pods=[0, 0], monkeypatch=monkeypatch))
    assert [(g.step, g.source) for g in got] == [(5, "memory"), (5, "disk")]
    assert [_value(g) for g in got] == [500.0, 501.0]
    # Slice mp 0's store lacked it: its holder wrote it there.
    assert job.store((0, 0, 0)).list_steps() == [5]


def test_memory_newer_than_every_store_never_restarts_from_scratch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same pod, but slice mp 1 of step 5 is nowhere: every rank fails loudly."""
    job = _Job(tmp_path)
    job.hand_over(0, 5, RankLayout(MP2, 2, 0))
    results = job.restore(2, pods=[0, 0], monkeypatch=monkeypatch)
    for r in results:
        assert isinstance(r, CheckpointNotFound), r
        assert "slice-pp0-sep0-mp1" in str(r)


def test_a_shrink_that_left_no_holder_of_a_slice_fills_its_store_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 -> 2: the stayers held tensor rank 0 both (old ranks 0 and 2); slice mp 1's store
    has step 9 (its writer), slice mp 0's only 4: step 9, not 4."""
    job = _Job(tmp_path)
    job.hand_over(0, 9, RankLayout(MP2, 4, 0))
    job.hand_over(1, 9, RankLayout(MP2, 4, 2))
    job.write(4, RankLayout(MP2, 4, 0))
    job.write(4, RankLayout(MP2, 4, 1))
    job.write(9, RankLayout(MP2, 4, 1))
    got = _located(job.restore(2, monkeypatch=monkeypatch))
    assert [(g.step, g.source, _value(g)) for g in got] == [
        (9, "memory", 900.0),
        (9, "disk", 901.0),
    ]
    assert job.store((0, 0, 0)).list_steps() == [4, 9]


def test_a_damaged_slice_transfer_falls_back_to_the_stores_at_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 -> 4, newcomer 3's bytes arrive damaged (into its live arrays): the holders write
    step 5 to the empty stores and the newcomers read it there, over what they received."""
    job = _Job(tmp_path)
    for rank in range(2):
        job.hand_over(rank, 5, RankLayout(MP2, 2, rank))
    got = _located(job.restore(4, damaged=(3,), monkeypatch=monkeypatch))
    assert [g.step for g in got] == [5, 5, 5, 5]
    assert [g.source for g in got] == ["memory", "memory", "disk", "disk"]
    assert [_value(g) for g in got] == [500.0, 501.0, 500.0, 501.0]
    assert job.store((0, 0, 1)).list_steps() == [5]


def test_after_a_crash_every_slice_reads_the_newest_step_all_stores_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slice writers at different steps (mp 0 wrote 4 and 8, mp 1 4 and 6): step 4."""
    job = _Job(tmp_path)
    old = [RankLayout(MP2, 2, r) for r in range(2)]
    for step, layout in ((4, old[0]), (8, old[0]), (4, old[1]), (6, old[1])):
        job.write(step, layout)
    got = _located(job.restore(2, monkeypatch=monkeypatch))
    assert [(g.step, g.source, _value(g)) for g in got] == [(4, "disk", 400.0), (4, "disk", 401.0)]


def test_stores_with_no_step_in_common_fail_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(tmp_path)
    job.write(8, RankLayout(MP2, 2, 0))
    job.write(6, RankLayout(MP2, 2, 1))
    for r in job.restore(2, monkeypatch=monkeypatch):
        assert isinstance(r, CheckpointNotFound) and "no step in common" in str(r), r


def test_a_state_of_another_layout_in_one_pod_fails_every_rank_without_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(tmp_path)
    job.hand_over(0, 5, RankLayout(MP2, 2, 0))
    job.hand_over(1, 5, RankLayout(ModelParallel(mp_degree=4), 4, 1))
    results = job.restore(2, monkeypatch=monkeypatch)
    assert not any(isinstance(r, threading.BrokenBarrierError) for r in results), results
    assert all(isinstance(r, ConfigError) for r in results), results


def test_an_unreadable_layout_in_one_store_fails_every_rank_without_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _Job(tmp_path)
    job.write(4, RankLayout(MP2, 2, 0))
    bad = StateFiles({slices.LAYOUT_FILE: b"{not json"}, {"w": np.zeros(4, np.float32)})
    job.store((0, 0, 1)).write(4, bad, {"step": 4})
    results = job.restore(2, monkeypatch=monkeypatch)
    assert not any(isinstance(r, threading.BrokenBarrierError) for r in results), results
    assert all(isinstance(r, CheckpointNotFound) for r in results), results


def test_a_fresh_job_starts_from_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _located(_Job(tmp_path).restore(2, monkeypatch=monkeypatch))
    assert [(g.step, g.source) for g in got] == [(0, ""), (0, "")]


def test_the_thread_world_gathers_by_rank_and_shows_a_rank_left_waiting() -> None:
    """The double the tests above stand on: what each rank gets, and a hang made visible."""
    world = ThreadWorld(3, timeout_s=1.0)

    def body(rank: int) -> tuple[list[list[int]], int, int]:
        return world.gather_ints([rank, 10 * rank], 3), world.agree(rank), world.agree(rank, "min")

    assert world.run(body) == [([[0, 0], [1, 10], [2, 20]], 2, 0)] * 3

    left = ThreadWorld(3, timeout_s=1.0)

    def leaves(rank: int) -> int:
        if rank == 1:
            raise ValueError("rank 1 fails before the collective")
        return left.agree(0)

    results = left.run(leaves)
    assert isinstance(results[1], ValueError)
    assert all(isinstance(results[r], threading.BrokenBarrierError) for r in (0, 2)), results
