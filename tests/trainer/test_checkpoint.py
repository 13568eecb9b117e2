"""Checkpoint files: crash at every commit step, and each kind of damage, fall back to a good one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tide.base.errors import ConfigError
from tide.trainer.checkpoint import (
    FAULT_ENV,
    FAULT_POINTS,
    LOCK,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointSettings,
    CheckpointStore,
    PeriodicSchedule,
    step_dir_name,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _files(step: int) -> dict[str, bytes]:
    return {"model.pdparams": bytes([step % 256]) * 1000, "opt.pdopt": b"adam-%d" % step}


def test_round_trip_and_digest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    written = store.write(5, _files(5), {"epoch": 1, "cursor": 40})
    loaded = store.load_latest()
    assert (loaded.step, loaded.digest) == (5, written.digest)
    assert dict(loaded.files) == _files(5)
    assert loaded.meta == {"epoch": 1, "cursor": 40}
    assert written.write_s > 0


def test_keeps_the_newest_k(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        store.write(step, _files(step), {})
    assert store.list_steps() == [3, 4]


def test_at_most_selects_an_older_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=5)
    for step in (2, 4, 6):
        store.write(step, _files(step), {})
    assert store.load_latest(at_most=5).step == 4
    with pytest.raises(CheckpointNotFound):
        store.load_latest(at_most=1)


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.write(3, {"a": b"old"}, {})
    store.write(3, {"a": b"new"}, {})
    assert store.load(3).files == {"a": b"new"}
    assert [p.name for p in tmp_path.iterdir() if p.name != LOCK] == [step_dir_name(3)]


def _damage(directory: Path, kind: str) -> None:
    target = directory / "model.pdparams"
    if kind == "flipped_byte":
        data = bytearray(target.read_bytes())
        data[17] ^= 0x01
        target.write_bytes(bytes(data))
    elif kind == "truncated":
        target.write_bytes(target.read_bytes()[:-1])
    elif kind == "missing":
        target.unlink()
    elif kind == "no_manifest":
        (directory / MANIFEST).unlink()
    elif kind in ("dotdot", "absolute", "symlink"):
        manifest = json.loads((directory / MANIFEST).read_text())
        outside = directory.parent / "outside.bin"
        outside.write_bytes(b"x")
        entry = {"size": 1, "sha256": __import__("hashlib").sha256(b"x").hexdigest()}
        if kind == "dotdot":
            manifest["files"]["../outside.bin"] = entry
        elif kind == "absolute":
            manifest["files"][str(outside)] = entry
        else:
            (directory / "link.bin").symlink_to(outside)
            manifest["files"]["link.bin"] = entry
        (directory / MANIFEST).write_text(json.dumps(manifest))
    else:  # pragma: no cover - the parametrisation lists every kind
        raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "detected_as"),
    [
        ("flipped_byte", "checksum"),
        ("truncated", "size"),
        ("missing", "missing"),
        ("no_manifest", "no_manifest"),
        ("dotdot", "path_escape"),
        ("absolute", "path_escape"),
        ("symlink", "path_escape"),
    ],
)
def test_damage_is_detected_and_load_falls_back(
    tmp_path: Path, kind: str, detected_as: str
) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    store.write(1, _files(1), {"n": 1})
    good = store.write(2, _files(2), {"n": 2})
    store.write(3, _files(3), {"n": 3})
    _damage(tmp_path / "ckpt" / step_dir_name(3), kind)
    with pytest.raises(CheckpointCorrupt) as info:
        store.load(3)
    assert info.value.kind == detected_as
    loaded = store.load_latest()
    assert (loaded.step, loaded.digest, loaded.meta) == (2, good.digest, {"n": 2})
    assert [e.kind for e in loaded.skipped] == [detected_as]
    assert store.latest_good_step() == 2


_WRITER = """
import sys
from tide.trainer.checkpoint import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=2)
step = int(sys.argv[2])
store.write(step, {"model.pdparams": bytes([step]) * 1000, "opt.pdopt": b"adam-%d" % step}, {"n": step})
"""


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_sigkill_at_every_write_step_leaves_a_loadable_checkpoint(
    tmp_path: Path, point: str
) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.write(1, _files(1), {"n": 1})
    previous = store.write(2, _files(2), {"n": 2})
    env = {**os.environ, FAULT_ENV: point, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path), "3"], env=env, timeout=60, check=False
    )
    assert proc.returncode == -9, f"fault point {point} was not reached"
    loaded = store.load_latest()
    assert loaded.step in (2, 3)
    if loaded.step == 2:
        assert loaded.digest == previous.digest
    assert dict(loaded.files) == _files(loaded.step)
    store.cleanup_tmp()
    assert all(".tmp-" not in p.name for p in tmp_path.iterdir())


_LOCK_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_cleanup_removes_crash_leftovers_but_never_a_live_writers_directory(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path)
    store.write(1, _files(1), {"n": 1})
    filling = tmp_path / f"{step_dir_name(2)}.tmp-0a1b2c3d"
    filling.mkdir()
    (filling / "model.pdparams.part").write_bytes(b"half")
    # Another process is writing (it holds the store's writer lock, as CheckpointStore.write
    # does for the whole write): its temporary directory is not a leftover.
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(tmp_path / LOCK)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        assert store.cleanup_tmp() == 0
        assert filling.is_dir()
    finally:
        holder.kill()  # the writer crashes: SIGKILL releases its lock
        holder.wait(timeout=10)
    assert store.cleanup_tmp() == 1
    assert not filling.exists() and store.list_steps() == [1]
    assert store.load_latest().step == 1


def test_periodic_schedule_by_steps_and_by_time() -> None:
    sched = PeriodicSchedule(CheckpointSettings(every_steps=5, every_s=10.0), now_s=0.0)
    assert not sched.due(3, now_s=1.0)
    assert sched.due(5, now_s=2.0)
    sched.mark(5, now_s=2.0)
    assert not sched.due(5, now_s=2.5)
    assert not sched.due(7, now_s=11.0)
    assert sched.due(8, now_s=12.5)


def test_settings_validate() -> None:
    with pytest.raises(ConfigError, match="keep"):
        CheckpointSettings(keep=0)
    with pytest.raises(ConfigError, match="every_s"):
        CheckpointSettings(every_s=-1.0)
