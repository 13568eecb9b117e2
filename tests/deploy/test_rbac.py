"""The chart's RBAC: exactly the scaler's rules of issue 10, each with its reason; the
agent's own Node; for the coordinator TokenReview alone (issue 11: it checks its
callers' tokens, as the scaler does); no wildcard, pods/exec or secrets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.chart import (
    EXAMPLES,
    NAMESPACE,
    PRODUCTION,
    SMALL,
    HelmFailed,
    Rendered,
    helm,
    render,
    template_args,
)

pytestmark = pytest.mark.component

Rule = tuple[str, str, str]  # (apiGroup, resource, verb)

SCALER_RULES: set[Rule] = {
    *{
        (g, "paddlejobs", v)
        for g in ("batch.paddlepaddle.org", "kubeflow.org")
        for v in ("get", "list", "watch", "patch")
    },
    *{("", "pods", v) for v in ("get", "list", "watch", "delete")},
    *{("", "nodes", v) for v in ("get", "list", "watch")},
    *{(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")},
    *{("autoscaling", "horizontalpodautoscalers", v) for v in ("list", "watch")},
    # The trust bundle: the CA copied into each training namespace (issue 32).
    *{("", "configmaps", v) for v in ("get", "create", "patch")},
}
TOKEN_REVIEW: Rule = ("authentication.k8s.io", "tokenreviews", "create")
SCALER_RULES.add(TOKEN_REVIEW)
AGENT_RULES: set[Rule] = {("", "nodes", v) for v in ("get", "list", "watch")}


def rules(role: dict[str, Any]) -> set[Rule]:
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def roles_bound_to(rendered: Rendered, account: str) -> dict[str, list[dict[str, Any]]]:
    """Role name -> the bindings that grant it to the ServiceAccount ``account``."""
    bound: dict[str, list[dict[str, Any]]] = {}
    for b in rendered.all("ClusterRoleBinding") + rendered.all("RoleBinding"):
        for s in b["subjects"]:
            if s == {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}:
                bound.setdefault(b["roleRef"]["name"], []).append(b)
    return bound


def granted(rendered: Rendered, account: str) -> set[Rule]:
    names = roles_bound_to(rendered, account)
    roles = [
        r
        for r in rendered.all("ClusterRole") + rendered.all("Role")
        if r["metadata"]["name"] in names
    ]
    assert {r["metadata"]["name"] for r in roles} == set(names), "a binding names a missing role"
    return set().union(*(rules(r) for r in roles)) if roles else set()


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_each_account_gets_exactly_its_rules(values: Path) -> None:
    rendered = render(values)
    accounts = {sa["metadata"]["name"] for sa in rendered.all("ServiceAccount")}
    assert accounts == {"tide-scaler", "tide-coordinator", "tide-agent"}
    assert granted(rendered, "tide-scaler") == SCALER_RULES
    assert granted(rendered, "tide-agent") == AGENT_RULES
    assert granted(rendered, "tide-coordinator") == {TOKEN_REVIEW}
    # ...and each workload runs as its own account.
    for kind, name in (
        ("Deployment", "tide-scaler"),
        ("Deployment", "tide-coordinator"),
        ("DaemonSet", "tide-agent"),
    ):
        assert rendered.pod(kind, name)["serviceAccountName"] == name


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_no_wildcard_no_exec_no_secrets(values: Path) -> None:
    rendered = render(values)
    for role in rendered.all("ClusterRole") + rendered.all("Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], role["metadata"]["name"]
            assert not {"secrets", "pods/exec", "pods/attach", "pods/portforward"} & set(
                rule["resources"]
            )


@pytest.mark.parametrize("values", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_every_rule_says_why(values: Path) -> None:
    """The line before each rule is a comment (the reason), in the rendered manifests."""
    text = helm(*template_args([values]))
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*- apiGroups:", line)]
    assert len(starts) == 11  # the scaler's nine, the agent's one, TokenReview
    for i in starts:
        assert lines[i - 1].strip().startswith("#"), lines[i]


def test_watched_namespaces_limit_the_job_rules_to_them() -> None:
    rendered = render(PRODUCTION)
    watched = ["ml-research", "ml-prod"]
    bound = roles_bound_to(rendered, "tide-scaler")
    # What the scaler does to PaddleJobs and Events: in the watched namespaces only.
    jobs = bound["tide-scaler-jobs"]
    assert [b["kind"] for b in jobs] == ["RoleBinding", "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in jobs) == sorted(watched)
    # What it reads to know the free GPUs: cluster-wide (other tenants' pods hold GPUs).
    (capacity,) = bound["tide-scaler-capacity"]
    assert capacity["kind"] == "ClusterRoleBinding"
    # Without watched namespaces, cluster-wide only as an explicit choice.
    with pytest.raises(HelmFailed, match=r"rbac\.clusterWide"):
        render(SMALL, sets={"scaler.watchNamespaces": "null"})
    wide = render(SMALL, sets={"scaler.watchNamespaces": "null", "rbac.clusterWide": "true"})
    bound = roles_bound_to(wide, "tide-scaler")
    assert {b["kind"] for bs in bound.values() for b in bs} == {"ClusterRoleBinding"}


def test_several_scaler_replicas_may_use_their_lease_and_no_other() -> None:
    rendered = render(PRODUCTION, sets={"scaler.replicas": "2"})
    lease = {("coordination.k8s.io", "leases", v) for v in ("get", "update", "create")}
    assert granted(rendered, "tide-scaler") == SCALER_RULES | lease
    (binding,) = roles_bound_to(rendered, "tide-scaler")["tide-scaler-leader-election"]
    # In the release namespace only, and get/update of its own Lease by name.
    assert (binding["kind"], binding["metadata"]["namespace"]) == ("RoleBinding", NAMESPACE)
    role = rendered.one("Role", "tide-scaler-leader-election")
    named = [r for r in role["rules"] if "update" in r["verbs"]]
    assert [r["resourceNames"] for r in named] == [["tide-scaler"]]
    # One replica: no lease, no rule for it.
    assert not rendered_has_role(render(PRODUCTION), "tide-scaler-leader-election")


def rendered_has_role(rendered: Rendered, name: str) -> bool:
    return any(r["metadata"]["name"] == name for r in rendered.all("Role"))
