"""Runs Tide's services as child processes on this machine, and stops them in order.

Each child gets its own session, so a Ctrl-C in the terminal reaches only the
supervisor, which then stops the children in reverse start order (agents
before the scaler, the scaler before the coordinator) with SIGTERM and a
grace period, then SIGKILL. A service is ready when it prints the common
runtime's ``LISTENING grpc=PORT metrics=PORT`` line; its stdout and stderr go
to ``<log_dir>/<name>.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from tide.base.errors import ConfigError, FailedPrecondition, Unavailable
from tide.base.lifecycle import TransitionTable
from tide.base.listening import parse_listening
from tide.services.common.clock import Clock, SystemClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # Wait for the LISTENING line before starting the next child.
    wait_listening: bool = True
    ready_timeout_s: float = 60.0
    # SIGTERM → SIGKILL grace when stopping, seconds.
    stop_grace_s: float = 15.0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise ConfigError(f"name: lowercase letters, digits and '-', got {self.name!r}")
        if not self.argv:
            raise ConfigError(f"argv: child {self.name} needs a command")
        if not self.ready_timeout_s > 0:
            raise ConfigError(f"ready_timeout_s: must be > 0, got {self.ready_timeout_s}")
        if not self.stop_grace_s >= 0:
            raise ConfigError(f"stop_grace_s: must be >= 0, got {self.stop_grace_s}")


class ChildState(enum.Enum):
    """STARTING → READY → STOPPING → EXITED; any state → EXITED when the process dies."""

    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"


CHILD_LIFECYCLE: Final = TransitionTable[ChildState](
    "child",
    {
        # It printed LISTENING (or needs not), or it died during start-up.
        ChildState.STARTING: {ChildState.READY, ChildState.STOPPING, ChildState.EXITED},
        # We asked it to stop, or it died on its own.
        ChildState.READY: {ChildState.STOPPING, ChildState.EXITED},
        ChildState.STOPPING: {ChildState.EXITED},
        ChildState.EXITED: (),
    },
)


@dataclass
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process
    log_path: Path
    state: ChildState = ChildState.STARTING
    port: int | None = None
    metrics_port: int | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reader: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def move(self, new: ChildState) -> None:
        if new is self.state:
            return
        CHILD_LIFECYCLE.check(self.state, new, what=self.name)
        logger.debug("child %s: %s -> %s", self.name, self.state.value, new.value)
        self.state = new

    @property
    def target(self) -> str:
        if self.port is None:
            raise FailedPrecondition(f"child {self.name} has no gRPC port")
        return f"127.0.0.1:{self.port}"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Supervisor:
    def __init__(self, log_dir: Path, clock: Clock | None = None) -> None:
        self.log_dir = log_dir
        self.clock = clock or SystemClock()
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, spec: ChildSpec) -> Child:
        """Start ``spec``; with ``wait_listening``, return once it listens.

        Raises Unavailable, with the end of its log, when it exits or stays
        silent past its ready timeout (it is stopped then)."""
        if any(c.name == spec.name for c in self.children):
            raise FailedPrecondition(f"child {spec.name} started twice")
        log_path = self.log_dir / f"{spec.name}.log"
        # Opening a local log file does not block long enough to matter; the reader owns it.
        log = open(log_path, "ab")  # noqa: SIM115, ASYNC230
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
                start_new_session=True,
            )
        except OSError as exc:
            log.close()
            raise Unavailable(f"cannot start {spec.name} ({spec.argv[0]}): {exc}") from None
        child = Child(spec, proc, log_path)
        self.children.append(child)
        child.reader = asyncio.create_task(self._read(child, log), name=f"read-{spec.name}")
        logger.info("started %s (pid %d), log %s", spec.name, proc.pid, log_path)
        if not spec.wait_listening:
            child.move(ChildState.READY)
            return child
        exited = asyncio.create_task(proc.wait())
        ready = asyncio.create_task(child.ready.wait())
        try:
            await asyncio.wait(
                {exited, ready}, timeout=spec.ready_timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            for t in (exited, ready):
                t.cancel()
        if child.ready.is_set():
            child.move(ChildState.READY)
            return child
        why = (
            f"exited with code {proc.returncode}"
            if proc.returncode is not None
            else f"did not listen within {spec.ready_timeout_s:g} s"
        )
        await self.stop(child)
        tail = log_tail(log_path)
        raise Unavailable(f"{spec.name} {why}; end of {log_path}:\n{tail}")

    async def _read(self, child: Child, f: IO[bytes]) -> None:
        """Copy stdout to the log, watching for the LISTENING line."""
        assert child.proc.stdout is not None
        try:
            while True:
                line = await child.proc.stdout.readline()
                if not line:
                    break
                f.write(line)
                f.flush()
                if not child.ready.is_set():
                    ports = parse_listening(line)
                    if ports is not None:
                        child.port = ports.grpc_port
                        child.metrics_port = ports.metrics_port
                        child.ready.set()
        finally:
            f.close()

    async def wait_any_exit(self) -> Child:
        """The first child that exits (on its own or stopped)."""
        waits = {asyncio.create_task(c.proc.wait()): c for c in self.children}
        if not waits:
            raise FailedPrecondition("no children to wait for")
        try:
            done, _ = await asyncio.wait(waits, return_when="FIRST_COMPLETED")
        finally:
            for t in waits:
                t.cancel()
        child = waits[next(iter(done))]
        child.move(ChildState.EXITED)
        return child

    async def stop(self, child: Child) -> int:
        """SIGTERM, then SIGKILL after the child's grace; returns its exit code."""
        if child.proc.returncode is None:
            child.move(ChildState.STOPPING)
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.proc.wait(), child.spec.stop_grace_s)
            except TimeoutError:
                logger.warning(
                    "%s did not stop within %.1f s; killing it",
                    child.name,
                    child.spec.stop_grace_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                await child.proc.wait()
        if child.reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await child.reader
        child.move(ChildState.EXITED)
        code = child.proc.returncode
        assert code is not None
        logger.info("%s stopped (exit code %d)", child.name, code)
        return code

    async def stop_all(self) -> dict[str, int]:
        """Stop every child, the last started first; returns exit codes by name."""
        codes: dict[str, int] = {}
        for child in reversed(self.children):
            codes[child.name] = await self.stop(child)
        return codes
