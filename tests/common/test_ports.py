"""Ports told to a process before it starts: never the kernel's ephemeral ones, which any
outgoing connection may take between the probe and the process's own bind."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tide.services.testing import ports
from tide.services.testing.ports import free_port
from tide.trainer.launcher.link import RENDEZVOUS_PORTS, _ephemeral_low, find_free_port

pytestmark = pytest.mark.unit


def test_test_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(ports.FIRST_PORT <= p < ports.END_PORT < _ephemeral_low() for p in got)
    assert RENDEZVOUS_PORTS.start >= ports.END_PORT, "the launchers' range overlaps the tests'"


def test_another_process_gets_other_ports_and_a_busy_port_is_skipped() -> None:
    mine = free_port()
    # The next one in turn is taken by somebody else: the allocator passes over it.
    busy = socket.socket()
    nxt = mine + 1 if mine + 1 < ports.END_PORT else ports.FIRST_PORT
    try:
        busy.bind(("127.0.0.1", nxt))
    except OSError:
        pytest.skip(f"port {nxt} is in use here already")
    with busy:
        code = "from tide.services.testing.ports import free_port; print(free_port())"
        run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        other = int(run.stdout)
        assert other not in (mine, nxt)


def test_a_launcher_offers_a_rendezvous_port_below_the_ephemeral_range() -> None:
    assert len(RENDEZVOUS_PORTS) >= 1024
    assert RENDEZVOUS_PORTS.stop <= 30_000, "inside Kubernetes' NodePort range"
    picks = {find_free_port("127.0.0.1") for _ in range(20)}
    assert all(p in RENDEZVOUS_PORTS for p in picks)
    assert len(picks) > 1, "every launcher on a host would offer the same port"
