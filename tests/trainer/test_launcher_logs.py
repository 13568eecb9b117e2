"""Worker logs: exit causes in words, tails cut at a line, rotation that spares live logs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tide.trainer.launcher.logs import exit_cause, rotate, tail, worker_exit

pytestmark = pytest.mark.unit


def test_exit_causes_name_the_signal() -> None:
    assert exit_cause(1) == "exited with 1"
    assert exit_cause(-11) == "was killed by SIGSEGV"
    assert exit_cause(-9) == "was killed by SIGKILL"
    assert exit_cause(-200) == "was killed by signal 200"


def test_a_tail_starts_at_a_line_and_a_missing_log_is_empty(tmp_path: Path) -> None:
    log = tmp_path / "worker-g1-r0.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    got = tail(log, 100)
    assert got.startswith("line ") and got.endswith("line 999\n") and len(got) <= 100
    assert tail(tmp_path / "absent.log") == "" and tail(None) == ""
    assert worker_exit(-11, str(log)).log_tail.endswith("line 999\n")


def test_rotation_keeps_the_newest_and_every_live_log(tmp_path: Path) -> None:
    paths = []
    for i in range(6):
        p = tmp_path / f"worker-g{i}-r0.log"
        p.write_text("x")
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    live = str(paths[0])  # the oldest, but a live worker still writes it
    gone = rotate(tmp_path, 3, {live})
    left = sorted(p.name for p in tmp_path.glob("worker-*.log"))
    assert left == ["worker-g0-r0.log", "worker-g4-r0.log", "worker-g5-r0.log"]
    assert len(gone) == 3
