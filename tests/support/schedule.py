"""The order the parallel run's tests are handed out in (``make test``, ``--dist worksteal``).

pytest-xdist's worksteal gives each worker a contiguous block of the collection at the
start, in order, and an idle worker later steals the back half of the longest queue. In
file order the long tests (the ``slow`` ones: real trainers, whole stacks, outages that
wait) sat in a few blocks, and the last of them ran at the end: the run's last minute had
the machine half idle, waiting on one or two. So the long ones are dealt out first, the
longest first (by the timeout each test declares, the one estimate of its length the
collection has), in a snake over the blocks so that each gets an even share, and the quick
ones fill the rest of each block: what is stolen and run at the end is short."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def block_sizes(total: int, workers: int) -> list[int]:
    """The sizes of the blocks worksteal's first schedule hands out (xdist 3.x: each idle
    worker in turn gets what is left divided by the workers left)."""
    sizes, left = [], total
    for i in range(workers):
        n = left // (workers - i)
        sizes.append(n)
        left -= n
    return sizes


def long_first_in_every_block(
    items: Sequence[T], workers: int, weight: Callable[[T], float | None]
) -> list[T]:
    """``items`` reordered so that each of the ``workers`` blocks starts with its share of
    the long ones (``weight`` not None), heaviest first; the quick ones keep their order."""
    sizes = block_sizes(len(items), workers)
    weighed = [(w, i) for i, it in enumerate(items) if (w := weight(it)) is not None]
    long_ones = [items[i] for _, i in sorted(weighed, key=lambda p: (-p[0], p[1]))]
    quick = iter([it for it in items if weight(it) is None])
    blocks: list[list[T]] = [[] for _ in range(workers)]
    for k, it in enumerate(long_ones):
        turn, at = divmod(k, workers)
        blocks[at if turn % 2 == 0 else workers - 1 - at].append(it)
    out: list[T] = []
    for block, size in zip(blocks, sizes, strict=True):
        out.extend(block)
        out.extend(next(quick) for _ in range(size - len(block)))
    return out
