"""The parallel run's order (tests/support/schedule.py): the slow tests start first in every
worker's block, nothing is lost or repeated, and the blocks are worksteal's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from xdist.scheduler.worksteal import WorkStealingScheduling

from tests.support.schedule import block_sizes, long_first_in_every_block

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("total", "workers"), [(2019, 4), (10, 3), (5, 4), (0, 2)])
def test_the_blocks_are_the_sizes_worksteal_hands_out(total: int, workers: int) -> None:
    class Node:
        shutting_down = False
        gateway = SimpleNamespace(id="gw")

        def __init__(self) -> None:
            self.got: list[int] = []

        def send_runtest_some(self, indices: list[int]) -> None:
            self.got.extend(indices)

        def shutdown(self) -> None:
            pass

    class Config:
        def __init__(self) -> None:
            self.tx = [f"{workers}*popen"]

        def getvalue(self, name: str) -> object:
            return getattr(self, name, None)

    sched = WorkStealingScheduling(Config())  # type: ignore[arg-type]
    nodes = [Node() for _ in range(workers)]
    names = [f"t{i}" for i in range(total)]
    for n in nodes:
        sched.add_node(n)  # type: ignore[arg-type]
        sched.add_node_collection(n, names)  # type: ignore[arg-type]
    sched.schedule()
    assert [len(n.got) for n in nodes] == block_sizes(total, workers)


def test_every_block_starts_with_its_share_of_the_long_ones_heaviest_first() -> None:
    weights = {"s0": 10.0, "s1": 50.0, "s2": 30.0, "s3": 20.0, "s4": 40.0}
    items = [f"q{i}" for i in range(20)] + list(weights)
    out = long_first_in_every_block(items, 3, weights.get)
    assert sorted(out) == sorted(items)
    sizes = block_sizes(len(items), 3)
    blocks = [out[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(3)]
    # 50, 40, 30 dealt in turn, then back the other way: 20 to the third block, 10 to the second.
    assert [b[:2] for b in blocks] == [["s1", "q0"], ["s4", "s0"], ["s2", "s3"]]
    quick = [it for it in out if it.startswith("q")]
    assert quick == [f"q{i}" for i in range(20)], "the quick ones changed order"
