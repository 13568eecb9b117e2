"""A world of ranks as threads of one process, for the trainer's collectives over the world
group (tide/trainer/transfer.py's ``gather_ints``, ``agree`` and ``send_state``): a test runs
one restore per rank at once and sees what each rank returns or raises, without Paddle or a
process group. Test double: never reachable from production code.

A rank that returns or raises leaves the world; a rank still calling a collective then waits
for it until ``timeout_s`` and gets ``threading.BrokenBarrierError``: what a real world would
do is hang (the deadlock a test looks for)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from tide.trainer.rawstate import StateFiles
from tide.trainer.transfer import Fanout, Transferred

T = TypeVar("T")


class ThreadWorld:
    """``size`` ranks, each a thread of :meth:`run`. ``damaged``: the ranks whose received
    state arrives with a flipped byte (its chunks' digests differ)."""

    def __init__(self, size: int, damaged: Sequence[int] = (), timeout_s: float = 10.0) -> None:
        self.size = size
        self.damaged = frozenset(damaged)
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[Any] = [None] * size
        self._local = threading.local()

    @property
    def rank(self) -> int:
        return int(self._local.rank)

    def _exchange(self, value: Any) -> list[Any]:
        self._slots[self.rank] = value
        self._barrier.wait()
        out = list(self._slots)
        # Nobody writes the next collective's value before every rank has read this one's.
        self._barrier.wait()
        return out

    def gather_ints(self, values: Sequence[int], world_size: int) -> list[list[int]]:
        assert world_size == self.size, (world_size, self.size)
        return [list(v) for v in self._exchange([int(v) for v in values])]

    def agree(self, flag: int, op: str = "max") -> int:
        got = [int(v) for v in self._exchange(int(flag))]
        return max(got) if op == "max" else min(got)

    def send_state(
        self,
        files: StateFiles | None,
        step: int,
        source: int,
        rank: int,
        chunk_bytes: int,
        keep: bool,
        into: Mapping[str, Any] | None = None,
        fanout: Fanout | None = None,
    ) -> tuple[int, StateFiles, Transferred]:
        """``source``'s state to the ranks that ``keep`` it; a receiver's bytes go into
        ``into``'s arrays of the same name and shape, as the real transfer's do (a damaged
        one leaves them there)."""
        assert rank == self.rank
        mine = None
        if rank == source:
            assert files is not None
            mine = (dict(files), dict(files.arrays), step)
        sent = self._exchange(mine)
        moved = Transferred()
        if not keep:
            return 0, StateFiles(), moved
        small, arrays, got_step = sent[source]
        got: dict[str, Any] = {}
        for name, array in arrays.items():
            have = (into or {}).get(name)
            fits = have is not None and have.shape == array.shape and have.dtype == array.dtype
            dest: Any = have if fits else np.empty_like(array)
            dest[...] = array
            got[name] = dest
            moved.nbytes += int(array.nbytes)
        if rank in self.damaged and got:
            first = next(iter(got.values()))
            first.reshape(-1).view(np.uint8)[0] ^= 0xFF
            moved.intact = False
        return int(got_step), StateFiles(small, got), moved

    def run(self, body: Callable[[int], T], timeout_s: float = 60.0) -> list[T | BaseException]:
        """``body(rank)`` on every rank at once: what each returned or raised, by rank."""
        results: list[T | BaseException | None] = [None] * self.size

        def one(rank: int) -> None:
            self._local.rank = rank
            try:
                results[rank] = body(rank)
            except BaseException as exc:  # the test reads it
                results[rank] = exc

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                raise TimeoutError(f"a rank of {self.size} did not return in {timeout_s}s")
        return cast("list[T | BaseException]", results)
