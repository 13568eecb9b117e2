"""The trainer launcher: one per pod, stays up while Paddle worker processes come and go.

``python -m trainer.launch --coordinator HOST:PORT --job NS/NAME [--pod NAME] [--pod-index I]
[--host H] [--state-dir D] -- python train.py ARGS``

It registers with the coordinator (STANDBY), holds the Directives stream (reconnecting with
jittered backoff and re-registering with the same launcher_id), heartbeats, and on each
directive drives its worker (docs/resize-protocol.md):

- RENDEZVOUS: stop the current worker (ask, then SIGKILL after a short grace: it may be stuck in
  a collective with a dead peer) and fork a new one from the warm zygote with the PADDLE_*
  environment of the generation; ack once it has its process group and has restored.
- CHECKPOINT / HOLD / RESUME: relayed to the worker over the local channel; acked when it
  holds (with rank 0's checkpoint digest) or at once for RESUME.
- DRAIN: the worker exits cleanly, the launcher acks and exits 0. STOP: kill and exit.

A worker that dies unasked is reported at once with a heartbeat in phase FAILED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import json
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import time
import uuid
from asyncio import FIRST_COMPLETED
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

from tidebase.client import open_channel
from tidebase.errors import ConfigError, FailedPrecondition
from tidebase.grpc_options import DEFAULT_TIMEOUT_S
from trainer.channel import CONTROL_SOCKET_ENV, Message
from trainer.session import (
    GENERATION_ENV,
    PREWARM_ENV,
    RESTART_STARTED_AT_ENV,
    RESTORE_STEP_ENV,
)
from trainer.spawner import Spawner, SubprocessSpawner, WorkerHandle, ZygoteSpawner

logger = logging.getLogger(__name__)

# How long a dead worker's channel may take to deliver its last lines, seconds.
CHANNEL_DRAIN_S = 0.5


@dataclass(frozen=True)
class LauncherSettings:
    coordinator: str
    job_id: str
    command: tuple[str, ...]
    pod_name: str = ""
    pod_index: int = 0
    host: str = "127.0.0.1"
    state_dir: str = ""
    launcher_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Fork workers from a process that has imported Paddle (False: fresh processes).
    use_zygote: bool = True
    # Keep a worker forked ahead of time, waiting for the next RENDEZVOUS.
    prewarm: bool = True
    # Modules the zygote imports; None for its default (numpy, paddle, paddle.distributed).
    zygote_preload: str | None = None
    # How long a worker asked to exit gets before SIGKILL, seconds.
    exit_grace_s: float = 1.0
    # How long a new worker may take to have its group and restore, seconds.
    start_timeout_s: float = 120.0
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    rpc_timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if ":" not in self.coordinator:
            raise ConfigError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        if self.job_id.count("/") != 1 or not all(self.job_id.split("/")):
            raise ConfigError(f"job must be NAMESPACE/NAME, got {self.job_id!r}")
        if not self.command:
            raise ConfigError("command must be given after --, got nothing")
        if self.pod_index < 0:
            raise ConfigError(f"pod_index must be >= 0, got {self.pod_index}")
        for name in ("exit_grace_s", "start_timeout_s", "backoff_initial_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ConfigError(
                f"backoff_max_s must be >= backoff_initial_s, got {self.backoff_max_s}"
            )


class State(enum.Enum):
    STANDBY = "standby"  # no worker; waiting for a generation
    STARTING = "starting"  # a worker is starting (process, group init, restore)
    RUNNING = "running"
    HOLDING = "holding"  # held at a step boundary after CHECKPOINT/HOLD
    FAILED = "failed"  # the worker died unasked; waiting for the next RENDEZVOUS
    DRAINING = "draining"
    DONE = "done"  # the launcher is exiting


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.STANDBY: frozenset({State.STARTING, State.DRAINING, State.DONE}),
    State.STARTING: frozenset(
        {State.STARTING, State.RUNNING, State.FAILED, State.DRAINING, State.DONE}
    ),
    State.RUNNING: frozenset(
        {State.STARTING, State.HOLDING, State.FAILED, State.DRAINING, State.DONE}
    ),
    State.HOLDING: frozenset(
        {State.STARTING, State.RUNNING, State.FAILED, State.DRAINING, State.DONE}
    ),
    State.FAILED: frozenset({State.STARTING, State.DRAINING, State.DONE}),
    State.DRAINING: frozenset({State.DONE}),
    State.DONE: frozenset(),
}

_PHASE = {
    State.STANDBY: pb.WORKER_PHASE_IDLE,
    State.STARTING: pb.WORKER_PHASE_STARTING,
    State.RUNNING: pb.WORKER_PHASE_RUNNING,
    State.HOLDING: pb.WORKER_PHASE_HOLDING,
    State.FAILED: pb.WORKER_PHASE_FAILED,
    State.DRAINING: pb.WORKER_PHASE_HOLDING,
    State.DONE: pb.WORKER_PHASE_IDLE,
}


def find_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ts(wall_s: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(wall_s * 1e9))
    return ts


@dataclass
class _Progress:
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_per_s: float = 0.0
    first_step_at: float = 0.0
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0


class Launcher:
    def __init__(self, settings: LauncherSettings, spawner: Spawner | None = None) -> None:
        self.s = settings
        self.spawner: Spawner = spawner or (
            ZygoteSpawner(settings.zygote_preload) if settings.use_zygote else SubprocessSpawner()
        )
        self.state = State.STANDBY
        self.generation = 0
        self.member_id = ""
        self.heartbeat_interval_s = 1.0
        self.heartbeat_timeout_s = 10.0
        self.exit_code = 0
        self.progress = _Progress()
        # The newest checkpoint a worker of this launcher wrote and verified (rank 0 only):
        # heartbeats report it so that the coordinator names it after a loss.
        self.last_checkpoint_step = 0
        self.last_checkpoint_digest = ""
        self._state_dir = Path(settings.state_dir or tempfile.mkdtemp(prefix="tide-launcher-"))
        self._sock_dir = tempfile.mkdtemp(prefix="tide-ctl-")
        self._sock_path = os.path.join(self._sock_dir, "ctl.sock")
        self._channel: grpc.aio.Channel | None = None
        # Channels replaced after the coordinator became unreachable, closing.
        self._old_channels: list[grpc.aio.Channel] = []
        self._stub: pb_grpc.CoordinatorAsyncStub | None = None
        self._worker: WorkerHandle | None = None
        self._conns: dict[int, asyncio.StreamWriter] = {}
        # Set when a worker's channel is closed and every line it sent has been handled.
        self._conn_closed: dict[int, asyncio.Event] = {}
        self._standby: WorkerHandle | None = None
        self._standby_seq = 0
        self._standby_backoff_s = settings.backoff_initial_s
        self._worker_expected_exit = False
        self._worker_done = False
        self._to_worker: list[Message] = []
        self._ready: asyncio.Future[Message] | None = None
        self._handled: dict[str, pb.AckRequest] = {}
        self._pending_acks: dict[str, pb.Directive] = {}
        self._directives: asyncio.Queue[pb.Directive] = asyncio.Queue()
        self._rendezvous_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._wake_heartbeat = asyncio.Event()
        self._reregister = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: asyncio.AbstractServer | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise FailedPrecondition(f"launcher cannot go from {self.state.name} to {new.name}")
        if new is not self.state:
            logger.info(
                "launcher %s (job %s, member %s): %s -> %s",
                self.s.pod_name,
                self.s.job_id,
                self.member_id,
                self.state.name,
                new.name,
            )
        self.state = new
        self._wake_heartbeat.set()

    async def run(self) -> int:
        self._state_dir.mkdir(parents=True, exist_ok=True)
        self._server = await asyncio.start_unix_server(self._on_worker_conn, path=self._sock_path)
        # Register only once warm: the coordinator starts a barrier as soon as the newcomers
        # are STANDBY, and a cold newcomer would put its Paddle import inside the pause.
        warmup_s = await self.spawner.wait_ready()
        logger.info("launcher %s warm after %.2fs", self.s.pod_name, warmup_s)
        await self._ensure_standby()
        self._channel = open_channel(self.s.coordinator)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._tasks = [
            asyncio.create_task(self._stream_loop(), name="directives"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._directive_loop(), name="handle"),
        ]
        try:
            await self._stop.wait()
        finally:
            await self._shutdown()
        return self.exit_code

    async def _shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._rendezvous_task is not None:
            self._rendezvous_task.cancel()
        for t in [*self._tasks, *([self._rendezvous_task] if self._rendezvous_task else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._worker is not None and self._worker.returncode is None:
            await self._stop_worker()
        if self._standby is not None:
            self._standby.kill()
        await self.spawner.close()
        if self._server is not None:
            self._server.close()
        if self._channel is not None:
            await self._channel.close()
        for old in self._old_channels:
            await old.close()
        with contextlib.suppress(OSError):
            os.unlink(self._sock_path)
            os.rmdir(self._sock_dir)

    def stop(self, code: int = 0) -> None:
        self.exit_code = code
        self._stop.set()

    # -- coordinator side -----------------------------------------------------------------

    async def _register(self) -> None:
        assert self._stub is not None
        resp = await self._stub.Register(
            pb.RegisterRequest(
                job_id=self.s.job_id,
                pod_name=self.s.pod_name,
                pod_index=self.s.pod_index,
                host=self.s.host,
                launcher_id=self.s.launcher_id,
                last_generation=self.generation,
                free_port=find_free_port(self.s.host),
            ),
            timeout=self.s.rpc_timeout_s,
        )
        self.member_id = resp.member_id
        if resp.heartbeat_interval_s > 0:
            self.heartbeat_interval_s = resp.heartbeat_interval_s
        if resp.heartbeat_timeout_s > 0:
            self.heartbeat_timeout_s = resp.heartbeat_timeout_s
        logger.info(
            "launcher %s registered with job %s as member %s (%s, job generation %d)",
            self.s.pod_name,
            self.s.job_id,
            self.member_id,
            pb.MemberState.Name(resp.state),
            resp.generation,
        )

    async def _stream_loop(self) -> None:
        assert self._stub is not None
        backoff = self.s.backoff_initial_s
        while not self._stop.is_set():
            if self.state in (State.DRAINING, State.DONE):
                # Leaving (drained, or the job finished): the coordinator ended this member's
                # stream on purpose, and registering again would add a member that never runs.
                return
            try:
                await self._register()
                self._reregister.clear()
                call = self._stub.Directives(pb.DirectivesRequest(member_id=self.member_id))
                reader = asyncio.create_task(self._read_directives(call))
                asked = asyncio.create_task(self._reregister.wait())
                try:
                    done, _ = await asyncio.wait({reader, asked}, return_when=FIRST_COMPLETED)
                finally:
                    call.cancel()
                    for t in (reader, asked):
                        t.cancel()
                        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                            await t
                if reader in done:
                    reader.result()
                    logger.warning(
                        "directive stream of member %s ended; reconnecting", self.member_id
                    )
                else:
                    logger.warning(
                        "member %s unknown to the coordinator; registering again", self.member_id
                    )
                    backoff = self.s.backoff_initial_s
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                logger.warning(
                    "directive stream of member %s broke (%s: %s); retry in %.2fs",
                    self.member_id,
                    exc.code().name,
                    exc.details(),
                    backoff,
                )
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._renew_channel()
            # Full jitter: launchers that lost one coordinator do not reconnect in step.
            await asyncio.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, self.s.backoff_max_s)

    def _renew_channel(self) -> None:
        """A new channel to the coordinator. gRPC's own reconnect backoff on a channel whose
        server went away grows to two minutes (measured here: a coordinator back after 6 s
        was reached 2.4 s later); a fresh channel connects on the launcher's own, capped,
        backoff. Calls still in flight on the old one get until their deadline."""
        old = self._channel
        self._channel = open_channel(self.s.coordinator)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        if old is not None:
            self._old_channels.append(old)
            self._tasks.append(asyncio.create_task(self._retire(old)))

    async def _retire(self, channel: grpc.aio.Channel) -> None:
        await channel.close(grace=self.s.rpc_timeout_s)
        with contextlib.suppress(ValueError):
            self._old_channels.remove(channel)

    async def _read_directives(self, call: Any) -> None:
        async for directive in call:
            await self._directives.put(directive)

    async def _heartbeat_loop(self) -> None:
        while True:
            # Cleared before the beat, not after: a wake-up asked for while the beat is in
            # flight (a checkpoint just written) must cause the next one at once.
            self._wake_heartbeat.clear()
            try:
                await self._heartbeat()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                logger.warning("heartbeat of member %s failed: %s", self.member_id, exc.code().name)
                # Unknown (the coordinator lost it) or gone (declared dead while we were
                # slow): the member must register again, which also reopens its stream.
                leaving = self.state in (State.DRAINING, State.DONE)
                if not leaving and exc.code() in (
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    self._reregister.set()
            except Exception:
                # A heartbeat loop must never die of one bad beat.
                logger.exception("heartbeat of member %s failed", self.member_id)
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # races with the event, and the loop would then never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_interval_s):
                    await self._wake_heartbeat.wait()

    async def _heartbeat(self) -> None:
        if not self.member_id or self._stub is None:
            return
        req = self._heartbeat_request()
        resp = await self._stub.Heartbeat(req, timeout=self.s.rpc_timeout_s)
        if resp.generation > self.generation and self.state is not State.STANDBY:
            logger.info(
                "member %s is in generation %d, the job in %d: waiting for RENDEZVOUS",
                self.member_id,
                self.generation,
                resp.generation,
            )

    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        p = self.progress
        req = pb.HeartbeatRequest(
            member_id=self.member_id,
            generation=self.generation,
            phase=_PHASE[self.state],
            step=p.step,
            samples_consumed=p.cursor,
            epoch=p.epoch,
            samples_per_s=p.samples_per_s,
            startup=pb.PauseBreakdown(
                worker_restart_s=p.worker_restart_s,
                group_init_s=p.group_init_s,
                restore_s=p.restore_s,
            ),
            free_port=find_free_port(self.s.host),
            last_checkpoint_step=self.last_checkpoint_step,
            last_checkpoint_digest=self.last_checkpoint_digest,
        )
        if p.first_step_at:
            req.first_step_at.CopyFrom(_ts(p.first_step_at))
        return req

    async def _send_heartbeat(self, req: pb.HeartbeatRequest) -> None:
        """One heartbeat built earlier (the last word of a generation being left)."""
        if self._stub is None:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Heartbeat(req, timeout=self.s.rpc_timeout_s)

    async def _final_heartbeat(self) -> None:
        """Tell the coordinator the worker finished (phase IDLE in the current generation).
        Retried for up to a sync timeout: if it never arrives, the member's silence reads
        as a loss and the job re-forms to train nothing."""
        deadline = time.monotonic() + self.heartbeat_timeout_s
        delay = self.s.backoff_initial_s
        while True:
            try:
                await self._heartbeat()
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    return  # the coordinator no longer counts this member: nothing to tell
                if time.monotonic() + delay > deadline:
                    logger.warning(
                        "member %s (job %s): could not report completion: %s",
                        self.member_id,
                        self.s.job_id,
                        exc.code().name,
                    )
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.s.backoff_max_s)

    async def _ack(self, req: pb.AckRequest) -> None:
        assert self._stub is not None
        self._handled[req.directive_id] = req
        try:
            await self._stub.Ack(req, timeout=self.s.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "ack of directive %s by member %s refused: %s %s",
                req.directive_id,
                self.member_id,
                exc.code().name,
                exc.details(),
            )

    def _ack_request(self, d: pb.Directive, ok: bool = True, message: str = "") -> pb.AckRequest:
        return pb.AckRequest(
            member_id=self.member_id,
            directive_id=d.directive_id,
            generation=d.generation,
            ok=ok,
            message=message,
        )

    # -- directives -----------------------------------------------------------------------

    async def _directive_loop(self) -> None:
        while True:
            d = await self._directives.get()
            try:
                await self._on_directive(d)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("member %s failed directive %s", self.member_id, d.directive_id)
                await self._ack(self._ack_request(d, ok=False, message=str(exc)))

    async def _on_directive(self, d: pb.Directive) -> None:
        kind = pb.Directive.Kind.Name(d.kind)
        if d.directive_id in self._handled:
            logger.info("member %s: directive %s again, re-acking", self.member_id, d.directive_id)
            await self._ack(self._handled[d.directive_id])
            return
        if d.directive_id in self._pending_acks:
            return
        logger.info(
            "member %s (job %s) got %s %s for generation %d",
            self.member_id,
            self.s.job_id,
            kind,
            d.directive_id,
            d.generation,
        )
        if d.kind == pb.Directive.KIND_RENDEZVOUS:
            await self._cancel_rendezvous()
            self._rendezvous_task = asyncio.create_task(self._rendezvous(d))
        elif d.kind == pb.Directive.KIND_CHECKPOINT:
            self._pending_acks[d.directive_id] = d
            self._send_worker(
                {"type": "checkpoint", "directive_id": d.directive_id, "step": d.checkpoint_step}
            )
            self._fail_pending_if_no_worker()
        elif d.kind == pb.Directive.KIND_HOLD:
            self._pending_acks[d.directive_id] = d
            self._send_worker({"type": "hold", "directive_id": d.directive_id})
            self._fail_pending_if_no_worker()
        elif d.kind == pb.Directive.KIND_RESUME:
            self._send_worker({"type": "resume", "directive_id": d.directive_id})
            if self.state is State.HOLDING:
                self._set_state(State.RUNNING)
            await self._ack(self._ack_request(d))
        elif d.kind == pb.Directive.KIND_DRAIN:
            await self._cancel_rendezvous()
            self._set_state(State.DRAINING)
            # The worker is holding after the checkpoint, so it has nothing left to lose: ack
            # first, the others' rendezvous need not wait for this process to exit.
            if self._worker is not None:
                self._worker_expected_exit = True
                self._send_worker({"type": "exit"})
            await self._ack(self._ack_request(d))
            await self._stop_worker()
            self._set_state(State.DONE)
            self.stop(0)
        elif d.kind == pb.Directive.KIND_STOP:
            await self._cancel_rendezvous()
            self._worker_expected_exit = True
            if self._worker is not None:
                self._worker.kill()
            await self._ack(self._ack_request(d))
            self._set_state(State.DONE)
            self.stop(0)
        else:
            await self._ack(self._ack_request(d, ok=False, message=f"unknown kind {kind}"))

    def _fail_pending_if_no_worker(self) -> None:
        if self._worker is None or self._worker.returncode is not None:
            for did, d in list(self._pending_acks.items()):
                self._pending_acks.pop(did)
                task = asyncio.create_task(
                    self._ack(self._ack_request(d, False, "no running worker"))
                )
                self._tasks.append(task)

    async def _cancel_rendezvous(self) -> None:
        task, self._rendezvous_task = self._rendezvous_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[CONTROL_SOCKET_ENV] = self._sock_path
        return env

    async def _ensure_standby(self) -> None:
        """Fork the next generation's worker ahead of time: it imports, builds its model and
        waits in init_process_group for a RENDEZVOUS, so a restart costs no start-up."""
        if not self.s.prewarm or self.state in (State.DRAINING, State.DONE):
            return
        if self._standby is not None and self._standby.returncode is None:
            return
        self._standby_seq += 1
        env = self._base_env()
        env[PREWARM_ENV] = "1"
        log_path = str(self._state_dir / f"worker-standby-{self._standby_seq}.log")
        standby = await self.spawner.spawn(self.s.command, env, os.getcwd(), log_path)
        self._standby = standby
        self._tasks.append(asyncio.create_task(self._watch_standby(standby)))
        logger.info("member %s prewarmed worker pid %d", self.member_id, standby.pid)

    async def _watch_standby(self, standby: WorkerHandle) -> None:
        """A prewarmed worker that dies before its rendezvous (its zygote was killed, or the
        script failed while building) is replaced, with backoff: the next RENDEZVOUS should
        find one ready, and the spawn restarts a dead zygote."""
        code = await standby.wait()
        if self._standby is not standby or self._stop.is_set():
            return
        self._standby = None
        delay = self._standby_backoff_s
        self._standby_backoff_s = min(delay * 2, self.s.backoff_max_s)
        logger.warning(
            "member %s (job %s): prewarmed worker pid %d exited with %d; another in %.2fs",
            self.member_id,
            self.s.job_id,
            standby.pid,
            code,
            delay,
        )
        await asyncio.sleep(delay)
        try:
            await self._ensure_standby()
        except Exception:
            # The next RENDEZVOUS spawns a worker itself; a standby is only a head start.
            logger.exception("member %s: could not fork a prewarmed worker", self.member_id)

    def _rendezvous_env(self, d: pb.Directive, restart_started_at: float) -> dict[str, str]:
        rdv = d.rendezvous
        endpoints = list(rdv.trainer_endpoints)
        return {
            "PADDLE_DISTRI_BACKEND": "gloo",
            "PADDLE_MASTER": rdv.master_endpoint,
            "PADDLE_TRAINER_ID": str(rdv.rank),
            "PADDLE_TRAINERS_NUM": str(rdv.world_size),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rdv.rank] if endpoints else "",
            "PADDLE_RANK_IN_NODE": "0",
            GENERATION_ENV: str(d.generation),
            RESTORE_STEP_ENV: str(rdv.restore_step),
            RESTART_STARTED_AT_ENV: repr(restart_started_at),
        }

    async def _rendezvous(self, d: pb.Directive) -> None:
        rdv = d.rendezvous
        restart_started_at = time.time()
        left = self.state
        self._set_state(State.STARTING)
        old = self._worker
        standby = self._standby
        use_standby = (
            standby is not None and standby.returncode is None and standby.pid in self._conns
        )
        if old is not None and self.generation and left in (State.RUNNING, State.FAILED):
            # Not held: a loss broke the old generation. Where its worker stopped may be a
            # step past what the coordinator heard, and it counts the lost steps from it.
            last_word = self._heartbeat_request()
            self._tasks.append(asyncio.create_task(self._send_heartbeat(last_word)))
        self.generation = d.generation
        self.progress = _Progress()
        self._ready = asyncio.get_running_loop().create_future()
        # Nothing queued for the old worker may reach the new one.
        self._to_worker = []
        self._worker_done = False
        renv = self._rendezvous_env(d, restart_started_at)
        if use_standby and standby is not None:
            # The old worker leaves while the standby joins; they share nothing.
            self._standby = None
            self._standby_backoff_s = self.s.backoff_initial_s
            self._worker = standby
            self._worker_expected_exit = False
            if old is not None:
                stopper = asyncio.create_task(self._stop_worker(old))
                self._tasks.append(stopper)
            self._send_worker({"type": "rendezvous", "env": renv})
        else:
            if old is not None:
                await self._stop_worker(old)
            self._worker_expected_exit = False
            log_path = str(self._state_dir / f"worker-g{d.generation}-r{rdv.rank}.log")
            self._worker = await self.spawner.spawn(
                self.s.command, {**self._base_env(), **renv}, os.getcwd(), log_path
            )
        worker = self._worker
        assert worker is not None
        watcher = asyncio.create_task(self._watch_worker(worker))
        self._tasks.append(watcher)
        logger.info(
            "member %s %s worker pid %d: generation %d rank %d/%d restore %d",
            self.member_id,
            "woke prewarmed" if use_standby else "started",
            worker.pid,
            d.generation,
            rdv.rank,
            rdv.world_size,
            rdv.restore_step,
        )
        try:
            async with asyncio.timeout(self.s.start_timeout_s):
                ready = await asyncio.shield(self._ready)
        except (TimeoutError, RuntimeError) as exc:
            await self._ack(self._ack_request(d, ok=False, message=f"worker did not start: {exc}"))
            return
        logger.info(
            "member %s worker ready in generation %d at step %d",
            self.member_id,
            d.generation,
            ready.get("restored_step", 0),
        )
        await self._ack(self._ack_request(d))

    async def _stop_worker(self, worker: WorkerHandle | None = None) -> None:
        """Ask ``worker`` (default: the current one) to exit; SIGKILL it after the grace."""
        worker = worker or self._worker
        if worker is None or worker.returncode is not None:
            return
        if worker is self._worker:
            self._worker_expected_exit = True
        self._write_to(worker.pid, {"type": "exit"})
        try:
            async with asyncio.timeout(self.s.exit_grace_s):
                await worker.wait()
        except TimeoutError:
            logger.warning(
                "member %s: worker pid %d ignored exit for %.1fs; SIGKILL",
                self.member_id,
                worker.pid,
                self.s.exit_grace_s,
            )
            worker.kill(signal.SIGKILL)
            await worker.wait()

    async def _watch_worker(self, worker: WorkerHandle) -> None:
        code = await worker.wait()
        # What the worker said last (its final step, its last checkpoint, "done") may still
        # be unread in the channel; decide and report only after it has been handled.
        closed = self._conn_closed.get(worker.pid)
        if closed is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHANNEL_DRAIN_S):
                    await closed.wait()
        if worker is not self._worker:
            return
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"worker exited with {code}"))
        if self._worker_expected_exit:
            return
        if self._worker_done and code == 0:
            logger.info(
                "member %s (job %s): training finished at step %d; launcher exits",
                self.member_id,
                self.s.job_id,
                self.progress.step,
            )
            self._set_state(State.DONE)
            # Phase IDLE in the current generation with the final step: the coordinator
            # marks the member finished instead of waiting for its silence to look like a loss.
            await self._final_heartbeat()
            self.stop(0)
            return
        logger.error(
            "member %s (job %s): worker pid %d died with %d in generation %d",
            self.member_id,
            self.s.job_id,
            worker.pid,
            code,
            self.generation,
        )
        self._set_state(State.FAILED)
        self._fail_pending_if_no_worker()
        await self._heartbeat_quietly()

    async def _heartbeat_quietly(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._heartbeat()

    # -- worker side ------------------------------------------------------------------------

    def _write_to(self, pid: int, msg: Message) -> bool:
        writer = self._conns.get(pid)
        if writer is None or writer.is_closing():
            return False
        writer.write((json.dumps(msg) + "\n").encode())
        return True

    def _send_worker(self, msg: Message) -> None:
        """To the current worker; queued until it has connected."""
        if self._worker is None or not self._write_to(self._worker.pid, msg):
            self._to_worker.append(msg)

    async def _on_worker_conn(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        pid = -1
        try:
            while line := await reader.readline():
                msg: Message = json.loads(line)
                if msg.get("type") == "hello":
                    pid = int(msg.get("pid", -1))
                    known = [w.pid for w in (self._worker, self._standby) if w is not None]
                    if pid not in known:
                        logger.warning("member %s: hello from stale pid %s", self.member_id, pid)
                        return
                    self._conns[pid] = writer
                    self._conn_closed[pid] = asyncio.Event()
                    if self._worker is not None and pid == self._worker.pid:
                        pending, self._to_worker = self._to_worker, []
                        for m in pending:
                            self._send_worker(m)
                    continue
                # Only the current worker speaks for this member; a standby only waits.
                if self._worker is not None and pid == self._worker.pid:
                    await self._on_worker_message(msg)
        except (ConnectionError, ValueError) as exc:
            logger.warning("member %s: worker channel error: %s", self.member_id, exc)
        finally:
            if self._conns.get(pid) is writer:
                del self._conns[pid]
            closed = self._conn_closed.pop(pid, None)
            if closed is not None:
                closed.set()
            writer.close()

    async def _on_worker_message(self, msg: Message) -> None:
        kind = msg.get("type")
        p = self.progress
        if kind == "ready":
            p.worker_restart_s = float(msg.get("worker_restart_s", 0.0))
            p.group_init_s = float(msg.get("group_init_s", 0.0))
            p.restore_s = float(msg.get("restore_s", 0.0))
            p.step = int(msg.get("restored_step", 0))
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
            self._wake_heartbeat.set()
        elif kind == "progress":
            first = p.first_step_at
            p.step = int(msg["step"])
            p.epoch = int(msg["epoch"])
            p.cursor = int(msg["cursor"])
            p.samples_per_s = float(msg.get("samples_per_s", 0.0))
            p.first_step_at = float(msg.get("first_step_at", 0.0))
            if p.first_step_at and not first:
                if self.state is State.STARTING:
                    self._set_state(State.RUNNING)
                self._wake_heartbeat.set()
                # The next generation's worker warms up while this one trains.
                self._tasks.append(asyncio.create_task(self._ensure_standby()))
        elif kind == "held":
            if self.state in (State.RUNNING, State.STARTING):
                self._set_state(State.HOLDING)
            ckpt = msg.get("checkpoint") or {}
            for did in msg.get("directive_ids", []):
                d = self._pending_acks.pop(did, None)
                if d is None:
                    continue
                req = self._ack_request(d)
                req.held_at.CopyFrom(_ts(float(msg["held_at"])))
                req.checkpoint_step = int(msg["step"])
                if ckpt:
                    req.checkpoint_digest = str(ckpt["digest"])
                    req.checkpoint_write_s = float(ckpt["write_s"])
                await self._ack(req)
        elif kind == "resumed":
            if self.state is State.HOLDING:
                self._set_state(State.RUNNING)
        elif kind == "checkpoint":
            step = int(msg.get("step", 0))
            if step > self.last_checkpoint_step and msg.get("digest"):
                self.last_checkpoint_step = step
                self.last_checkpoint_digest = str(msg["digest"])
                # At once, not at the next beat: a loss right after this write must restore it.
                self._wake_heartbeat.set()
            logger.info(
                "member %s: checkpoint of step %s written (%s)",
                self.member_id,
                msg.get("step"),
                "periodic" if msg.get("periodic") else "coordinated",
            )
        elif kind == "done":
            self._worker_done = True
        else:
            logger.warning("member %s: unknown worker message %r", self.member_id, kind)


def parse_args(argv: Sequence[str] | None = None) -> LauncherSettings:
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, command = args[:cut], args[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m trainer.launch", description=__doc__.split("\n")[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    p.add_argument("--job", required=True, help="NAMESPACE/NAME of the job")
    p.add_argument("--pod", default=os.environ.get("POD_NAME", socket.gethostname()))
    p.add_argument("--pod-index", type=int, default=int(os.environ.get("TIDE_POD_INDEX", "0")))
    p.add_argument("--host", default=os.environ.get("POD_IP", "127.0.0.1"))
    p.add_argument("--state-dir", default="", help="worker logs (default: a temp dir)")
    p.add_argument("--no-zygote", action="store_true", help="start fresh worker processes")
    p.add_argument("--no-prewarm", action="store_true", help="no worker waiting ahead of time")
    p.add_argument("--exit-grace-s", type=float, default=1.0)
    p.add_argument("--log-level", default="INFO")
    ns = p.parse_args(args)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return LauncherSettings(
        coordinator=ns.coordinator,
        job_id=ns.job,
        command=tuple(command),
        pod_name=ns.pod,
        pod_index=ns.pod_index,
        host=ns.host,
        state_dir=ns.state_dir,
        use_zygote=not ns.no_zygote,
        prewarm=not ns.no_prewarm,
        exit_grace_s=ns.exit_grace_s,
    )


async def _amain(settings: LauncherSettings) -> int:
    launcher = Launcher(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, launcher.stop, 0)
    return await launcher.run()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_amain(settings))


if __name__ == "__main__":
    raise SystemExit(main())
