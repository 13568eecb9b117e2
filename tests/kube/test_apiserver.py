"""The API server emulator through the official kubernetes client, unchanged: the
semantics Tide's actuator and watches depend on, each as the real server has them."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tide.services.testing.kube import KubeApiServer

pytestmark = pytest.mark.component

PDJ = ("batch.paddlepaddle.org", "v1", "default", "paddlejobs")
KF = ("kubeflow.org", "v1", "default", "paddlejobs")
JSON_PATCH = "application/json-patch+json"


def paddlejob(name: str, replicas: int, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch.paddlepaddle.org/v1",
        "kind": "PaddleJob",
        "metadata": {"name": name, **meta},
        "spec": {"worker": {"replicas": replicas, "requests": 1, "limits": 4}},
    }


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def test_custom_resources_are_served_under_their_groups(kclient: client.ApiClient) -> None:
    co = client.CustomObjectsApi(kclient)
    co.create_namespaced_custom_object(*PDJ, paddlejob("a", 2))
    kf = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PaddleJob",
        "metadata": {"name": "a"},
        "spec": {"paddleReplicaSpecs": {"Worker": {"replicas": 3}}},
    }
    co.create_namespaced_custom_object(*KF, kf)
    # Same name and kind, two groups: two objects.
    assert co.get_namespaced_custom_object(*PDJ, "a")["spec"]["worker"]["replicas"] == 2
    got = co.get_namespaced_custom_object(*KF, "a")
    assert got["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"] == 3
    with pytest.raises(ApiException) as err:
        co.get_namespaced_custom_object(*PDJ, "missing")
    assert err.value.status == 404
    with pytest.raises(ApiException) as err:
        co.create_namespaced_custom_object(*PDJ, paddlejob("a", 1))
    assert err.value.status == 409


def test_every_write_moves_the_resource_version_and_a_stale_one_is_a_conflict(
    kclient: client.ApiClient,
) -> None:
    co = client.CustomObjectsApi(kclient)
    created = co.create_namespaced_custom_object(*PDJ, paddlejob("a", 2))
    rv = created["metadata"]["resourceVersion"]
    patched = co.patch_namespaced_custom_object(
        *PDJ, "a", {"metadata": {"resourceVersion": rv}, "spec": {"worker": {"replicas": 3}}}
    )
    assert int(patched["metadata"]["resourceVersion"]) > int(rv)
    assert patched["metadata"]["generation"] == 2  # spec changed
    # Merge patch: the other worker fields stay.
    assert patched["spec"]["worker"] == {"replicas": 3, "requests": 1, "limits": 4}
    with pytest.raises(ApiException) as err:
        co.patch_namespaced_custom_object(
            *PDJ, "a", {"metadata": {"resourceVersion": rv}, "spec": {"worker": {"replicas": 4}}}
        )
    assert err.value.status == 409
    # PUT with a stale resourceVersion: 409 too; with the current one it applies.
    stale = {**patched, "metadata": {**patched["metadata"], "resourceVersion": rv}}
    with pytest.raises(ApiException) as err:
        co.replace_namespaced_custom_object(*PDJ, "a", stale)
    assert err.value.status == 409
    patched["spec"]["worker"]["replicas"] = 5
    replaced = co.replace_namespaced_custom_object(*PDJ, "a", patched)
    assert replaced["spec"]["worker"]["replicas"] == 5
    # A patch without a resourceVersion applies to the latest.
    last = co.patch_namespaced_custom_object(*PDJ, "a", {"spec": {"worker": {"replicas": 1}}})
    assert last["spec"]["worker"]["replicas"] == 1


def test_json_patch_and_the_status_subresource(kclient: client.ApiClient) -> None:
    co = client.CustomObjectsApi(kclient)
    co.create_namespaced_custom_object(*PDJ, paddlejob("a", 2))
    out = co.patch_namespaced_custom_object(
        *PDJ,
        "a",
        [
            {"op": "test", "path": "/spec/worker/replicas", "value": 2},
            {"op": "replace", "path": "/spec/worker/replicas", "value": 6},
        ],
        _content_type=JSON_PATCH,
    )
    assert out["spec"]["worker"]["replicas"] == 6
    with pytest.raises(ApiException) as err:
        co.patch_namespaced_custom_object(
            *PDJ,
            "a",
            [{"op": "test", "path": "/spec/worker/replicas", "value": 2}],
            _content_type=JSON_PATCH,
        )
    assert err.value.status == 422
    # The client's default for custom objects is a merge patch, which must be an object.
    with pytest.raises(ApiException) as err:
        co.patch_namespaced_custom_object(*PDJ, "a", [{"op": "remove", "path": "/spec"}])
    assert err.value.status == 400
    # Status goes through its subresource; the main resource ignores it.
    co.patch_namespaced_custom_object(*PDJ, "a", {"status": {"phase": "Running"}})
    assert "status" not in co.get_namespaced_custom_object(*PDJ, "a")
    co.patch_namespaced_custom_object_status(*PDJ, "a", {"status": {"phase": "Running"}})
    got = co.get_namespaced_custom_object(*PDJ, "a")
    assert got["status"] == {"phase": "Running"}
    assert got["metadata"]["generation"] == 2  # status is not a spec change


def test_label_and_field_selectors(kclient: client.ApiClient) -> None:
    core = client.CoreV1Api(kclient)
    core.create_namespace({"metadata": {"name": "ml"}})
    core.create_namespaced_pod("default", pod("a", app="x", tier="1"))
    core.create_namespaced_pod("default", pod("b", app="y"))
    core.create_namespaced_pod("ml", pod("c", app="x"))

    def names(**kw: Any) -> list[str]:
        return sorted(p.metadata.name for p in core.list_pod_for_all_namespaces(**kw).items)

    assert names(label_selector="app=x") == ["a", "c"]
    assert names(label_selector="app!=x") == ["b"]
    assert names(label_selector="app in (x,y),tier") == ["a"]
    assert names(label_selector="app notin (x),!tier") == ["b"]
    assert names(field_selector="metadata.namespace=ml") == ["c"]
    assert names(field_selector="metadata.name!=a,status.phase=Pending") == ["b", "c"]
    with pytest.raises(ApiException) as err:
        core.list_pod_for_all_namespaces(label_selector="app in x")
    assert err.value.status == 400


def test_a_watch_replays_from_a_resource_version_and_gets_410_once_it_is_compacted(
    kube: KubeApiServer, kclient: client.ApiClient
) -> None:
    co = client.CustomObjectsApi(kclient)
    listed = co.list_namespaced_custom_object(*PDJ)
    since = listed["metadata"]["resourceVersion"]
    co.create_namespaced_custom_object(*PDJ, paddlejob("a", 2))
    co.patch_namespaced_custom_object(*PDJ, "a", {"spec": {"worker": {"replicas": 3}}})
    co.delete_namespaced_custom_object(*PDJ, "a")
    w = watch.Watch()
    seen = [
        (e["type"], e["object"]["metadata"]["name"])
        for e in w.stream(
            co.list_namespaced_custom_object, *PDJ, resource_version=since, timeout_seconds=1
        )
    ]
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    kube.compact()
    with pytest.raises(ApiException) as err:
        for _ in watch.Watch().stream(
            co.list_namespaced_custom_object, *PDJ, resource_version=since, timeout_seconds=1
        ):
            pass
    assert err.value.status == 410
    assert kube.stats.gone >= 1


def test_the_bounded_history_expires_old_resource_versions() -> None:
    with KubeApiServer(history=5) as small:
        cfg = client.Configuration()
        cfg.host = small.host
        with client.ApiClient(cfg) as api:
            core = client.CoreV1Api(api)
            since = core.list_namespaced_pod("default").metadata.resource_version
            for i in range(8):
                core.create_namespaced_pod("default", pod(f"p{i}"))
            with pytest.raises(ApiException) as err:
                for _ in watch.Watch().stream(
                    core.list_namespaced_pod, "default", resource_version=since, timeout_seconds=1
                ):
                    pass
            assert err.value.status == 410
            # A fresh list's resourceVersion is watchable again.
            rv = core.list_namespaced_pod("default").metadata.resource_version
            core.delete_namespaced_pod("p0", "default")
            got = [
                e["type"]
                for e in watch.Watch().stream(
                    core.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=1
                )
            ]
            assert got == ["DELETED"]


def test_a_watch_without_resource_version_starts_with_the_current_objects(
    kclient: client.ApiClient,
) -> None:
    core = client.CoreV1Api(kclient)
    core.create_namespaced_pod("default", pod("a", app="x"))
    core.create_namespaced_pod("default", pod("b", app="y"))
    got = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_pod, "default", label_selector="app=x", timeout_seconds=1
        )
    ]
    assert got == [("ADDED", "a")]


def test_injected_conflicts_and_graceful_pod_deletion(
    kube: KubeApiServer, kclient: client.ApiClient
) -> None:
    co = client.CustomObjectsApi(kclient)
    co.create_namespaced_custom_object(*PDJ, paddlejob("a", 2))
    kube.conflict_next("paddlejobs")
    with pytest.raises(ApiException) as err:
        co.patch_namespaced_custom_object(*PDJ, "a", {"spec": {"worker": {"replicas": 3}}})
    assert err.value.status == 409
    co.patch_namespaced_custom_object(*PDJ, "a", {"spec": {"worker": {"replicas": 3}}})
    assert kube.stats.conflicts == 1

    core = client.CoreV1Api(kclient)
    bound = pod("p")
    bound["spec"]["nodeName"] = "n1"
    core.create_namespaced_pod("default", bound)
    core.delete_namespaced_pod("p", "default")
    # Bound to a node: it stays, terminating, until its kubelet deletes it with grace 0.
    p = core.read_namespaced_pod("p", "default")
    assert p.metadata.deletion_timestamp is not None
    core.delete_namespaced_pod("p", "default", grace_period_seconds=0)
    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("p", "default")
    assert err.value.status == 404


def test_events_leases_hpas_and_discovery(kclient: client.ApiClient) -> None:
    core = client.CoreV1Api(kclient)
    core.create_namespaced_event(
        "default",
        {
            "metadata": {"generateName": "a."},
            "involvedObject": {"kind": "PaddleJob", "name": "a", "namespace": "default"},
            "reason": "SuccessfulRescale",
            "message": "New size: 3",
            "type": "Normal",
        },
    )
    evs = core.list_namespaced_event(
        "default", field_selector="involvedObject.name=a,involvedObject.kind=PaddleJob"
    ).items
    assert [e.reason for e in evs] == ["SuccessfulRescale"]
    coord = client.CoordinationV1Api(kclient)
    coord.create_namespaced_lease("default", {"metadata": {"name": "tide"}, "spec": {}})
    assert coord.read_namespaced_lease("tide", "default").metadata.name == "tide"
    hpa = client.AutoscalingV2Api(kclient)
    hpa.create_namespaced_horizontal_pod_autoscaler(
        "default",
        {
            "metadata": {"name": "h"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "batch.paddlepaddle.org/v1",
                    "kind": "PaddleJob",
                    "name": "a",
                },
                "maxReplicas": 4,
            },
        },
    )
    listed = hpa.list_namespaced_horizontal_pod_autoscaler("default").items
    assert listed[0].spec.scale_target_ref.name == "a"
    groups = {g.name for g in client.ApisApi(kclient).get_api_versions().groups}
    assert {"batch.paddlepaddle.org", "kubeflow.org", "autoscaling"} <= groups
    resources = client.CoreV1Api(kclient).get_api_resources().resources
    assert {"pods", "nodes", "events", "namespaces"} <= {r.name for r in resources}
