"""Which pages a handover put writes over (tide/trainer/handover.py): never a file some
process maps, a spare where the handed-over file is still mapped, at most two state-sized files
per pod, and a put that comes before its spare is filled."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.poll import wait_for
from tide.base.errors import ConfigError
from tide.trainer import handover
from tide.trainer.handover import (
    RESERVE,
    SPARE_ENV,
    HandoverSettings,
    ShmHandover,
    tensor_files,
)
from tide.trainer.rawstate import StateFiles

pytestmark = pytest.mark.unit


def _raw(step: int, size: int) -> StateFiles:
    return StateFiles({"rng.pickle": b"%d" % step}, {"w": np.full(size, step, np.uint8)})


def _tensors(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / "state.tensors"


def _arrays(taken: Any) -> dict[str, Any]:
    return dict(getattr(taken.files, "arrays", {}))


def test_rank_0s_durable_write_keeps_its_pages_and_the_put_goes_into_a_spare(
    tmp_path: Path,
) -> None:
    root = tmp_path / "shm"
    ShmHandover(root).put(1, _raw(1, 4000), {})
    first = _tensors(root, 1).stat().st_ino
    worker = ShmHandover(root)  # the pod's next worker: rank 0, its durable write maps step 1
    taken = worker.take()
    assert taken is not None
    held = _arrays(taken)["w"]
    # Nothing the next put could write over: a spare is filled beside training.
    assert worker.reserve(4096)
    wait_for((root / RESERVE).exists, timeout_s=10)
    spare = (root / RESERVE).stat().st_ino
    worker.put(2, _raw(2, 4000), {})
    # The put wrote over the spare; step 1's pages, still mapped, became the next spare.
    assert _tensors(root, 2).stat().st_ino == spare
    assert (root / RESERVE).stat().st_ino == first
    assert np.array_equal(held, [1] * 4000), "a mapped state was written over"
    # The next worker maps step 2; the spare is free again (its mapper is done).
    del taken, held
    gc.collect()
    nxt = ShmHandover(root)
    again = nxt.take()
    assert again is not None
    assert not nxt.reserve(4096), "a free spare is there: nothing to fill"
    second = _tensors(root, 2).stat().st_ino
    nxt.put(3, _raw(3, 4100), {})
    # Step 2 is mapped by this worker: the put went into the spare, step 2 is the spare now.
    assert _tensors(root, 3).stat().st_ino == first
    assert (root / RESERVE).stat().st_ino == second
    assert len(tensor_files(root)) == 2
    assert np.array_equal(_arrays(again)["w"], [2] * 4000)
    got = ShmHandover(root).take()
    assert got is not None and np.array_equal(_arrays(got)["w"], [3] * 4100)


def test_a_file_another_process_maps_is_never_written_over(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    ShmHandover(root).put(1, _raw(1, 5000), {})
    first = _tensors(root, 1).stat().st_ino
    # Another process of the pod (a leaving worker finishing its durable write) maps step 1.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tide.trainer.handover import ShmHandover\n"
            f"t = ShmHandover({str(root)!r}).take()\n"
            "assert t is not None; print('mapped', flush=True); sys.stdin.read()\n"
            "w = t.files.arrays['w']; print(int(w.min()), int(w.max()), flush=True)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "mapped"
        ShmHandover(root).put(2, _raw(2, 5000), {})
        assert _tensors(root, 2).stat().st_ino != first
        assert (root / RESERVE).stat().st_ino == first
        # Still mapped there: the next put must not take the spare either.
        ShmHandover(root).put(3, _raw(3, 5000), {})
        assert (root / RESERVE).stat().st_ino == first
        holder.stdin.close()
        assert holder.stdout.readline().split() == ["1", "1"]
        assert holder.wait(30) == 0
    finally:
        holder.kill()
    # Once that process is gone, nothing maps any file: the put writes over step 3's (the
    # newest), the spare stays for the put after it.
    third = _tensors(root, 3).stat().st_ino
    ShmHandover(root).put(4, _raw(4, 5000), {})
    assert _tensors(root, 4).stat().st_ino == third
    assert (root / RESERVE).stat().st_ino == first
    assert len(tensor_files(root)) == 2


def test_a_pod_never_holds_more_than_the_handover_and_one_spare(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    maps = []
    for step in range(1, 7):
        worker = ShmHandover(root)
        taken = worker.take()
        if taken is not None:
            maps.append(taken)  # every state taken stays mapped
        worker.put(step, _raw(step, 3000 + step), {})
        assert len(tensor_files(root)) <= 2
        got = ShmHandover(root).take()
        assert got is not None and np.array_equal(_arrays(got)["w"], [step] * (3000 + step))
    for i, taken in enumerate(maps, start=1):
        assert np.array_equal(_arrays(taken)["w"], [i] * (3000 + i))


def test_a_put_that_stops_a_fill_leaves_one_file_and_the_state_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "shm"
    shm = ShmHandover(root)
    filling: list[Path] = []
    real_open = open

    def spy_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if ".tmp-" in str(path) and RESERVE in str(path):
            filling.append(Path(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy_open)
    assert shm.reserve(256 * 2**20)
    wait_for(lambda: filling and filling[0].exists(), timeout_s=10)
    fill = filling[0].stat().st_ino
    # The spare half-filled: the put stops the fill and writes over what it filled (the rest
    # is fresh pages); no half-filled file stays behind.
    shm.put(1, _raw(1, 5000), {})
    assert _tensors(root, 1).stat().st_ino == fill, "the put did not write over the fill"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step-00000001"], names
    assert _tensors(root, 1).stat().st_size < 8192
    got = ShmHandover(root).take()
    assert got is not None and np.array_equal(_arrays(got)["w"], [1] * 5000)


def test_without_the_spare_a_mapped_file_is_freed_and_a_bad_setting_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "shm"
    off = HandoverSettings(spare=False)
    ShmHandover(root, off).put(1, _raw(1, 4000), {})
    worker = ShmHandover(root, off)
    taken = worker.take()
    assert taken is not None
    assert not worker.reserve(4096), "no spare while the taken state is mapped"
    worker.put(2, _raw(2, 4000), {})
    assert not (root / RESERVE).exists() and len(tensor_files(root)) == 1
    assert np.array_equal(_arrays(taken)["w"], [1] * 4000)
    assert HandoverSettings.from_env({SPARE_ENV: "1"}).spare
    with pytest.raises(ConfigError, match=SPARE_ENV):
        HandoverSettings.from_env({SPARE_ENV: "yes"})


def test_a_take_whose_file_a_put_claimed_before_its_lock_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The take opened step 1's file; another process's put claims it (renames it away and
    # writes step 2 over it) before the take's shared lock lands. Mapped, it would read as
    # step 1 with step 2's tensors; the take must see the file was replaced.
    root = tmp_path / "shm"
    ShmHandover(root).put(1, _raw(1, 4000), {})
    real = handover.fcntl.flock
    fired: list[int] = []

    def flock(fd: int, op: int) -> None:
        if op & handover.fcntl.LOCK_SH and not fired:
            fired.append(1)
            ShmHandover(root).put(2, _raw(2, 4000), {})
        real(fd, op)

    monkeypatch.setattr(handover.fcntl, "flock", flock)
    taken = ShmHandover(root).take()
    monkeypatch.setattr(handover.fcntl, "flock", real)
    assert fired
    assert taken is None or (taken.step == 2 and np.array_equal(_arrays(taken)["w"], [2] * 4000)), (
        "a take mixed one step's files with another's tensors"
    )
    again = ShmHandover(root).take()
    assert again is not None and again.step == 2
    assert np.array_equal(_arrays(again)["w"], [2] * 4000)


def test_no_spare_is_filled_where_it_would_not_fit_in_the_pods_memory_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{2 * 2**30}\n")
    (cgroup / "memory.current").write_text(f"{int(1.8 * 2**30)}\n")
    monkeypatch.setattr(handover, "_CGROUP", cgroup)
    shm = ShmHandover(tmp_path / "shm")
    # 200 MB left under the limit: a 64 MB spare would leave less than the margin.
    assert not shm.reserve(64 * 2**20)
    # 700 MB left: a 4 KiB spare fits, but not where room for a model-parallel pod's four
    # workers' 100 MB slices is asked.
    (cgroup / "memory.current").write_text(f"{2 * 2**30 - 700 * 2**20}\n")
    assert not shm.reserve(4096, room_bytes=4 * 100 * 2**20)
    assert shm.reserve(4096, room_bytes=4096)
    wait_for((tmp_path / "shm" / RESERVE).exists, timeout_s=10)


def test_a_take_that_stays_locked_out_reads_as_damaged_not_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process forked during a put's claim keeps its exclusive lock until it exits.
    import fcntl
    import os

    root = tmp_path / "shm"
    ShmHandover(root).put(1, _raw(1, 4000), {})
    fd = os.open(_tensors(root, 1), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        monkeypatch.setattr(handover, "_LOCK_WAIT_S", 0.2)
        assert ShmHandover(root).take() is None
    finally:
        os.close(fd)
    assert ShmHandover(root).take() is not None


def test_a_launcher_removes_the_handover_dirs_of_launchers_that_died_not_of_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container restarted in its pod keeps /dev/shm: the launcher before it, SIGKILLed,
    # left its directory, a state's size; one beside it still lives.
    monkeypatch.setattr(handover, "SHM", tmp_path)
    live = handover.own_pod_handover_dir("ns/job", "pod-0", "aaaaaaaa")
    ShmHandover(live).put(1, _raw(1, 4000), {})
    dead = handover.pod_handover_dir("ns/job", "pod-0", "bbbbbbbb")
    ShmHandover(dead).put(1, _raw(1, 4000), {})
    (dead / "launcher.lock").touch()  # its owner's lock went with its process
    older = handover.pod_handover_dir("ns/job", "pod-0", "cccccccc")
    older.mkdir()  # an older release's: no owner file, left alone
    mine = handover.own_pod_handover_dir("ns/job", "pod-0", "dddddddd")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, older.name, mine.name])
    assert ShmHandover(live).take() is not None
    handover.release_pod_handover_dir(mine)
    handover.release_pod_handover_dir(live)
    assert not mine.exists() and not live.exists()
