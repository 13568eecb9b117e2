"""A worker's end is judged only after what it said was read: a worker that reported its
restore and then died is a crash after its start, never "did not start", even when its
exit is heard before the launcher's loop has accepted its connection
(tide/trainer/launcher/supervisor.py ``_watch``, tide/trainer/launcher/control.py ``drained``)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.trainer.supervisor_rig import Worker, started
from tide.trainer.launcher import supervisor as sup
from tide.trainer.messages import Done, Hello, Progress, Ready, ToLauncher, encode

pytestmark = pytest.mark.component


async def test_a_worker_that_said_ready_and_died_unaccepted_is_heard_ready_first(
    tmp_path: Path,
) -> None:
    heard: list[object] = []
    workers, spawner = await started(tmp_path, heard)
    (worker,) = spawner.spawned
    ready = Ready(restored_step=7, group_init_s=0.01, restore_s=0.02)
    # Connect, say Hello and Ready, be gone, and have the exit reported, with no turn of the
    # event loop in between: the loop wakes the exit's watcher before it looks at the
    # listening socket, the order in which a busy launcher met a worker that segfaulted
    # right after its restore.
    await _said_then_exited(workers, worker, [ready], -signal.SIGSEGV, heard)
    assert heard == [ready, -signal.SIGSEGV]
    await workers.close()


async def _said_then_exited(
    workers: sup.WorkerSupervisor,
    worker: Worker,
    said: list[ToLauncher],
    code: int,
    heard: list[object],
) -> None:
    """``worker`` connects, says Hello and ``said``, closes and exits ``code``, all in one
    turn of the loop; returns once the supervisor has reported the exit."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(workers.control.path)
        conn.sendall(encode(Hello(pid=worker.pid)) + b"".join(encode(m) for m in said))
    worker.exit(code)
    await eventually(lambda: code in heard, 10, what="the exit")


async def test_a_worker_that_never_connected_is_reported_without_waiting_for_its_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No drain bound to wait out: a worker with no connection has nothing unread.
    monkeypatch.setattr(sup, "CHANNEL_DRAIN_S", 3600.0)
    heard: list[object] = []
    workers, spawner = await started(tmp_path, heard)
    (worker,) = spawner.spawned
    worker.exit(1)
    await eventually(lambda: heard, 10, what="the exit")
    assert heard == [1]
    await workers.close()


async def test_a_dead_workers_lines_still_being_handled_are_waited_for_past_the_idle_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound is on silence, not on the whole drain: a job's last lines (its final step,
    # then Done) whose handling outlasts it are still the worker's word. Counted whole, it
    # judged a worker that finished, exit 0 with its Done unread, a lost member.
    heard: list[object] = []
    workers, worker = await _drain_bound_of_0_2_s(tmp_path, monkeypatch, heard, handling_s=0.3)
    last, done = Progress(step=40, epoch=1, cursor=0), Done(step=40)
    await _said_then_exited(workers, worker, [last, done], 0, heard)
    assert heard == [last, done, 0]
    await workers.close()


async def test_a_connection_a_child_holds_open_ends_the_drain_after_the_idle_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DataLoader process forked by the worker keeps the worker's end open: no end of
    # file comes, and the exit is judged once nothing has been read for the bound.
    heard: list[object] = []
    workers, worker = await _drain_bound_of_0_2_s(tmp_path, monkeypatch, heard)
    done = Done(step=40)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(workers.control.path)
        conn.sendall(encode(Hello(pid=worker.pid)) + encode(done))
        await eventually(lambda: done in heard, 10, what="the Done")
        worker.exit(0)
        # Still open here: the exit is reported all the same.
        await eventually(lambda: 0 in heard, 5, what="the exit, the end still open")
    assert heard == [done, 0]
    await workers.close()


async def _drain_bound_of_0_2_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heard: list[object], handling_s: float = 0.0
) -> tuple[sup.WorkerSupervisor, Worker]:
    """A supervisor whose drain bound is 0.2 s, and its running worker."""
    monkeypatch.setattr(sup, "CHANNEL_DRAIN_S", 0.2)
    workers, spawner = await started(tmp_path, heard, handling_s=handling_s)
    (worker,) = spawner.spawned
    return workers, worker
