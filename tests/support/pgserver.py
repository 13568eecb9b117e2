"""A PostgreSQL server of the test's own, to stop hard and start again.

The shared server on 5432 serves every suite (and other checkouts on this
machine): an outage test cannot stop it. This one lives in a temporary
directory, listens on a free loopback port and dies with the test. It runs as
the ``postgres`` user, since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tide.services.testing.ports import free_port


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def _unavailable(why: str) -> None:
    if os.environ.get("TIDE_TEST_STRICT"):
        pytest.fail(f"a private PostgreSQL cannot be run: {why}")
    pytest.skip(f"a private PostgreSQL cannot be run: {why}")


class PrivatePostgres:
    def __init__(self, bin_dir: Path, root: Path, port: int, user: str | None) -> None:
        self.bin_dir = bin_dir
        self.data = root / "data"
        self.root = root
        self.port = port
        self._user = user

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            # Durability is not under test here; fsync off keeps the start fast.
            "-c fsync=off -c full_page_writes=off"
        )
        log = str(self.root / "log")
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", log, "-w", "start")

    def stop_hard(self) -> None:
        """``pg_ctl stop -m immediate``: every backend killed, no checkpoint, as a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A running server on a free port, stopped and removed afterwards."""
    bin_dir = _bin_dir()
    if bin_dir is None or shutil.which("runuser") is None:
        _unavailable("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin)")
    assert bin_dir is not None
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root and there is no postgres user")
        user = "postgres"
    # Not pytest's tmp_path: its parents are root's, mode 0700, closed to postgres.
    root = Path(tempfile.mkdtemp(prefix="tide-pg-"))
    try:
        if user is not None:
            shutil.chown(root, user)
        server = PrivatePostgres(bin_dir, root, free_port(), user)
        server.init()
        server.start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
