"""tide/trainer/gloo_groups.py ``_nodelay``: Nagle's algorithm off on this process's connections to
a store's port, and on those only (the figures: docs/sharded.md)."""

from __future__ import annotations

import socket
import time

import pytest

from tide.trainer import gloo_groups

pytestmark = pytest.mark.unit


def _nodelay_of(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_only_the_connections_to_the_port_lose_nagle() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as store,
        socket.create_server(("127.0.0.1", 0)) as other,
    ):
        port = store.getsockname()[1]
        to_store = socket.create_connection(("127.0.0.1", port))
        to_other = socket.create_connection(("127.0.0.1", other.getsockname()[1]))
        accepted, _ = store.accept()
        with to_store, to_other, accepted:
            assert _nodelay_of(to_store) == 0
            assert gloo_groups._nodelay(port) == 1
            assert _nodelay_of(to_store) == 1
            # The server's side of the same connection and other peers are left alone.
            assert _nodelay_of(accepted) == 0
            assert _nodelay_of(to_other) == 0
            # The socket still works: the duplicate _nodelay closed was its own.
            to_store.sendall(b"x")
            assert accepted.recv(1) == b"x"


def test_a_real_store_answers_at_once_after_it() -> None:
    core = pytest.importorskip("paddle.base.core")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = core.TCPStore("127.0.0.1", port, True, 0, 30)
    store.set("k", b"v")
    assert gloo_groups._nodelay(port) == 1
    started = time.monotonic()
    for _ in range(20):
        assert bytes(store.get("k")) == b"v"
    # 20 gets: about 1 ms with Nagle off, about 1.8 s with it on (a delayed ACK each).
    assert time.monotonic() - started < 0.5


def test_without_proc_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: str) -> list[str]:
        raise FileNotFoundError(path)

    monkeypatch.setattr(gloo_groups.os, "listdir", no_proc)
    assert gloo_groups._nodelay(1) == 0


_DEFAULT_STORE = """
import os, socket, sys, time
from paddle.base import core
from tide.trainer.gloo_groups import fast_default_store
fast_default_store(os.environ["PADDLE_MASTER"])
# init_parallel_env's own call gets the same store, and its requests are not delayed.
store = core.create_or_get_global_tcp_store()
store.set("k", b"v")
started = time.monotonic()
for _ in range(20):
    store.get("k")
print("GETS_S", time.monotonic() - started)
"""


def test_the_default_store_is_made_first_and_answers_at_once() -> None:
    pytest.importorskip("paddle")
    import os
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PADDLE_MASTER": f"127.0.0.1:{port}",
        "PADDLE_TRAINER_ID": "0",
        "PADDLE_TRAINERS_NUM": "1",
        "PADDLE_TRAINER_ENDPOINTS": f"127.0.0.1:{port}",
        "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{port}",
    }
    out = subprocess.run(
        [sys.executable, "-c", _DEFAULT_STORE],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    gets_s = float(out.split("GETS_S")[1])
    # About 1 ms with Nagle off; 1.8 s had the store been another than the one made first.
    assert gets_s < 0.5, out
