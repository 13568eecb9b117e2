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
from tests.trainer.supervisor_rig import started
from tide.trainer.launcher import supervisor as sup
from tide.trainer.messages import Hello, Ready, encode

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
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(workers.control.path)
        conn.sendall(encode(Hello(pid=worker.pid)) + encode(ready))
    worker.exit(-signal.SIGSEGV)
    await eventually(lambda: -signal.SIGSEGV in heard, 10, what="the exit")
    assert heard == [ready, -signal.SIGSEGV]
    await workers.close()


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
