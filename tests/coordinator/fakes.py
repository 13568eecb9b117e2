"""Fake launchers: plain gRPC clients that follow docs/resize-protocol.md.

A FakeLauncher registers, holds the Directives stream open, handles each
directive the way the real launcher does (CHECKPOINT: run to step S, hold, ack
with held_at and, on rank 0, the digest; RENDEZVOUS: "restart" in the new
generation at restore_step; DRAIN: ack and exit; RESUME: run again) and sends
heartbeats when the test says so, with times from the test's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from tide.services.common.clock import Clock
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

TIMEOUT_S = 5.0
K = pb.Directive.Kind


def ts(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(seconds * 1e9))
    return t


def digest_of(job_id: str, step: int) -> str:
    return hashlib.sha256(f"{job_id}:{step}".encode()).hexdigest()


class FakeLauncher:
    def __init__(
        self,
        target: str,
        clock: Clock,
        job_id: str,
        pod_index: int,
        *,
        port: int | None = None,
        launcher_id: str | None = None,
    ) -> None:
        self.target = target
        self.clock = clock
        self.job_id = job_id
        self.pod_index = pod_index
        self.pod_name = f"job-trainer-{pod_index}"
        self.port = port or 20000 + pod_index
        self.launcher_id = launcher_id or uuid.uuid4().hex
        self.channel: grpc.aio.Channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.member_id = ""
        self.state = 0
        self.generation = 0
        self.rank: int | None = None
        self.world_size = 0
        self.master = ""
        self.restore_step = -1
        self.step = 0
        self.phase = pb.WORKER_PHASE_IDLE
        self.first_step_at: float | None = None
        # The newest checkpoint this member's worker wrote (rank 0 reports it); 0: none.
        self.last_checkpoint = 0
        # That checkpoint's lag (snapshot to durable commit, seconds) and commit time (unix).
        self.last_checkpoint_lag_s = 0.0
        self.last_checkpoint_at = 0.0
        self.worker_starts = 0
        self.received: list[pb.Directive] = []
        self.handled: dict[str, pb.Directive] = {}
        # The fields of each directive's last ack: a re-sent directive gets the same ack
        # again, as the real launcher's (tide/trainer/launcher/core.py, _handled).
        self._ack_fields: dict[str, dict[str, Any]] = {}
        self.ack_errors: list[grpc.aio.AioRpcError] = []
        self.exited = False
        # The pod's uid sent at Register, and whether its heartbeats ask to leave (SIGTERM).
        self.pod_uid = f"uid-{pod_index}"
        self.leave_requested = False
        # When its grace ends (unix seconds; 0: not said), sent with the leave request.
        self.leave_deadline_s = 0.0
        # Behaviour switches a test flips.
        self.answer_checkpoint = True
        # > 0: the CHECKPOINT came after g passed its step; this rank held this many steps
        # later (the ranks of g hold together, so a test sets the same on each, or not to
        # break that agreement).
        self.held_past = 0
        self.answer_rendezvous = True
        # The step its next RENDEZVOUS ack says the new worker restored (None: the named one,
        # as a worker that found nothing newer does); and the start delays it was told.
        self.restores: int | None = None
        self.start_delays: list[float] = []
        # Sent with phase FAILED: how its worker ended.
        self.worker_exit: pb.WorkerExit | None = None
        # PREPARE (overlap mode): True acks (the group formed), False nacks, None ignores.
        self.prepare_ok: bool | None = True
        # What each RENDEZVOUS said about its group: formed ahead by a PREPARE or not.
        self.rendezvous_prepared: list[bool] = []
        self.handle_directives = True
        self._reader: asyncio.Task[None] | None = None
        self._stream: Any = None

    # --- calls ---------------------------------------------------------------

    async def register(self) -> pb.RegisterResponse:
        resp: pb.RegisterResponse = await self.stub.Register(
            pb.RegisterRequest(
                job_id=self.job_id,
                pod_name=self.pod_name,
                pod_uid=self.pod_uid,
                pod_index=self.pod_index,
                host="127.0.0.1",
                launcher_id=self.launcher_id,
                last_generation=self.generation,
                free_port=self.port,
            ),
            timeout=TIMEOUT_S,
        )
        self.member_id = resp.member_id
        self.state = resp.state
        return resp

    async def connect(self) -> None:
        await self.disconnect()
        self._stream = self.stub.Directives(pb.DirectivesRequest(member_id=self.member_id))
        self._reader = asyncio.create_task(self._read(self._stream))

    async def join(self) -> FakeLauncher:
        await self.register()
        await self.connect()
        return self

    def stream_ended(self) -> bool:
        return self._reader is None or self._reader.done()

    async def disconnect(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._reader
        self._stream = None
        self._reader = None

    async def close(self) -> None:
        await self.disconnect()
        await self.channel.close()

    async def heartbeat(self, steps: int = 1) -> pb.HeartbeatResponse:
        """One heartbeat; a running worker has made ``steps`` steps since the last one."""
        if self.phase == pb.WORKER_PHASE_STARTING:
            self.phase = pb.WORKER_PHASE_RUNNING
            self.first_step_at = self.clock.now()
            self.step += 1
        elif self.phase == pb.WORKER_PHASE_RUNNING:
            self.step += steps
        req = pb.HeartbeatRequest(
            member_id=self.member_id,
            generation=self.generation,
            phase=self.phase,
            step=self.step,
            samples_consumed=self.step * 48,
            samples_per_s=100.0,
            free_port=self.port,
            leave_requested=self.leave_requested,
            leave_deadline=ts(self.leave_deadline_s) if self.leave_deadline_s else None,
            startup=pb.PauseBreakdown(worker_restart_s=0.02, group_init_s=0.4, restore_s=0.1),
            worker_exit=self.worker_exit if self.phase == pb.WORKER_PHASE_FAILED else None,
            last_checkpoint_step=self.last_checkpoint,
            last_checkpoint_digest=digest_of(self.job_id, self.last_checkpoint)
            if self.last_checkpoint
            else "",
            last_checkpoint_lag_s=self.last_checkpoint_lag_s,
            last_checkpoint_at=ts(self.last_checkpoint_at) if self.last_checkpoint_at else None,
        )
        if self.first_step_at is not None:
            req.first_step_at.CopyFrom(ts(self.first_step_at))
        resp: pb.HeartbeatResponse = await self.stub.Heartbeat(req, timeout=TIMEOUT_S)
        return resp

    async def ack(self, d: pb.Directive, **fields: Any) -> None:
        self._ack_fields[d.directive_id] = fields
        try:
            await self.stub.Ack(
                pb.AckRequest(
                    member_id=self.member_id,
                    directive_id=d.directive_id,
                    generation=d.generation,
                    **fields,
                ),
                timeout=TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            self.ack_errors.append(exc)

    # --- directive handling ----------------------------------------------------

    def kinds(self) -> list[int]:
        return [d.kind for d in self.received]

    async def _read(self, stream: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for d in stream:
                self.received.append(d)
                if self.handle_directives:
                    await self.handle(d)

    async def handle(self, d: pb.Directive) -> None:
        if d.directive_id in self.handled:
            # A re-sent directive: the same ack again, nothing done.
            await self.ack(d, **self._ack_fields.get(d.directive_id, {"ok": True}))
            return
        if d.kind == K.KIND_CHECKPOINT:
            if not self.answer_checkpoint:
                return
            self.handled[d.directive_id] = d
            held = d.checkpoint_step + self.held_past
            self.step = max(self.step, held)
            self.phase = pb.WORKER_PHASE_HOLDING
            # Every rank's ack says where it held, as real launchers' acks do.
            fields: dict[str, Any] = {
                "ok": True,
                "held_at": ts(self.clock.now()),
                "checkpoint_step": held,
            }
            if self.rank == 0:
                fields.update(
                    checkpoint_digest=digest_of(self.job_id, held),
                    checkpoint_write_s=0.25,
                )
            await self.ack(d, **fields)
            return
        if d.kind == K.KIND_RENDEZVOUS and not self.answer_rendezvous:
            return
        if d.kind == K.KIND_PREPARE:
            if self.prepare_ok is None:
                return
            self.handled[d.directive_id] = d
            await self.ack(d, ok=self.prepare_ok, message="" if self.prepare_ok else "no memory")
            return
        self.handled[d.directive_id] = d
        if d.kind == K.KIND_RENDEZVOUS:
            rv = d.rendezvous
            self.generation = rv.generation
            self.rank = rv.rank
            self.world_size = rv.world_size
            self.master = rv.master_endpoint
            self.restore_step = rv.restore_step
            self.rendezvous_prepared.append(rv.prepared)
            restored = rv.restore_step if self.restores is None else self.restores
            self.restores = None
            self.start_delays.append(rv.start_delay_s)
            self.step = restored
            self.phase = pb.WORKER_PHASE_STARTING
            self.first_step_at = None
            self.worker_starts += 1
            await self.ack(d, ok=True, restored_step=restored)
        elif d.kind == K.KIND_RESUME:
            self.phase = pb.WORKER_PHASE_RUNNING
            await self.ack(d, ok=True)
        elif d.kind == K.KIND_HOLD:
            self.phase = pb.WORKER_PHASE_HOLDING
            await self.ack(d, ok=True)
        elif d.kind in (K.KIND_DRAIN, K.KIND_STOP):
            self.phase = pb.WORKER_PHASE_IDLE
            await self.ack(d, ok=True)
            self.exited = True


class ResizeWatch:
    """Runs one Resize call in the background and records its progress messages."""

    def __init__(
        self,
        stub: pb_grpc.CoordinatorStub,
        job_id: str,
        decision_id: int,
        target: int,
        *,
        deadline_s: float = 20.0,
        leaving: tuple[str, ...] = (),
        min_world_size: int = 0,
    ) -> None:
        self.updates: list[pb.ResizeProgress] = []
        self.error: grpc.aio.AioRpcError | None = None
        req = pb.ResizeRequest(
            decision_id=decision_id,
            job_id=job_id,
            target_world_size=target,
            deadline_s=deadline_s,
            leaving_pods=list(leaving),
            min_world_size=min_world_size,
        )
        self.task = asyncio.create_task(self._run(stub, req))

    async def _run(self, stub: pb_grpc.CoordinatorStub, req: pb.ResizeRequest) -> None:
        # The generated stub is typed for the sync API; on an aio channel it is a stream.
        call: Any = stub.Resize(req, timeout=60)
        try:
            async for p in call:
                self.updates.append(p)
        except grpc.aio.AioRpcError as exc:
            self.error = exc

    @property
    def last(self) -> pb.ResizeProgress:
        return self.updates[-1] if self.updates else pb.ResizeProgress()

    def phases(self) -> list[int]:
        return [p.phase for p in self.updates]

    async def final(self, timeout_s: float = 5.0) -> pb.ResizeProgress:
        await asyncio.wait_for(self.task, timeout_s)
        if self.error is not None:
            raise self.error
        return self.last
