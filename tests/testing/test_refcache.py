"""The session's shared reference runs (tide/services/testing/refcache.py), with a stand-in
example script: one run per distinct (script, arguments, world size), across processes,
read-only, and a failed run never kept."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from tide.services.testing.refcache import ReferenceRuns

pytestmark = pytest.mark.integration

# Counts its runs (one line a rank) beside the cache, writes a result, exits 3 on --fail.
SCRIPT = """
import argparse, os, pathlib, time
p = argparse.ArgumentParser()
p.add_argument("--ckpt-dir"); p.add_argument("--log-dir"); p.add_argument("--fail", action="store_true")
p.add_argument("--counter"); p.add_argument("--hold-s", type=float, default=0.0)
a = p.parse_args()
with open(a.counter, "a") as f:
    f.write(os.environ["PADDLE_TRAINER_ID"] + "\\n")
time.sleep(a.hold_s)
if a.fail:
    raise SystemExit(3)
log = pathlib.Path(a.log_dir); log.mkdir(parents=True, exist_ok=True)
(log / ("rank" + os.environ["PADDLE_TRAINER_ID"])).write_text(os.environ["PADDLE_TRAINERS_NUM"])
"""


def _script(tmp_path: Path) -> tuple[str, Path]:
    script = tmp_path / "example.py"
    script.write_text(SCRIPT)
    return str(script), tmp_path / "runs.txt"


def _runs(counter: Path) -> int:
    return len(counter.read_text().split()) if counter.exists() else 0


def test_each_distinct_run_runs_once_and_is_read_only(tmp_path: Path) -> None:
    example, counter = _script(tmp_path)
    runs = ReferenceRuns(tmp_path / "cache")
    args = ["--counter", str(counter)]
    first = runs(args, world_size=2, example=example)
    again = runs(args, world_size=2, example=example)
    assert first == again and _runs(counter) == 2  # two ranks, one run
    assert (first / "rank1").read_text() == "2"
    # Read-only to the tests (root, as in CI containers, could still write: check the bits).
    files = [p for p in first.parent.rglob("*") if p.is_file()]
    assert files and not any(p.stat().st_mode & 0o222 for p in files)
    # Another world size or other arguments are other runs.
    assert runs(args, world_size=1, example=example) != first
    assert runs([*args, "--hold-s", "0"], world_size=2, example=example) != first
    assert _runs(counter) == 5  # 2 + 1 + 2 ranks


def test_a_failed_run_is_not_kept(tmp_path: Path) -> None:
    example, counter = _script(tmp_path)
    runs = ReferenceRuns(tmp_path / "cache")
    args = ["--counter", str(counter), "--fail"]
    for tries in (1, 2):
        with pytest.raises(RuntimeError, match="reference run failed"):
            runs(args, world_size=1, example=example)
        assert _runs(counter) == tries


def _call(root: str, example: str, args: list[str]) -> None:
    ReferenceRuns(Path(root))(args, world_size=1, example=example)


def test_processes_that_need_the_same_run_share_one(tmp_path: Path) -> None:
    example, counter = _script(tmp_path)
    # The first holds the lock for a while, so the others wait on it rather than find it done.
    args = ["--counter", str(counter), "--hold-s", "1"]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_call, args=(str(tmp_path / "cache"), example, args)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert _runs(counter) == 1


def test_unshared_every_call_runs_its_own(tmp_path: Path) -> None:
    example, counter = _script(tmp_path)
    runs = ReferenceRuns(tmp_path / "cache", shared=False)
    args = ["--counter", str(counter)]
    assert runs(args, world_size=1, example=example) != runs(args, world_size=1, example=example)
    assert _runs(counter) == 2
