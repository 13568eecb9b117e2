"""Where a new worker's state comes from (transfer.py), the handover in the pod's memory
(handover.py) and durable writes off the critical path (persist.py)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.poll import wait_for
from tide.trainer.checkpoint import CheckpointStore, WrittenCheckpoint
from tide.trainer.handover import ShmHandover, StateHandover, pod_handover_dir
from tide.trainer.persist import DurableWriter, Snapshot
from tide.trainer.restore import locate
from tide.trainer.transfer import (
    BUNDLE_BELOW_BYTES,
    Holding,
    RestorePlan,
    Where,
    bundles,
    pack,
    plan_restore,
    unpack,
)

pytestmark = pytest.mark.unit

M, D, N = Where.MEMORY, Where.DISK, Where.NOWHERE


@pytest.mark.parametrize(
    ("holdings", "plan"),
    [
        # A planned resize of stayers only: each takes its own, nothing moves.
        ([(7, M), (7, M)], RestorePlan(7)),
        # Newcomers: the first stayer sends to them alone; every stayer keeps its own.
        ([(7, M), (7, M), (0, N)], RestorePlan(7, 0, (2,))),
        ([(7, M), (7, M), (0, N), (0, N)], RestorePlan(7, 0, (2, 3))),
        ([(0, N), (7, M)], RestorePlan(7, 1, (0,))),
        # After a crash: the durable store's newest, read by one rank only.
        ([(0, N), (10, D), (10, D)], RestorePlan(10, 1, (0, 2))),
        # Memory beats disk for the same step; the newest step beats both.
        ([(10, D), (10, M)], RestorePlan(10, 1, (0,))),
        ([(10, M), (12, D)], RestorePlan(12, 1, (0,))),
        ([(0, N), (0, N)], RestorePlan(0)),
    ],
)
def test_the_newest_step_from_memory_first(
    holdings: list[tuple[int, Where]], plan: RestorePlan
) -> None:
    assert plan_restore([Holding(s, w) for s, w in holdings]) == plan


def test_small_pieces_travel_bundled_up_to_a_chunk_and_large_ones_alone() -> None:
    big = BUNDLE_BELOW_BYTES
    # Two small, one large, three small that overflow a 100-byte chunk, one small.
    sizes = [10, 20, big, 60, 30, 40, 5]
    assert bundles(sizes, 100) == [[0, 1], [2], [3, 4], [5, 6]]
    assert bundles([], 100) == []
    assert bundles([big, big], 100) == [[0], [1]]
    # Every piece once, in order.
    flat = [i for b in bundles(sizes, 64) for i in b]
    assert flat == list(range(len(sizes)))


def test_files_travel_as_one_blob() -> None:
    files = {"model.pdparams": b"\x00" * 5, "empty": b"", "tide.step": b"12"}
    assert unpack(pack(files)) == files
    with pytest.raises(ValueError, match="stray"):
        unpack(pack(files) + b"x")


class MemoryHandover:
    """A handover in this process's memory: the fake, with the real one's semantics."""

    def __init__(self) -> None:
        self._held: tuple[int, dict[str, bytes], str] | None = None

    def put(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        digest = f"{step:064x}"
        self._held = (step, dict(files), digest)
        return WrittenCheckpoint(step, Path("memory"), digest, 0.0)

    def latest_step(self) -> int | None:
        return self._held[0] if self._held else None

    def take(self) -> Any:
        from tide.trainer.checkpoint import LoadedCheckpoint

        if self._held is None:
            return None
        step, files, digest = self._held
        return LoadedCheckpoint(step, Path("memory"), digest, files, {})

    def reserve(self, nbytes: int, room_bytes: int = 0) -> bool:
        return False


@pytest.fixture(params=["shm", "memory"])
def handover(request: pytest.FixtureRequest, tmp_path: Path) -> StateHandover:
    if request.param == "shm":
        return ShmHandover(tmp_path / "shm")
    return MemoryHandover()


def test_handover_contract_keeps_the_newest_state(handover: StateHandover) -> None:
    assert handover.latest_step() is None and handover.take() is None
    handover.put(3, {"a": b"1"}, {})
    first = handover.put(5, {"a": b"2"}, {"step": 5})
    assert handover.latest_step() == 5
    taken = handover.take()
    assert taken is not None and (taken.step, dict(taken.files)) == (5, {"a": b"2"})
    assert len(first.digest) == 64


def test_a_lone_rank_restores_from_memory_before_disk(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    store.write(4, {"x": b"disk"}, {})
    mem = MemoryHandover()
    mem.put(6, {"x": b"memory"}, {})
    got = locate(mem, store, rank=0, world_size=1)
    assert (got.step, got.source, dict(got.files)) == (6, "memory", {"x": b"memory"})
    assert got.disk_read_s == 0.0
    assert locate(None, store, 0, 1).source == "disk"


def test_pod_handover_dirs_are_per_pod_and_launcher() -> None:
    a = pod_handover_dir("ns/job", "pod-0", "aaaaaaaa11")
    assert a != pod_handover_dir("ns/job", "pod-1", "aaaaaaaa11")
    assert a != pod_handover_dir("ns/job", "pod-0", "bbbbbbbb11")
    assert "/" not in a.name


class SlowStore:
    """A durable store whose writes wait for the test to let them through."""

    def __init__(self, root: Path) -> None:
        self.inner = CheckpointStore(root)
        self.gate = threading.Event()
        self.started: list[int] = []

    def write(
        self, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> WrittenCheckpoint:
        self.started.append(step)
        self.gate.wait(10)
        return self.inner.write(step, files, meta)


def test_durable_writes_run_beside_training_and_the_newest_waiting_one_wins(
    tmp_path: Path,
) -> None:
    store = SlowStore(tmp_path / "ckpt")
    writer = DurableWriter(store)  # type: ignore[arg-type]
    writer.submit(Snapshot(1, {"f": b"1"}, {}, True))
    # submit returned; step 1 is being written beside this thread; 2 waits, 3 replaces it.
    wait_for(lambda: store.started == [1], what="the write of step 1 under way")
    assert not writer.idle()
    writer.submit(Snapshot(2, {"f": b"2"}, {}, True))
    writer.submit(Snapshot(3, {"f": b"3"}, {}, False))
    assert writer.poll() == []
    store.gate.set()
    assert writer.wait(10)
    done = writer.poll()
    assert [d.snapshot.step for d in done] == [1, 3] and store.started == [1, 3]
    assert all(d.checkpoint is not None for d in done)
    assert store.inner.list_steps() == [1, 3]


def test_a_failed_durable_write_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = DurableWriter(CheckpointStore(blocker / "ckpt"))
    writer.submit(Snapshot(1, {"f": b"1"}, {}, True))
    assert writer.wait(10)
    (done,) = writer.poll()
    assert done.checkpoint is None and "Error" in done.error


@pytest.fixture(params=["dir", "object"])
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from tide.trainer.objstore import make_store

    if request.param == "dir":
        return make_store(str(tmp_path / "ckpt"), keep=2)
    return make_store(f"memory://tide-test/{tmp_path.name}", keep=2)


def test_durable_store_contract(durable: Any) -> None:
    """A directory and an object store commit, verify, prune and clean up alike."""
    from tide.trainer.checkpoint import CheckpointNotFound

    with pytest.raises(CheckpointNotFound):
        durable.load_latest()
    for step in (1, 2, 3):
        durable.write(step, {"m": bytes([step]) * 4}, {"step": step})
    assert durable.list_steps() == [2, 3]
    latest = durable.load_latest()
    assert (latest.step, dict(latest.files)) == (3, {"m": b"\x03" * 4})
    assert durable.load_latest(at_most=2).step == 2
    assert durable.cleanup_tmp() == 0


def test_an_object_store_checkpoint_is_visible_only_with_a_manifest_that_verifies() -> None:
    from tide.trainer.objstore import ObjectStore

    store = ObjectStore("memory://tide-test/torn", keep=3)
    store.write(1, {"m": b"good"}, {})
    store.write(2, {"m": b"newer"}, {})
    # A torn write: data without a manifest; a damaged one: data that lies.
    store.fs.pipe_file(f"{store.root}/step-00000003.abcd/m", b"torn")
    (newest,) = [p for s, p, _ in store._prefixes() if s == 2]
    store.fs.pipe_file(f"{newest}/m", b"bitrot")
    assert store.list_steps() == [1, 2]
    loaded = store.load_latest()
    assert loaded.step == 1 and len(loaded.skipped) == 1
    assert store.cleanup_tmp() == 1 and store.list_steps() == [1, 2]


def test_a_raw_durable_checkpoint_is_restored_as_arrays_not_one_file(tmp_path: Path) -> None:
    import numpy as np

    from tide.trainer.rawstate import TENSORS, StateFiles

    store = CheckpointStore(tmp_path / "ckpt")
    arrays: dict[str, Any] = {
        "model/w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "opt/m": np.ones(5),
    }
    store.write(4, StateFiles({"rng.pickle": b"r"}, arrays), {})
    got = locate(None, store, rank=0, world_size=1)
    # state.tensors decoded into its arrays (views of the bytes read): a transfer sends them
    # as tensors, not as one file inside the small files' packed blob.
    assert (got.step, got.source, dict(got.files)) == (4, "disk", {"rng.pickle": b"r"})
    assert TENSORS not in got.files
    got_arrays = getattr(got.files, "arrays", {})
    assert sorted(got_arrays) == sorted(arrays)
    for name, array in arrays.items():
        assert np.array_equal(got_arrays[name], array)
        assert got_arrays[name].dtype == array.dtype


def _raw(step: int, size: int) -> Any:
    import numpy as np

    from tide.trainer.rawstate import StateFiles

    return StateFiles({"rng.pickle": b"%d" % step}, {"w": np.full(size, step, np.uint8)})


def test_a_put_writes_over_the_reserve_a_fresh_pod_filled(tmp_path: Path) -> None:
    import numpy as np

    from tide.trainer.handover import RESERVE

    shm = ShmHandover(tmp_path / "shm")
    assert shm.reserve(5000)
    reserve = tmp_path / "shm" / RESERVE
    wait_for(reserve.exists, timeout_s=10)
    inode = reserve.stat().st_ino
    shm.put(1, _raw(1, 3000), {})
    tensors = tmp_path / "shm" / "step-00000001" / "state.tensors"
    # The reserve's pages became the handover (cut to its size); no reserve is left.
    assert tensors.stat().st_ino == inode and not reserve.exists()
    taken = shm.take()
    assert taken is not None and np.array_equal(getattr(taken.files, "arrays", {})["w"], [1] * 3000)
    # A pod with a handover (or a reserve) fills none; a put cancels any later one.
    assert not shm.reserve(5000)


def test_a_put_writes_over_the_taken_handover_once_nothing_maps_it(tmp_path: Path) -> None:
    import gc

    import numpy as np

    before = ShmHandover(tmp_path / "shm")
    before.put(1, _raw(1, 4000), {})
    first = tmp_path / "shm" / "step-00000001" / "state.tensors"
    inode = first.stat().st_ino

    after = ShmHandover(tmp_path / "shm")  # the pod's next worker
    taken = after.take()
    assert taken is not None
    held = getattr(taken.files, "arrays", {})["w"]
    # Its views still in use (rank 0's durable write of it): the put writes new pages, and
    # step 1's become the spare (tests/trainer/test_handover_pages.py).
    after.put(2, _raw(2, 4000), {})
    second = tmp_path / "shm" / "step-00000002" / "state.tensors"
    assert second.stat().st_ino != inode
    assert (tmp_path / "shm" / "reserve.tensors").stat().st_ino == inode
    assert np.array_equal(held, [1] * 4000), "a view of the taken state was written over"
    del taken, held
    gc.collect()
    # Nothing maps step 2's pages in this process: step 3 goes into them.
    inode = second.stat().st_ino
    after.put(3, _raw(3, 4100), {})
    third = tmp_path / "shm" / "step-00000003" / "state.tensors"
    assert third.stat().st_ino == inode
    got = after.take()
    assert got is not None and np.array_equal(getattr(got.files, "arrays", {})["w"], [3] * 4100)
