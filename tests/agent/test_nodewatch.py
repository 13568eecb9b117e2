"""The Node watch with the official kubernetes client against an API emulator over HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from tests.support.poll import eventually, wait_for
from tide.base.retry import Backoff
from tide.services.agent.model import NodeNotice, NoticeKind
from tide.services.agent.nodewatch import NodeView, NodeWatcher, notices_between
from tide.v1 import telemetry_pb2

from .kube_emulator import NodeApi
from .support import RunAgent, Scaler, agent_settings

pytestmark = pytest.mark.component

NODE = "gpu-node-1"


@pytest.fixture
def api() -> Iterator[NodeApi]:
    emulator = NodeApi(NODE)
    emulator.start()
    yield emulator
    emulator.close()


def core_v1(api: NodeApi) -> Any:
    config = k8s.Configuration()
    config.host = api.host
    return k8s.CoreV1Api(k8s.ApiClient(config))


class Collector:
    def __init__(self) -> None:
        self.notices: list[NodeNotice] = []
        self._lock = threading.Lock()

    def __call__(self, notice: NodeNotice) -> None:
        with self._lock:
            self.notices.append(notice)

    def kinds(self) -> list[NoticeKind]:
        with self._lock:
            return [n.kind for n in self.notices]


@pytest.fixture
def watched(api: NodeApi) -> Iterator[tuple[NodeWatcher, Collector]]:
    got = Collector()
    watcher = NodeWatcher(
        core_v1(api), NODE, got, timeout_s=2, read_slack_s=1.0, backoff=Backoff(0.05, 0.2)
    )
    watcher.start()
    yield watcher, got
    api.drop_watches()  # ends the watch the thread is reading, so it stops at once
    watcher.stop(join_s=5.0)


SPOT = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule", "value": "x"}


def test_cordon_termination_taint_and_uncordon(
    api: NodeApi, watched: tuple[NodeWatcher, Collector]
) -> None:
    _, got = watched
    wait_for(lambda: api.watches >= 1, what="first watch")
    assert got.kinds() == []  # a schedulable, untainted node says nothing
    api.update_spec(unschedulable=True)
    wait_for(lambda: got.kinds() == [NoticeKind.CORDONED], what="cordon")
    before = time.time()
    api.update_spec(taints=[SPOT])
    wait_for(lambda: len(got.kinds()) == 2, what="spot notice")
    notice = got.notices[1]
    assert notice.kind is NoticeKind.TERMINATION_NOTICE
    assert "spot-itn" in notice.detail
    assert notice.deadline is not None and before + 119 <= notice.deadline <= time.time() + 121
    api.update_spec(unschedulable=False, taints=[])
    wait_for(lambda: len(got.kinds()) == 3, what="uncordon")
    assert got.kinds()[2] is NoticeKind.UNCORDONED


def test_relists_after_410_and_misses_nothing(
    api: NodeApi, watched: tuple[NodeWatcher, Collector]
) -> None:
    watcher, got = watched
    wait_for(lambda: api.watches >= 1, what="first watch")
    api.update_spec(unschedulable=True)
    wait_for(lambda: got.kinds() == [NoticeKind.CORDONED], what="cordon")
    # History is compacted and the watch is cut: resuming from the old
    # resourceVersion gets 410 Gone, and the watcher must list again.
    api.compact()
    api.update_spec(taints=[{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}])
    api.compact()
    api.drop_watches()
    wait_for(lambda: watcher.relists_on_gone >= 1, what="re-list on 410")
    wait_for(lambda: NoticeKind.TERMINATION_NOTICE in got.kinds(), what="notice after relist")
    # The relist shows the same cordon: no second CORDONED.
    assert got.kinds() == [NoticeKind.CORDONED, NoticeKind.TERMINATION_NOTICE]
    assert api.lists >= 2


def test_a_silent_watch_is_abandoned_by_the_client_timeout(
    api: NodeApi, watched: tuple[NodeWatcher, Collector]
) -> None:
    _, got = watched
    wait_for(lambda: api.watches >= 1, what="first watch")
    api.blackhole = True
    api.drop_watches()  # the next watch connects and then hears nothing
    wait_for(lambda: api.watches >= 2, what="blackholed watch")
    stuck_at = time.monotonic()
    api.blackhole = False
    api.update_spec(unschedulable=True)
    # Read timeout = timeout_s (2) + slack (1): the client gives up and reconnects.
    wait_for(lambda: got.kinds() == [NoticeKind.CORDONED], timeout_s=10, what="recovery")
    assert time.monotonic() - stuck_at <= 2 + 1 + 2


def test_already_cordoned_at_start_and_deleted_node(api: NodeApi) -> None:
    api.update_spec(unschedulable=True)
    got = Collector()
    watcher = NodeWatcher(core_v1(api), NODE, got, timeout_s=2, backoff=Backoff(0.05, 0.2))
    watcher.start()
    try:
        wait_for(lambda: got.kinds() == [NoticeKind.CORDONED], what="cordon at start")
        wait_for(lambda: api.watches >= 1, what="watch")
        api.delete()
        wait_for(lambda: len(got.kinds()) == 2, what="deleted")
        assert got.notices[1].kind is NoticeKind.TERMINATION_NOTICE
        assert got.notices[1].detail == "node deleted"
    finally:
        api.drop_watches()
        watcher.stop(join_s=5.0)


@pytest.mark.parametrize(
    ("prev", "cur", "kinds"),
    [
        (None, NodeView(False, frozenset()), []),
        (None, NodeView(True, frozenset()), [NoticeKind.CORDONED]),
        (NodeView(True, frozenset()), NodeView(True, frozenset()), []),
        (NodeView(True, frozenset()), NodeView(False, frozenset()), [NoticeKind.UNCORDONED]),
        (
            NodeView(False, frozenset()),
            NodeView(True, frozenset({"cloud.google.com/impending-node-termination"})),
            [NoticeKind.CORDONED, NoticeKind.TERMINATION_NOTICE],
        ),
        (
            NodeView(False, frozenset({"karpenter.sh/disrupted"})),
            NodeView(False, frozenset({"karpenter.sh/disrupted"})),
            [],
        ),
    ],
    ids=["quiet", "cordoned-at-start", "still-cordoned", "uncordon", "gce-preempt", "same-taint"],
)
def test_notices_between(prev: NodeView | None, cur: NodeView, kinds: list[NoticeKind]) -> None:
    assert [n.kind for n in notices_between(prev, cur, 100.0)] == kinds


def test_unschedulable_taint_alone_counts_as_cordon() -> None:
    node = k8s.V1Node(
        spec=k8s.V1NodeSpec(
            taints=[k8s.V1Taint(key="node.kubernetes.io/unschedulable", effect="NoSchedule")]
        )
    )
    assert NodeView.of(node) == NodeView(True, frozenset())


async def test_agent_reports_a_spot_notice(
    api: NodeApi, scaler: Scaler, run_agent: RunAgent
) -> None:
    settings = agent_settings(scaler.port, watch_node=True, watch_timeout_s=2)
    r = await run_agent(settings, kube_api=core_v1(api))
    await eventually(lambda: api.watches >= 1, what="watch")
    api.update_spec(taints=[SPOT])

    def notice() -> Any:
        for report in scaler.recorder.received:
            for event in report.events:
                if event.kind == telemetry_pb2.NodeEvent.KIND_TERMINATION_NOTICE:
                    return event
        return None

    event = await eventually(notice, what="termination notice in a report")
    assert "spot-itn" in event.detail and event.HasField("deadline")
    await r.shutdown()
