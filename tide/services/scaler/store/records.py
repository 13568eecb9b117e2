"""The scaler's stored records: decision states and their lifecycle, and the frozen
records the repository returns (ORM objects never leave tide.services.scaler.store)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from tide.base.lifecycle import TransitionTable


class DecisionState(StrEnum):
    """Stored decision states; the names match tide.v1.DecisionState without its prefix."""

    PENDING = "PENDING"
    PREPARING = "PREPARING"
    ACTUATING = "ACTUATING"
    COMPLETED = "COMPLETED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"


#: The one table of legal decision edges; the store checks every transition against it.
DECISION_LIFECYCLE: Final = TransitionTable[DecisionState](
    "decision",
    {
        DecisionState.PENDING: {
            DecisionState.PREPARING,
            DecisionState.ABORTED,
            DecisionState.FAILED,
        },
        DecisionState.PREPARING: {
            DecisionState.ACTUATING,
            DecisionState.ABORTED,
            DecisionState.FAILED,
        },
        DecisionState.ACTUATING: {
            DecisionState.COMPLETED,
            DecisionState.ABORTED,
            DecisionState.FAILED,
        },
        DecisionState.COMPLETED: (),
        DecisionState.ABORTED: (),
        DecisionState.FAILED: (),
    },
)

FINAL_STATES: Final = DECISION_LIFECYCLE.final_states


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    min_replicas: int
    max_replicas: int
    current_replicas: int
    gpus_per_replica: int
    policy_overrides: dict[str, Any]
    autoscaling_paused: bool
    pause_reason: str
    paused_at: datetime | None
    generation: int
    last_resize_ended_at: datetime | None
    owner_epoch: int
    owner_id: str
    created_at: datetime
    updated_at: datetime
    version: int


@dataclass(frozen=True)
class DecisionRecord:
    id: int
    job_id: str
    from_replicas: int
    to_replicas: int
    reason: str
    trigger: str
    message: str
    inputs: dict[str, Any]
    state: DecisionState
    error: str
    pause_s: float
    lost_steps: int
    generation: int
    requested_by: str
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    version: int

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class DecisionEventRecord:
    id: int
    decision_id: int
    state: DecisionState
    at: datetime
    detail: str


@dataclass(frozen=True)
class DecisionDetailRecord:
    decision: DecisionRecord
    # Oldest first.
    events: tuple[DecisionEventRecord, ...]


@dataclass(frozen=True)
class DecisionPage:
    # Newest first.
    decisions: tuple[DecisionRecord, ...]
    # Empty on the last page.
    next_page_token: str


@dataclass(frozen=True)
class RollupRecord:
    """One job's GPU utilization over one minute, or over the part of it one write covers."""

    job_id: str
    # Start of the minute, aware UTC, seconds and microseconds zero.
    minute: datetime
    mean_pct: float
    min_pct: float
    max_pct: float
    samples: int
    replicas: int
    # Per second of the minute, the sum of the samples' utilization and their count
    # (60 each; empty when not known: rows read from the minutes alone).
    second_sums: tuple[float, ...] = ()
    second_counts: tuple[int, ...] = ()
