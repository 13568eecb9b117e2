"""The coordinator's part of a decision's trace: a span per resize, continued from the
scaler's (the Resize call's ``traceparent``), a child span per phase, and an event
per directive sent. Applied by the outbox with the state changes it traces.

A coordinator that restarts mid-resize has no span for it: the scaler's trace still
shows the re-attached Resize call and the outcome.
"""

from __future__ import annotations

from typing import Any

from tide.services.common import tracing
from tide.services.coordinator.domain import Resize, ResizePhase


class ResizeTraces:
    def __init__(self) -> None:
        self._resize: dict[int, Any] = {}
        self._phase: dict[int, Any] = {}

    def begin(self, r: Resize, parent: Any) -> None:
        if r.decision_id in self._resize:
            return
        span = tracing.start_span(
            "tide.coordinator.resize",
            parent=parent,
            attributes={
                "tide.job_id": r.job_id,
                "tide.decision_id": r.decision_id,
                "tide.target_world_size": r.target_world_size,
                "tide.from_generation": r.from_generation,
            },
        )
        self._resize[r.decision_id] = span
        self._start_phase(r.decision_id, r.phase)

    def _start_phase(self, decision_id: int, phase: ResizePhase) -> None:
        parent = self._resize[decision_id]
        self._phase[decision_id] = tracing.start_span(
            f"tide.coordinator.{phase.name.lower()}", parent=parent
        )

    def phase(self, decision_id: int, phase: ResizePhase, message: str = "") -> None:
        """The resize entered ``phase``: the previous phase's span ends, this one's starts
        (a final phase ends the resize's span)."""
        span = self._resize.get(decision_id)
        if span is None:
            return
        old = self._phase.pop(decision_id, None)
        if old is not None:
            old.end()
        if not phase.final:
            self._start_phase(decision_id, phase)
            return
        span.set_attribute("tide.phase", phase.name)
        if message:
            span.set_attribute("tide.message", message)
        if phase is not ResizePhase.COMPLETED:
            tracing.record_error(span, message or phase.name)
        span.end()
        del self._resize[decision_id]

    def directive(
        self, decision_id: int, kind: str, member: str, generation: int, reason: str
    ) -> None:
        span = self._phase.get(decision_id) or self._resize.get(decision_id)
        if span is not None:
            span.add_event(
                f"directive {kind}",
                {"tide.member": member, "tide.generation": generation, "tide.reason": reason},
            )
