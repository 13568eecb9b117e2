"""The demo's script: its phases, their order, and when a phase reached its goal.

Its own room because the scenario (STARTING → HIGH → LOW ... → DONE) changes with
what the demo shows, not with how it polls the services or reports; pure functions,
so tests/local/test_view.py checks them without a cluster.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Final

from tide.base.errors import FailedPrecondition
from tide.base.lifecycle import TransitionTable
from tide.services.local.demo.settings import DemoSettings
from tide.services.local.view import Snapshot


class Phase(enum.Enum):
    """STARTING → HIGH → LOW (→ HIGH → LOW ... for more cycles) → DONE; any → FAILED."""

    STARTING = "starting"
    HIGH = "high load"
    LOW = "low load"
    DONE = "done"
    FAILED = "failed"


DEMO_LIFECYCLE: Final = TransitionTable[Phase](
    "demo phase",
    {
        # The first generation runs: drive the load up.
        Phase.STARTING: {Phase.HIGH, Phase.FAILED},
        # The grow completed: drive it down.
        Phase.HIGH: {Phase.LOW, Phase.FAILED},
        # The shrink completed: another cycle, or the end.
        Phase.LOW: {Phase.HIGH, Phase.DONE, Phase.FAILED},
        Phase.DONE: (),
        Phase.FAILED: (),
    },
)


def next_job_id(state_dir: Path) -> str:
    """``demo/run-N``, one more than the runs already in the state dir."""
    runs = [
        int(d.name.removeprefix("demo__run-"))
        for d in (state_dir / "jobs").glob("demo__run-*")
        if d.name.removeprefix("demo__run-").isdigit()
    ]
    return f"demo/run-{max(runs, default=0) + 1}"


def goal_reached(phase: Phase, snap: Snapshot, s: DemoSettings, earlier: set[int]) -> bool:
    """STARTING: the first generation trains. HIGH/LOW: a grow/shrink decided in this
    phase completed and the job is at the top/bottom size."""
    if phase is Phase.STARTING:
        return snap.generation >= 1 and snap.step > 0
    if phase not in (Phase.HIGH, Phase.LOW):
        return False
    grow = phase is Phase.HIGH
    target = s.max_replicas if grow else s.start_replicas
    return snap.replicas == target and any(
        d.state == "COMPLETED" and d.id not in earlier and (d.to_replicas > d.from_replicas) == grow
        for d in snap.decisions
    )


def next_phase(phase: Phase, cycles_done: int, cycles: int) -> Phase:
    """Where a phase whose goal was reached leads (cycles_done counts finished LOW phases)."""
    if phase is Phase.STARTING:
        return Phase.HIGH
    if phase is Phase.HIGH:
        return Phase.LOW
    if phase is Phase.LOW:
        return Phase.HIGH if cycles_done < cycles else Phase.DONE
    raise FailedPrecondition(f"demo phase {phase.value} has no successor")
