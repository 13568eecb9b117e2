"""The scaler's view of the coordinator: Resize, AbortResize, GetJobStatus, WatchJob.

Domain types here, converted to and from tide.v1 at the gRPC client, so the
controller never touches protobuf. The in-memory double with the same
semantics is tide.services.testing.coordinator.InMemoryCoordinator; one contract
suite (tests/scaler/test_coordinator_contract.py) runs over both.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from tide.base.client import domain_error
from tide.base.grpc_options import DEFAULT_TIMEOUT_S
from tide.base.timeconv import field_seconds
from tide.services.common import tracing
from tide.services.scaler.members import Member
from tide.v1 import coordinator_pb2, coordinator_pb2_grpc

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Values equal tide.v1.ResizePhase."""

    WAITING_FOR_MEMBERS = 1
    CHECKPOINTING = 2
    # Only a resize persisted by an older coordinator is still in DRAINING: a
    # shrink now sends DRAIN and RENDEZVOUS together (docs/resize-protocol.md).
    DRAINING = 3
    RENDEZVOUS = 4
    COMPLETED = 5
    ABORTED = 6
    FAILED = 7
    # Overlap mode (--resize-mode overlap): g+1's group forms before the barrier.
    PREPARING = 8

    @property
    def final(self) -> bool:
        return self in (Phase.COMPLETED, Phase.ABORTED, Phase.FAILED)


@dataclass(frozen=True)
class ResizeSpec:
    decision_id: int
    job_id: str
    target_world_size: int
    deadline_s: float
    leaving_pods: tuple[str, ...] = ()
    min_world_size: int = 0
    # The world moves by whole groups of this many members (1: any size).
    world_multiple: int = 1


@dataclass(frozen=True)
class Progress:
    decision_id: int
    phase: Phase
    generation: int = 0
    world_size: int = 0
    checkpoint_step: int = 0
    pause_s: float = 0.0
    lost_steps: int = 0
    message: str = ""
    # Rank 0's write of the coordinated checkpoint, seconds; 0 until measured.
    checkpoint_write_s: float = 0.0


@dataclass(frozen=True)
class JobStatusView:
    job_id: str
    generation: int
    world_size: int
    members: tuple[Member, ...]
    step: int = 0
    samples_per_s: float = 0.0
    # Steps lost to unplanned member losses since the job started.
    lost_steps_total: int = 0
    # Every member of the last generation finished its budget: nothing more to resize.
    finished: bool = False
    # The coordinator failed the job for good (its restart budget spent): why.
    failure: str = ""

    @property
    def over(self) -> bool:
        """Nothing more to resize: the job finished, or failed for good."""
        return self.finished or bool(self.failure)


class CoordinatorClient(Protocol):
    def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        """Start the resize, or re-attach to it; streams progress until a final phase."""
        ...

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase: ...

    async def job_status(self, job_id: str) -> JobStatusView: ...

    def watch_members(self, job_id: str) -> AsyncIterator[list[Member]]: ...

    def latest_status(self, job_id: str) -> JobStatusView | None:
        """The last status a member watch of the job saw (step, throughput); no call."""
        ...


# --- the gRPC client --------------------------------------------------------------------------


class GrpcCoordinatorClient:
    """The real client. Errors come back as TideErrors (tide.base.client.domain_error)."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self._timeout_s = timeout_s
        self._latest: dict[str, JobStatusView] = {}

    def latest_status(self, job_id: str) -> JobStatusView | None:
        return self._latest.get(job_id)

    async def resize(self, spec: ResizeSpec) -> AsyncIterator[Progress]:
        req = coordinator_pb2.ResizeRequest(
            decision_id=spec.decision_id,
            job_id=spec.job_id,
            target_world_size=spec.target_world_size,
            leaving_pods=list(spec.leaving_pods),
            deadline_s=spec.deadline_s,
            min_world_size=spec.min_world_size,
            world_multiple=spec.world_multiple,
        )
        # The stream lasts as long as the resize: its deadline is the barrier's
        # plus room for the waits around it.
        call = self._stub.Resize(
            req, timeout=spec.deadline_s * 3 + 30.0, metadata=tracing.inject() or None
        )
        try:
            async for p in call:
                yield Progress(
                    decision_id=p.decision_id,
                    phase=Phase(p.phase) if p.phase else Phase.WAITING_FOR_MEMBERS,
                    generation=p.generation,
                    world_size=p.world_size,
                    checkpoint_step=p.checkpoint_step,
                    pause_s=p.pause_s,
                    lost_steps=p.lost_steps,
                    message=p.message,
                    checkpoint_write_s=p.pause.checkpoint_write_s,
                )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc

    async def abort_resize(self, decision_id: int, job_id: str, reason: str) -> Phase:
        try:
            resp = await self._stub.AbortResize(
                coordinator_pb2.AbortResizeRequest(
                    decision_id=decision_id, job_id=job_id, reason=reason
                ),
                timeout=self._timeout_s,
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        return Phase(resp.phase) if resp.phase else Phase.ABORTED

    async def job_status(self, job_id: str) -> JobStatusView:
        try:
            st = await self._stub.GetJobStatus(
                coordinator_pb2.GetJobStatusRequest(job_id=job_id), timeout=self._timeout_s
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc
        return _status_view(st)

    async def watch_members(self, job_id: str) -> AsyncIterator[list[Member]]:
        # A watch lives until the coordinator goes away; keepalive notices a dead peer.
        call = self._stub.WatchJob(coordinator_pb2.GetJobStatusRequest(job_id=job_id))
        try:
            async for st in call:
                view = _status_view(st)
                self._latest[job_id] = view
                yield list(view.members)
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc


def _status_view(st: coordinator_pb2.JobStatus) -> JobStatusView:
    members = tuple(
        Member(
            m.pod_name,
            m.pod_uid,
            m.state == coordinator_pb2.MEMBER_STATE_ACTIVE,
            m.leave_requested,
            field_seconds(m, "leave_deadline"),
        )
        for m in st.members
        if m.state != coordinator_pb2.MEMBER_STATE_GONE
    )
    return JobStatusView(
        st.job_id,
        st.generation,
        st.world_size,
        members,
        st.step,
        st.samples_per_s,
        lost_steps_total=st.lost_steps_total,
        finished=st.finished,
        failure=st.failure,
    )
