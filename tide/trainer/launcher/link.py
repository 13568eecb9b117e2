"""The launcher's link to the coordinator: the only launcher code that speaks gRPC/protobuf.

It registers (with the same ``launcher_id`` every time, so a re-registration is the same
member), holds the Directives stream and hands each directive on as a plain
:class:`~tide.trainer.launcher.model.Directive`, heartbeats, and sends acks. The stream
reconnects with :class:`tide.base.retry.Backoff`; when the coordinator is unreachable the
link opens a fresh channel (see :meth:`CoordinatorLink._renew_channel`).

Refused heartbeats:

- NOT_FOUND: the coordinator does not know the member (it lost it): register again now.
- DEADLINE_EXCEEDED: nobody answers (a coordinator paused, or a leader cut off while a
  standby takes over): open a fresh channel, which the directive stream follows.
- UNAVAILABLE: retried as it is (a standby coordinator, a store outage): the member
  keeps its id.
- FAILED_PRECONDITION: the coordinator fences this beat: a stale generation (the job moved
  on and the RENDEZVOUS is on its way) or a member that has left. Neither is fatal, and
  neither is cured by registering at once: the directive stream brings the next RENDEZVOUS,
  and the coordinator ends the stream of a member that has left, which makes the stream
  loop register again. Only refusals that last a whole heartbeat timeout (the coordinator's
  own patience with a silent member) lead to one re-registration, as a safety net.

Credentials that cannot work end the launcher (``on_fatal`` with
:data:`EXIT_CREDENTIALS`, one ERROR line naming the cause) instead of retrying forever in a
pod that looks Running: a Register refused as UNAUTHENTICATED or PERMISSION_DENIED (the
identity), or an UNAVAILABLE that :func:`tide.base.tlsprobe.diagnose` names as TLS twice in a
row (no CA for a TLS coordinator, a wrong CA, a refused client certificate). A coordinator
that is down, restarting or slow is no such cause: that is retried as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import socket
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from tide.base import logs
from tide.base.client import domain_error, open_channel
from tide.base.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    TideError,
    Unavailable,
)
from tide.base.retry import Backoff
from tide.base.timeconv import ts_from_seconds
from tide.base.tlsprobe import diagnose
from tide.trainer.launcher.model import LEAVING, Ack, Beat, Directive, State
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.launcher.wire import PHASE, directive_of
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

#: The launcher's exit status when its credentials cannot work (sysexits' EX_CONFIG).
EXIT_CREDENTIALS = 78
#: Register refusals no retry cures: the identity the launcher presents.
_REFUSED_IDENTITY = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

_T = TypeVar("_T")


class ChannelClosed(Unavailable):
    """A call's channel was closed under it: renewed (:meth:`CoordinatorLink._renew_channel`)
    while the call waited, and retired once its grace ran out."""


async def _rpc(call: Awaitable[_T]) -> _T:
    """``call`` awaited; :class:`ChannelClosed` if its channel is closed under it.

    grpc.aio cancels the calls of a channel that closes, and the task awaiting one gets a
    CancelledError although nobody cancelled that task. Re-raised as it is, it ended the loop
    that made the call, silently: a Register in flight when its channel was retired ended the
    directive stream's loop, the member never registered again, and a directive it had yet to
    re-ack after a store outage went overdue (the member was lost). Only the task's own
    cancellation (``cancelling()``) is a cancellation."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ChannelClosed("its channel was closed under the call (renewed)") from None


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (65536 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 65536


# Where a launcher picks the port it offers for the rendezvous (rank 0's becomes the gloo
# master's): below the kernel's ephemeral range, from which every outgoing connection takes
# its local port. A port probed there could be taken by one before the worker bound it, and
# on one host (tide up) gloo's own connections and every other launcher's take many: the
# master then fails to bind and its peers wait on a stranger's listener. Below Kubernetes'
# NodePort range too (30000-32767): on a host-network pod, a connection to a NodePort is
# redirected to its Service whether or not anything listens there. Read once, at import.
RENDEZVOUS_PORTS = range(20_000, min(_ephemeral_low(), 30_000))


def find_free_port(host: str) -> int:
    """A port free on ``host`` now, drawn from RENDEZVOUS_PORTS (the kernel's choice where
    that range is empty or its draws are taken)."""
    draws = random.sample(RENDEZVOUS_PORTS, min(16, len(RENDEZVOUS_PORTS)))
    for port in [*draws, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"cannot bind any port on {host}")


class CoordinatorLink:
    def __init__(
        self,
        settings: LauncherSettings,
        beat: Callable[[], Beat],
        on_fatal: Callable[[int], None] | None = None,
    ) -> None:
        self.s = settings
        # Told the exit status when the credentials cannot work (None: keep retrying).
        self._on_fatal = on_fatal
        # The TLS cause the last UNAVAILABLE was diagnosed with ("" none).
        self._tls_cause = ""
        # What a heartbeat says now; also this launcher's generation and whether it leaves.
        self._beat = beat
        self.member_id = ""
        self.heartbeat_interval_s = 1.0
        self.heartbeat_timeout_s = 10.0
        self.directives: asyncio.Queue[Directive] = asyncio.Queue()
        self.channel: grpc.aio.Channel | None = None
        # Channels replaced after the coordinator became unreachable, closing.
        self._old_channels: list[grpc.aio.Channel] = []
        self._stub: pb_grpc.CoordinatorAsyncStub | None = None
        self._wake = asyncio.Event()
        self._reregister = asyncio.Event()
        # When the current run of FAILED_PRECONDITION refusals began (monotonic), or None.
        self._refused_since: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def _leaving(self) -> bool:
        return self._beat().state in LEAVING

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def start(self) -> None:
        self.channel = self._open()
        self._stub = pb_grpc.CoordinatorStub(self.channel)
        self._spawn(self._stream_loop(), "directives")
        self._spawn(self._heartbeat_loop(), "heartbeat")

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.channel is not None:
            await self.channel.close()
        for old in self._old_channels:
            await old.close()

    def wake_heartbeat(self) -> None:
        """Beat now, not at the next interval (a state change, a checkpoint written)."""
        self._wake.set()

    # -- registration and the directive stream -----------------------------------------------

    async def _register(self) -> None:
        assert self._stub is not None
        resp = await _rpc(
            self._stub.Register(
                pb.RegisterRequest(
                    job_id=self.s.job_id,
                    pod_name=self.s.pod_name,
                    pod_uid=self.s.pod_uid,
                    pod_index=self.s.pod_index,
                    host=self.s.host,
                    launcher_id=self.s.launcher_id,
                    last_generation=self._beat().generation,
                    free_port=find_free_port(self.s.host),
                ),
                timeout=self.s.rpc_timeout_s,
            )
        )
        self.member_id = resp.member_id
        logs.bind_process(member=self.member_id)
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
        backoff = Backoff(self.s.backoff_initial_s, self.s.backoff_max_s)
        while True:
            if self._leaving():
                # Drained, or the job finished: the coordinator ended this member's stream
                # on purpose, and registering again would add a member that never runs.
                return
            opened_at: float | None = None
            try:
                assert self._stub is not None
                await self._register()
                self._reregister.clear()
                opened_at = time.monotonic()
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
                if reader in done and reader.cancelled():
                    # Its channel was closed under it: renewed after an unanswered heartbeat.
                    logger.warning(
                        "directive stream of member %s closed with its channel; reconnecting",
                        self.member_id,
                    )
                elif reader in done:
                    reader.result()
                    if self._leaving():
                        # Drained or finished: the coordinator ended the stream on purpose.
                        logger.info("directive stream of member %s ended", self.member_id)
                    else:
                        logger.warning(
                            "directive stream of member %s ended; reconnecting", self.member_id
                        )
                else:
                    logger.warning(
                        "member %s registering again (unknown to the coordinator, or its"
                        " channel renewed)",
                        self.member_id,
                    )
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except ChannelClosed as exc:
                # The heartbeat renewed the channel while Register waited on the old one.
                logger.warning("directive stream of member %s: %s", self.member_id, exc)
            except grpc.aio.AioRpcError as exc:
                cause = await self._unrecoverable(exc, registered=opened_at is not None)
                if cause and self._on_fatal is not None:
                    logger.error(
                        "launcher %s (job %s) cannot use the coordinator at %s: %s; exiting",
                        self.s.pod_name,
                        self.s.job_id,
                        self.s.coordinator,
                        cause,
                    )
                    self._on_fatal(EXIT_CREDENTIALS)
                    return
                logger.warning(
                    "directive stream of member %s broke (%s: %s)",
                    self.member_id,
                    exc.code().name,
                    exc.details(),
                )
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._renew_channel()
            # A stream that stood for a while was a success: the next outage starts over.
            # One that ends at once keeps backing off, so it cannot become a register storm.
            if opened_at is not None and time.monotonic() - opened_at >= self.s.backoff_max_s:
                backoff.reset()
            # Jittered: launchers that lost one coordinator do not reconnect in step.
            await asyncio.sleep(backoff.next_delay_s())

    async def _unrecoverable(self, exc: grpc.aio.AioRpcError, *, registered: bool) -> str:
        """The cause no retry cures behind ``exc`` ("" when a retry may help): a refused
        identity at Register, or the same TLS cause diagnosed twice in a row (once could
        be a coordinator restarting mid-handshake)."""
        if not registered and exc.code() in _REFUSED_IDENTITY:
            return f"{exc.code().name}: {exc.details()} (its token or certificate's identity)"
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            self._tls_cause = ""
            return ""
        cause = await asyncio.to_thread(diagnose, self.s.coordinator, self.s.credentials) or ""
        confirmed = bool(cause) and cause == self._tls_cause
        self._tls_cause = cause
        return cause if confirmed else ""

    def _open(self) -> grpc.aio.Channel:
        # Own subchannels: a renewed channel must not inherit the backoff of the one it
        # replaces through gRPC's global subchannel pool (measured: 1.6-4 s late without).
        return open_channel(
            self.s.coordinator, credentials=self.s.credentials, own_subchannels=True
        )

    def _renew_channel(self) -> None:
        """A new channel to the coordinator. gRPC's own reconnect backoff on a channel whose
        server went away grows to two minutes (measured here: a coordinator back after 6 s
        was reached 2.4 s later); a fresh channel connects on the launcher's own, capped,
        backoff. Calls still in flight on the old one get until their deadline."""
        old = self.channel
        self.channel = self._open()
        self._stub = pb_grpc.CoordinatorStub(self.channel)
        if old is not None:
            self._old_channels.append(old)
            self._spawn(self._retire(old), "retire-channel")

    async def _retire(self, channel: grpc.aio.Channel) -> None:
        await channel.close(grace=self.s.rpc_timeout_s)
        with contextlib.suppress(ValueError):
            self._old_channels.remove(channel)

    async def _read_directives(self, call: Any) -> None:
        async for directive in call:
            await self.directives.put(directive_of(directive))

    # -- heartbeats -----------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            # Cleared before the beat, not after: a wake-up asked for while the beat is in
            # flight (a checkpoint just written) must cause the next one at once.
            self._wake.clear()
            try:
                await self.heartbeat()
                self._refused_since = None
            except asyncio.CancelledError:
                raise
            except NotFound as exc:
                # The coordinator lost the member: registering again also reopens its stream.
                logger.warning("heartbeat of member %s: %s", self.member_id, exc)
                if not self._leaving():
                    self._reregister.set()
            except FailedPrecondition as exc:
                self._refused(exc)
            except DeadlineExceeded as exc:
                # No answer at all: a coordinator paused or cut off, on a connection gRPC
                # holds open until keepalive gives up (tens of seconds). A fresh channel
                # reaches whoever serves now (a Service routes to the Ready leader, an
                # address list to the replica whose health is SERVING), and the directive
                # stream follows once the old channel is retired.
                logger.warning(
                    "heartbeat of member %s unanswered (%s); dialling the coordinator afresh",
                    self.member_id,
                    exc,
                )
                self._renew_channel()
                # The stream moves at once, not when the old channel's grace runs out.
                self._reregister.set()
            except TideError as exc:
                logger.warning(
                    "heartbeat of member %s failed: %s: %s",
                    self.member_id,
                    type(exc).__name__,
                    exc,
                )
            except Exception:
                # A heartbeat loop must never die of one bad beat.
                logger.exception("heartbeat of member %s failed", self.member_id)
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # races with the event, and the loop would then never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_interval_s):
                    await self._wake.wait()

    def _refused(self, exc: FailedPrecondition) -> None:
        """A fenced heartbeat (see the module docstring): wait for the directive stream."""
        if self._leaving():
            return  # a finished or drained member: the coordinator no longer counts it
        now = time.monotonic()
        beat = self._beat()
        if self._refused_since is None:
            self._refused_since = now
            logger.warning(
                "heartbeat of member %s (job %s, generation %d) refused: %s; "
                "waiting for the directive stream",
                self.member_id,
                self.s.job_id,
                beat.generation,
                exc,
            )
        elif now - self._refused_since >= self.heartbeat_timeout_s:
            logger.warning(
                "heartbeats of member %s (job %s, generation %d) refused for %.1fs; "
                "registering again",
                self.member_id,
                self.s.job_id,
                beat.generation,
                now - self._refused_since,
            )
            self._refused_since = None
            self._reregister.set()

    def _heartbeat_request(self, beat: Beat) -> pb.HeartbeatRequest:
        p = beat.progress
        return pb.HeartbeatRequest(
            member_id=self.member_id,
            generation=beat.generation,
            phase=PHASE[beat.state],
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
            last_checkpoint_step=beat.checkpoint.step,
            last_checkpoint_digest=beat.checkpoint.digest,
            last_checkpoint_lag_s=beat.checkpoint.lag_s,
            last_checkpoint_at=ts_from_seconds(beat.checkpoint.at) if beat.checkpoint.at else None,
            leave_requested=beat.leave_requested,
            leave_deadline=ts_from_seconds(beat.leave_deadline_s)
            if beat.leave_deadline_s
            else None,
            first_step_at=ts_from_seconds(p.first_step_at) if p.first_step_at else None,
            worker_exit=pb.WorkerExit(
                exit_code=beat.worker_exit.exit_code,
                cause=beat.worker_exit.cause,
                log_tail=beat.worker_exit.log_tail,
            )
            if beat.worker_exit is not None
            else None,
        )

    async def heartbeat(self, beat: Beat | None = None) -> None:
        """One heartbeat (``beat``, or what the launcher says now); a refusal raises the
        TideError it stands for."""
        if not self.member_id or self._stub is None:
            return
        beat = beat or self._beat()
        try:
            resp = await _rpc(
                self._stub.Heartbeat(self._heartbeat_request(beat), timeout=self.s.rpc_timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc) from exc
        if resp.generation > beat.generation and beat.state is not State.STANDBY:
            logger.info(
                "member %s is in generation %d, the job in %d: waiting for RENDEZVOUS",
                self.member_id,
                beat.generation,
                resp.generation,
            )

    async def heartbeat_quietly(self) -> None:
        with contextlib.suppress(TideError):
            await self.heartbeat()

    def send_last_word(self, beat: Beat) -> None:
        """In the background, one heartbeat taken now: the last word about a generation
        being left (where its worker stopped), which the coordinator may refuse."""
        self._spawn(self._quietly(self.heartbeat(dataclasses.replace(beat))), "last-word")

    @staticmethod
    async def _quietly(call: Awaitable[None]) -> None:
        with contextlib.suppress(TideError):
            await call

    async def final_heartbeat(self) -> bool:
        """Tell the coordinator the worker finished (phase IDLE in the current generation)
        and keep telling it until it answers. A heartbeat is answered only once what it
        changed is committed, so the answer is the durable ack of the member's end. While
        the coordinator's store is down the report is refused (UNAVAILABLE, or unanswered
        while a commit waits for the store); it is retried for up to
        ``final_report_timeout_s``, because a launcher that exits unheard is a silent
        member, and silence reads as a loss. Returns whether the end was acknowledged (or
        the coordinator no longer counts the member: nothing to tell)."""
        try:
            return await self._report_end(self.s.final_report_timeout_s)
        except asyncio.CancelledError:
            # Stopped (SIGTERM, SIGINT) while the report waited for its ack.
            logger.warning(
                "member %s (job %s) stopped before the coordinator recorded its completion",
                self.member_id,
                self.s.job_id,
            )
            raise

    async def _report_end(self, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        backoff = Backoff(self.s.backoff_initial_s, self.s.backoff_max_s)
        refusals = 0
        while True:
            try:
                await self.heartbeat()
            except (NotFound, FailedPrecondition):
                return True  # the coordinator no longer counts this member: nothing to tell
            except TideError as exc:
                refusals += 1
                if refusals == 1:
                    logger.info(
                        "member %s (job %s): completion report refused (%s: %s); retrying for"
                        " up to %.0f s (final_report_timeout_s)",
                        self.member_id,
                        self.s.job_id,
                        type(exc).__name__,
                        exc,
                        limit_s,
                    )
                delay = backoff.next_delay_s()
                if time.monotonic() + delay > deadline:
                    logger.warning(
                        "member %s (job %s) exits without the coordinator having recorded its"
                        " completion: refused %d time(s) in %.0f s (final_report_timeout_s),"
                        " last %s: %s; the coordinator will count this member lost once its"
                        " silence outlasts the heartbeat timeout",
                        self.member_id,
                        self.s.job_id,
                        refusals,
                        limit_s,
                        type(exc).__name__,
                        exc,
                    )
                    return False
                await asyncio.sleep(delay)
                continue
            if refusals:
                logger.info(
                    "member %s (job %s): completion recorded after %d refusal(s)",
                    self.member_id,
                    self.s.job_id,
                    refusals,
                )
            return True

    # -- acks -------------------------------------------------------------------------------

    async def ack(self, ack: Ack) -> None:
        """Send ``ack``; a refusal is logged, never raised (the coordinator decides)."""
        assert self._stub is not None
        req = pb.AckRequest(
            member_id=self.member_id,
            directive_id=ack.directive_id,
            generation=ack.generation,
            ok=ack.ok,
            message=ack.message,
            checkpoint_step=ack.checkpoint_step,
            checkpoint_digest=ack.checkpoint_digest,
            checkpoint_write_s=ack.checkpoint_write_s,
            held_at=ts_from_seconds(ack.held_at),
            restored_step=ack.restored_step,
        )
        try:
            await _rpc(self._stub.Ack(req, timeout=self.s.rpc_timeout_s))
        except ChannelClosed as exc:
            # A re-sent directive (the next stream) is acked again from the launcher's record.
            logger.warning(
                "ack of directive %s by member %s not sent: %s",
                ack.directive_id,
                self.member_id,
                exc,
            )
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "ack of directive %s by member %s refused: %s %s",
                ack.directive_id,
                self.member_id,
                exc.code().name,
                exc.details(),
            )
