"""Watches this agent's own Node for cordon and termination/spot taints.

Runs the official kubernetes client (blocking) on a thread of its own and
hands notices to the agent through ``on_notice``, which must be thread-safe.
List, then watch from the list's resourceVersion; every watch has a
server-side ``timeout_seconds`` and a client-side ``_request_timeout`` (a dead
connection would otherwise hang the watch for ever, kubernetes-client/python
#1402); a 410 Gone means our resourceVersion was compacted away, so re-list;
any other failure reconnects after a jittered exponential backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tide.base.retry import Backoff
from tide.services.common.clock import Clock, SystemClock
from tide.services.common.logs import with_context

from .model import NodeNotice, NoticeKind

logger = logging.getLogger(__name__)

#: Taints that mean "this node is going away", and how long it usually has
#: (seconds from when we see the taint; None: unknown).
TERMINATION_TAINTS: Mapping[str, tuple[float | None, str]] = {
    # cluster-autoscaler is about to delete the node (scale-down).
    "ToBeDeletedByClusterAutoscaler": (None, "cluster-autoscaler scale-down"),
    # AWS Node Termination Handler: a spot interruption notice gives 2 minutes.
    "aws-node-termination-handler/spot-itn": (120.0, "AWS spot interruption"),
    "aws-node-termination-handler/asg-lifecycle-termination": (None, "AWS ASG termination"),
    "aws-node-termination-handler/scheduled-maintenance": (None, "AWS scheduled maintenance"),
    # GKE: preemptible and spot VMs get about 30 s of graceful shutdown.
    "cloud.google.com/impending-node-termination": (30.0, "GCE preemption or termination"),
    # Karpenter (v1 and pre-v1) is disrupting the node.
    "karpenter.sh/disrupted": (None, "Karpenter disruption"),
    "karpenter.sh/disruption": (None, "Karpenter disruption"),
    # The cloud provider reports the instance shut down / an operator marked it out of service.
    "node.cloudprovider.kubernetes.io/shutdown": (0.0, "cloud instance shut down"),
    "node.kubernetes.io/out-of-service": (0.0, "node out of service"),
}


@dataclass(frozen=True)
class NodeView:
    """What we track of a Node: cordoned or not, and its termination taints."""

    unschedulable: bool
    termination_taints: frozenset[str]

    @staticmethod
    def of(node: Any) -> NodeView:
        spec = node.spec
        taints = (spec.taints or []) if spec is not None else []
        keys = {t.key for t in taints}
        # `kubectl cordon` sets spec.unschedulable; the node lifecycle controller then adds
        # the node.kubernetes.io/unschedulable taint. Either one means cordoned.
        cordoned = bool(spec is not None and spec.unschedulable) or (
            "node.kubernetes.io/unschedulable" in keys
        )
        return NodeView(cordoned, frozenset(k for k in keys if k in TERMINATION_TAINTS))


GONE = NodeView(False, frozenset())


def notices_between(prev: NodeView | None, cur: NodeView, now: float) -> list[NodeNotice]:
    """Notices for going from ``prev`` (None: the agent just started) to ``cur``."""
    notices: list[NodeNotice] = []
    before = prev or GONE
    if cur.unschedulable and not before.unschedulable:
        notices.append(NodeNotice(NoticeKind.CORDONED, now, "spec.unschedulable"))
    elif before.unschedulable and not cur.unschedulable and prev is not None:
        notices.append(NodeNotice(NoticeKind.UNCORDONED, now, "spec.unschedulable"))
    for key in sorted(cur.termination_taints - before.termination_taints):
        after_s, what = TERMINATION_TAINTS[key]
        deadline = now + after_s if after_s is not None else None
        notices.append(NodeNotice(NoticeKind.TERMINATION_NOTICE, now, f"{key}: {what}", deadline))
    return notices


class NodeWatcher:
    def __init__(
        self,
        api: Any,
        node_name: str,
        on_notice: Callable[[NodeNotice], None],
        *,
        timeout_s: int = 60,
        read_slack_s: float = 15.0,
        backoff: Backoff | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``api`` is a kubernetes.client.CoreV1Api."""
        self._api = api
        self._node = node_name
        self._log = with_context(logger, node=node_name)
        self._on_notice = on_notice
        self._timeout_s = timeout_s
        self._read_slack_s = read_slack_s
        self._backoff = backoff or Backoff(0.5, 30.0)
        self._clock = clock or SystemClock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._view: NodeView | None = None
        self._watch: Any = None
        self.lists = 0
        self.watches = 0
        self.relists_on_gone = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 2.0) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        # The thread may sit in a read until _request_timeout; it is a daemon.
        self._thread.join(join_s)

    def _observe(self, node: Any | None) -> None:
        now = self._clock.now()
        if node is None:
            # Deleted (or never there): it is going away, whatever its spec said.
            notices = (
                [NodeNotice(NoticeKind.TERMINATION_NOTICE, now, "node deleted")]
                if self._view is not None and self._view is not GONE
                else []
            )
            self._view = GONE
        else:
            cur = NodeView.of(node)
            notices = notices_between(self._view, cur, now)
            self._view = cur
        for notice in notices:
            self._log.warning("%s (%s)", notice.kind.name, notice.detail)
            self._on_notice(notice)

    def _list(self) -> str:
        self.lists += 1
        nodes = self._api.list_node(
            field_selector=f"metadata.name={self._node}",
            _request_timeout=(5, 15),
        )
        self._observe(nodes.items[0] if nodes.items else None)
        return str(nodes.metadata.resource_version)

    def _watch_from(self, resource_version: str) -> str:
        from kubernetes import watch

        self.watches += 1
        self._watch = w = watch.Watch()  # type: ignore[no-untyped-call]
        rv = resource_version
        for event in w.stream(  # type: ignore[no-untyped-call]
            self._api.list_node,
            field_selector=f"metadata.name={self._node}",
            resource_version=rv,
            timeout_seconds=self._timeout_s,
            # The read timeout must outlast the server's timeout_seconds, or a quiet
            # watch would be cut short; connect fast or not at all.
            _request_timeout=(5, self._timeout_s + self._read_slack_s),
            allow_watch_bookmarks=True,
        ):
            if self._stop.is_set():
                break
            kind = event["type"]
            obj = event["object"]
            rv = w.resource_version or rv
            if kind in ("ADDED", "MODIFIED"):
                self._observe(obj)
            elif kind == "DELETED":
                self._observe(None)
            self._backoff.reset()
        return rv

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch_from(rv)
            except ApiException as exc:
                if exc.status == 410:
                    # Our resourceVersion is older than what the API server keeps.
                    self.relists_on_gone += 1
                    self._log.info("watch expired (410 Gone); re-listing")
                    rv = None
                    continue
                self._retry(f"API error {exc.status} {exc.reason}")
                rv = None
            except Exception as exc:  # urllib3 timeouts, connection resets, bad JSON
                self._retry(repr(exc))
                rv = None

    def _retry(self, why: str) -> None:
        delay = self._backoff.next_delay_s()
        self._log.warning("node watch failed (%s); retrying in %.1f s", why, delay)
        self._stop.wait(delay)
