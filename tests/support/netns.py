"""Two network namespaces joined by a veth pair, and a partition between them.

The reliability catalog's partitions (T06, T07) run one side of a link in each
namespace: traffic between them crosses the veth and nothing else, so a
partition there touches only processes this test started. Nothing is added to
the host's own namespace; the addresses (10.254.0.1/30, 10.254.0.2/30) exist
only inside the two namespaces.

A partition is a blackhole, as a pulled cable or a dead switch: packets vanish,
no RST, no ICMP. ``tc netem loss 100%`` is the usual tool; this machine's kernel
has no netem module, so the same drop comes from a ``pfifo`` queue of length 0
on both veth ends (every packet is dropped at enqueue), and failing that the
links are set down. Healing removes the queue again.

Everything is bounded and undone however the test ends: ``finally`` deletes the
namespaces (which removes the veth and its queues), an ``atexit`` hook does the
same if pytest exits early, and a detached watchdog process deletes them after
``max_lifetime_s`` even if pytest is killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.support.faults import require_root

SERVER_ADDR = "10.254.0.1"
CLIENT_ADDR = "10.254.0.2"


def _ip(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10, check=False)


def _must(*argv: str) -> None:
    done = _ip(*argv)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class NetnsPair:
    """Namespaces ``server`` and ``client`` and the veth between them."""

    server: str
    client: str
    server_dev: str
    client_dev: str
    watchdog: subprocess.Popen[bytes] | None = None
    method: str = ""
    cut_at: list[float] = field(default_factory=list)

    def exec_in(self, side: str) -> list[str]:
        """The command prefix that runs a program in ``side`` ("server" or "client")."""
        return ["ip", "netns", "exec", self.server if side == "server" else self.client]

    def _ends(self) -> list[tuple[str, str]]:
        return [(self.server, self.server_dev), (self.client, self.client_dev)]

    def cut(self) -> float:
        """Blackhole the link both ways; returns the monotonic time it took effect."""
        for ns, dev in self._ends():
            queue = ["tc", "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0"]
            done = _ip("netns", "exec", ns, *queue)
            if done.returncode == 0:
                self.method = "pfifo limit 0"
            else:
                _must("-n", ns, "link", "set", dev, "down")
                self.method = "link down"
        at = time.monotonic()
        self.cut_at.append(at)
        return at

    def heal(self) -> float:
        """Undo :meth:`cut`; returns the monotonic time the link carries packets again."""
        for ns, dev in self._ends():
            if self.method == "link down":
                _must("-n", ns, "link", "set", dev, "up")
            else:
                _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
        return time.monotonic()

    def delete(self) -> None:
        for ns in (self.server, self.client):
            _ip("netns", "del", ns)
        if self.watchdog is not None and self.watchdog.poll() is None:
            # Only the watchdog this pair started, by its own process group.
            os.killpg(self.watchdog.pid, signal.SIGKILL)
            self.watchdog.wait(timeout=10)


@contextlib.contextmanager
def netns_pair(tag: str, max_lifetime_s: float = 120.0) -> Iterator[NetnsPair]:
    """A fresh pair of namespaces, deleted on exit (and by a watchdog after ``max_lifetime_s``).

    ``tag`` (a few letters) and the pid keep names apart from other tests on this
    machine; interface names stay within the kernel's 15 characters."""
    require_root("ip", "tc")
    base = f"t{tag}{os.getpid() % 100000}"
    pair = NetnsPair(f"{base}s", f"{base}c", f"{base}s"[:15], f"{base}c"[:15])
    for ns in (pair.server, pair.client):
        done = _ip("netns", "add", ns)
        if done.returncode != 0:
            pair.delete()
            pytest.skip(f"cannot create a network namespace: {done.stderr.strip()}")
    atexit.register(pair.delete)
    try:
        pair.watchdog = subprocess.Popen(
            [
                "sh",
                "-c",
                f"sleep {max_lifetime_s:.0f}; ip netns del {pair.server};"
                f" ip netns del {pair.client}",
            ],
            start_new_session=True,
        )
        # Created inside the namespaces, never in the host's: nothing to leak there.
        server_end = [pair.server_dev, "netns", pair.server]
        client_end = ["name", pair.client_dev, "netns", pair.client]
        _must("link", "add", *server_end, "type", "veth", "peer", *client_end)
        for ns, dev, addr in (
            (pair.server, pair.server_dev, SERVER_ADDR),
            (pair.client, pair.client_dev, CLIENT_ADDR),
        ):
            _must("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _must("-n", ns, "link", "set", dev, "up")
            _must("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        pair.delete()
        atexit.unregister(pair.delete)
