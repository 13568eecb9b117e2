"""Engine state built by hand for the unit tests: one job in generation 1 of m0..m{n-1}
(ACTIVE, rank i, step 10 at 1 step/s) and standby members s0...; no gRPC, no store."""

from __future__ import annotations

from typing import Any

from tide.services.coordinator.domain import (
    Generation,
    JobRecord,
    Member,
    MemberState,
    Resize,
    ResizePhase,
    WorkerPhase,
)
from tide.services.coordinator.engine.state import JobState


def member(mid: str, index: int, state: MemberState, rank: int | None) -> Member:
    return Member(
        member_id=mid,
        job_id="ns/j",
        pod_name=f"p-{index}",
        pod_index=index,
        pod_uid="",
        host="h",
        launcher_id=f"l-{mid}",
        free_port=1000 + index,
        state=state,
        registered_at=0.0,
        rank=rank,
        reported_generation=1 if rank is not None else 0,
        phase=WorkerPhase.RUNNING if rank is not None else WorkerPhase.IDLE,
        step=10,
        steps_per_s=1.0,
    )


def job(actives: int = 2, standby: int = 1) -> JobState:
    """Generation 1 of m0..m{actives-1} at step 10, 1 step/s, and standby members s0..."""
    s = JobState(JobRecord(job_id="ns/j", generation=1))
    for i in range(actives):
        s.members[f"m{i}"] = member(f"m{i}", i, MemberState.ACTIVE, i)
    for j in range(standby):
        s.members[f"s{j}"] = member(f"s{j}", 10 + j, MemberState.STANDBY, None)
    s.generations[1] = generation(1, tuple(f"m{i}" for i in range(actives)))
    return s


def generation(g: int, ids: tuple[str, ...], decision_id: int | None = None) -> Generation:
    return Generation("ns/j", g, len(ids), ids, "h:1000", ("h:1000",), 0, 0.0, "", decision_id)


def resize(s: JobState, phase: ResizePhase, target: int = 3, **fields: Any) -> Resize:
    r = Resize(1, "ns/j", target, target, (), 40.0, phase, 1, 0.0, 0.0)
    for k, v in fields.items():
        setattr(r, k, v)
    s.resizes[1] = r
    return r
