"""PaddleJobs as the scaler reads them (pure): both kinds' replicas and bounds,
the merge patch, pod identity, HPA targets, policy overrides from annotations,
and the free GPUs of a cluster."""

from __future__ import annotations

from typing import Any

import pytest

from tide.services.scaler.kube.capacity import free_gpus, node_gpus
from tide.services.scaler.kube.paddlejob import (
    KUBEFLOW,
    PADDLE_OPERATOR,
    check_bounds,
    hpa_targets,
    overrides_from,
    pod_index,
    view,
)
from tide.services.scaler.policy import PolicySettings

pytestmark = pytest.mark.unit

BASE = PolicySettings()


def meta(name: str = "j", **annotations: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": "ml",
        "uid": "u1",
        "resourceVersion": "7",
        "annotations": annotations,
    }


def container(gpus: int) -> dict[str, Any]:
    return {"name": "w", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}


def test_paddle_operator_bounds_are_the_workers_requests_and_limits() -> None:
    obj = {
        "metadata": meta(**{"tide.dev/autoscale": "true"}),
        "spec": {
            "worker": {
                "replicas": 3,
                "requests": 2,
                "limits": 6,
                "template": {"spec": {"containers": [container(2), container(1)]}},
            }
        },
    }
    v = view(PADDLE_OPERATOR, obj)
    assert (v.job_id, v.replicas, v.min_replicas, v.max_replicas) == ("ml/j", 3, 2, 6)
    assert v.opted_in and v.gpus_per_replica == 3 and not v.has_metrics
    assert PADDLE_OPERATOR.replicas_patch(4, "7") == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"worker": {"replicas": 4}},
    }


def test_kubeflow_bounds_are_the_elastic_policy_and_metrics_are_noticed() -> None:
    obj = {
        "metadata": meta(**{"tide.dev/autoscale": "TRUE"}),
        "spec": {
            "paddleReplicaSpecs": {
                "Worker": {"replicas": 2, "template": {"spec": {"containers": [container(1)]}}}
            },
            "elasticPolicy": {
                "minReplicas": 1,
                "maxReplicas": 4,
                "metrics": [{"type": "Resource"}],
            },
        },
    }
    v = view(KUBEFLOW, obj)
    assert (v.replicas, v.min_replicas, v.max_replicas, v.has_metrics) == (2, 1, 4, True)
    assert v.opted_in
    assert KUBEFLOW.replicas_patch(3, "9")["spec"] == {
        "paddleReplicaSpecs": {"Worker": {"replicas": 3}}
    }
    assert not view(KUBEFLOW, {"metadata": meta(), "spec": {}}).opted_in


def test_pod_identity_and_hpa_targets() -> None:
    assert pod_index("resnet-worker-12") == 12
    assert pod_index("a-worker-b-worker-3") == 3
    assert pod_index("resnet-ps-0") is None and pod_index("resnet-worker-") is None
    job = view(PADDLE_OPERATOR, {"metadata": meta(), "spec": {"worker": {"replicas": 1}}})

    def hpa(api_version: str, name: str = "j", ns: str = "ml") -> dict[str, Any]:
        ref = {"apiVersion": api_version, "kind": "PaddleJob", "name": name}
        return {"metadata": {"name": "h", "namespace": ns}, "spec": {"scaleTargetRef": ref}}

    assert hpa_targets(hpa("batch.paddlepaddle.org/v1"), job)
    assert not hpa_targets(hpa("kubeflow.org/v1"), job)  # the other kind of the same name
    assert not hpa_targets(hpa("batch.paddlepaddle.org/v1", name="k"), job)
    assert not hpa_targets(hpa("batch.paddlepaddle.org/v1", ns="other"), job)


def test_overrides_from_annotations_are_parsed_and_checked() -> None:
    got = overrides_from(
        {
            "tide.dev/autoscale": "true",
            "tide.dev/cooldown-s": "600",
            "tide.dev/max-step": "2",
            "other.io/cooldown-s": "1",
        },
        BASE,
    )
    assert got.values == {"cooldown_s": 600.0, "max_step": 2} and not got.errors
    bad = overrides_from(
        {
            "tide.dev/cooldown-s": "soon",
            "tide.dev/scale-up-utilization-pct": "120",
            "tide.dev/min-replicas": "1",
            "tide.dev/sustain-s": "90",
        },
        BASE,
    )
    assert bad.values == {"sustain_s": 90.0}
    assert len(bad.errors) == 3
    assert any("cooldown-s='soon'" in e and "not a number" in e for e in bad.errors)
    assert any("0..100" in e for e in bad.errors)
    assert any("min-replicas" in e and "not a policy setting" in e for e in bad.errors)
    # Each fine alone, wrong together: none applies.
    both = overrides_from(
        {"tide.dev/scale-up-utilization-pct": "70", "tide.dev/target-utilization-pct": "75"},
        BASE,
    )
    assert both.values == {} and "together" in both.errors[0]


def test_bounds_must_hold_the_running_replicas() -> None:
    def job(replicas: int, lo: int | None, hi: int | None) -> Any:
        worker: dict[str, Any] = {"replicas": replicas}
        if lo is not None:
            worker["requests"] = lo
        if hi is not None:
            worker["limits"] = hi
        return view(PADDLE_OPERATOR, {"metadata": meta(), "spec": {"worker": worker}})

    assert check_bounds(job(3, 2, 6), BASE) is None
    assert check_bounds(job(3, None, None), BASE) is None  # the scaler's defaults, 2..8
    assert "outside" in (check_bounds(job(7, 2, 6), BASE) or "")
    assert "min <= max" in (check_bounds(job(3, 5, 4), BASE) or "")


def test_free_gpus_count_schedulable_ready_nodes_and_live_bound_pods() -> None:
    def node(name: str, gpus: int, *, cordoned: bool = False, ready: bool = True) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "spec": {"unschedulable": cordoned},
            "status": {
                "allocatable": {"nvidia.com/gpu": str(gpus)},
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    def pod(node_name: str | None, gpus: int, phase: str = "Running") -> dict[str, Any]:
        spec: dict[str, Any] = {"containers": [container(gpus)]}
        if node_name:
            spec["nodeName"] = node_name
        return {"spec": spec, "status": {"phase": phase}}

    nodes = [node("a", 8), node("b", 8, cordoned=True), node("c", 4, ready=False), node("d", 2)]
    assert [node_gpus(n) for n in nodes] == [8, 0, 0, 2]
    pods = [
        pod("a", 3),
        pod("a", 1, "Succeeded"),  # finished: its GPU is free again
        pod("d", 2),
        pod(None, 4, "Pending"),  # waiting for capacity: not subtracted
        pod("b", 1),  # on a cordoned node, which offers nothing anyway
    ]
    assert free_gpus(nodes, pods) == 10 - 3 - 2
    assert free_gpus(nodes, [pod("a", 9), pod("d", 2)]) == 0


def test_each_decision_state_has_its_hpa_style_event() -> None:
    from datetime import UTC, datetime

    from tide.services.scaler.kube.events import decision_event
    from tide.services.scaler.store import DecisionRecord, DecisionState

    fields = {f: None for f in DecisionRecord.__dataclass_fields__}
    base = {
        **fields,
        "id": 7,
        "job_id": "ml/j",
        "from_replicas": 2,
        "to_replicas": 4,
        "reason": "SUSTAINED_HIGH_UTILIZATION",
        "error": "",
        "pause_s": 1.5,
        "created_at": datetime.now(UTC),
    }

    def at(state: DecisionState, **kw: Any) -> Any:
        return decision_event(DecisionRecord(**{**base, "state": state, **kw}), "the detail")

    done = at(DecisionState.COMPLETED)
    assert (done.type, done.reason) == ("Normal", "SuccessfulRescale")
    assert done.message.startswith("New size: 4; reason: SUSTAINED_HIGH_UTILIZATION")
    failed = at(DecisionState.FAILED, error="boom")
    assert (failed.type, failed.reason) == ("Warning", "FailedRescale")
    assert failed.message.endswith("error: boom")
    aborted = at(DecisionState.ABORTED, error="deadline")
    assert (aborted.type, aborted.reason) == ("Warning", "AbortedRescale")
    assert "replicas stay 2" in aborted.message
    for state, reason in (
        (DecisionState.PENDING, "RescaleDecided"),
        (DecisionState.PREPARING, "RescalePreparing"),
        (DecisionState.ACTUATING, "RescaleActuating"),
    ):
        ev = at(state)
        assert (ev.type, ev.reason, ev.message) == (
            "Normal",
            reason,
            "decision 7, 2 -> 4: the detail",
        )
    assert len(at(DecisionState.FAILED, error="x" * 5000).message) == 1024
