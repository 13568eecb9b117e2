"""Events on PaddleJobs, in the shape the HPA controller gives them, so that
``kubectl describe pdj`` tells each decision's story.

The HPA posts ``SuccessfulRescale`` ("New size: N; reason: ...") and
``FailedRescale``; Tide adds one reason per decision state in between, and
Warnings for what it refuses. :func:`decision_event` is pure;
:class:`EventRecorder` posts from a thread of its own, so the event loop never
waits on the API server, and a failed post is logged and counted, never
retried into a storm.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from tide.services.scaler.store import DecisionRecord, DecisionState

logger = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"
COMPONENT = "tide-scaler"

# Reasons for what discovery refuses or cannot read.
AUTOSCALER_CONFLICT = "AutoscalerConflict"
INVALID_ANNOTATION = "InvalidPolicyAnnotation"
INVALID_BOUNDS = "InvalidReplicaBounds"
ADOPTED = "Adopted"
# The coordinator failed the job for good (its workers crashed at every start).
JOB_FAILED = "JobFailed"
RELEASED = "Released"


@dataclass(frozen=True)
class EventSpec:
    type: str
    reason: str
    message: str


_STATE_REASONS: Mapping[DecisionState, tuple[str, str]] = {
    DecisionState.PENDING: (NORMAL, "RescaleDecided"),
    DecisionState.PREPARING: (NORMAL, "RescalePreparing"),
    DecisionState.ACTUATING: (NORMAL, "RescaleActuating"),
    DecisionState.COMPLETED: (NORMAL, "SuccessfulRescale"),
    DecisionState.ABORTED: (WARNING, "AbortedRescale"),
    DecisionState.FAILED: (WARNING, "FailedRescale"),
}


def decision_event(d: DecisionRecord, detail: str) -> EventSpec:
    """The Event of a decision reaching its current state."""
    kind, reason = _STATE_REASONS[d.state]
    head = f"decision {d.id}, {d.from_replicas} -> {d.to_replicas}"
    if d.state is DecisionState.COMPLETED:
        msg = f"New size: {d.to_replicas}; reason: {d.reason}; {head}; pause {d.pause_s:.2f} s"
    elif d.state is DecisionState.FAILED:
        msg = f"New size: {d.to_replicas}; reason: {d.reason}; {head}; error: {d.error or detail}"
    elif d.state is DecisionState.ABORTED:
        msg = f"{head} aborted, replicas stay {d.from_replicas}: {d.error or detail}"
    else:
        msg = f"{head}: {detail}"
    # The API server refuses messages over 1 KiB.
    return EventSpec(kind, reason, msg[:1024])


def failure_event(why: str) -> EventSpec:
    """The Event of a job the coordinator failed for good: the last worker's end and
    the tail of its log (`tide jobs -o json` has the whole of it)."""
    return EventSpec(WARNING, JOB_FAILED, f"the job failed for good: {why}"[:1024])


class EventRecorder:
    """Posts core v1 Events in a background thread; ``posted`` and ``failed`` count them."""

    def __init__(self, api: client.ApiClient, instance: str = "") -> None:
        self._core = client.CoreV1Api(api)
        self.instance = instance or socket.gethostname()
        self.posted = 0
        self.failed = 0
        self._queue: queue.Queue[tuple[dict[str, str], EventSpec] | None] = queue.Queue(1000)
        self._thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)
        self._thread.start()

    def post(self, ref: Mapping[str, str], event: EventSpec) -> None:
        try:
            self._queue.put_nowait((dict(ref), event))
        except queue.Full:
            self.failed += 1
            logger.warning(
                "event recorder: queue full; dropped %s %s", event.reason, ref.get("name")
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Post what is queued (up to ``timeout_s``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ref, ev = item
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            body: Any = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{ref['name']}.", "namespace": ref["namespace"]},
                "involvedObject": ref,
                "reason": ev.reason,
                "message": ev.message,
                "type": ev.type,
                "source": {"component": COMPONENT},
                "reportingComponent": f"tide.dev/{COMPONENT}",
                "reportingInstance": self.instance,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            try:
                self._core.create_namespaced_event(
                    ref["namespace"], body, _request_timeout=10, _preload_content=False
                )
                self.posted += 1
            except Exception as exc:  # the thread must outlive any failure
                self.failed += 1
                logger.warning(
                    "could not post Event %s on %s/%s: %s",
                    ev.reason,
                    ref.get("namespace"),
                    ref.get("name"),
                    exc,
                )
