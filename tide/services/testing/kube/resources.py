"""The resource types the API server emulator serves: what a type is (group, version,
plural, kind, scope, short names, status subresource), the built-in table, and the
types a CustomResourceDefinition declares.

Its own room because this is the part that grows with each kind Tide starts to use
(a ConfigMap, a Lease, an HPA): a new row here, with no change to the store, the
watches or the HTTP edge that serve every type alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from tide.services.testing.kube.semantics import Obj


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    status_subresource: bool = False
    singular: str = ""

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def api_prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


BUILTINS = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",)),
    ResourceType("", "v1", "nodes", "Node", namespaced=False, short_names=("no",)),
    ResourceType("", "v1", "pods", "Pod", short_names=("po",), status_subresource=True),
    ResourceType("", "v1", "events", "Event", short_names=("ev",)),
    ResourceType("", "v1", "services", "Service", short_names=("svc",)),
    # The scaler's trust bundle (tide/services/scaler/kube/trust.py); what pods mount.
    ResourceType("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease"),
    # What a chart installs (tide/services/testing/kube/chartrun.py): stored and served;
    # Deployments and DaemonSets get pods from controllers.py, Secrets and ConfigMaps
    # become files in pods (sandbox.py). RBAC and NetworkPolicies are stored, not enforced.
    ResourceType("", "v1", "secrets", "Secret"),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    ResourceType("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",)),
    ResourceType(
        "apps", "v1", "deployments", "Deployment", short_names=("deploy",), status_subresource=True
    ),
    ResourceType(
        "apps", "v1", "daemonsets", "DaemonSet", short_names=("ds",), status_subresource=True
    ),
    ResourceType("batch", "v1", "jobs", "Job", status_subresource=True),
    ResourceType(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",)
    ),
    ResourceType(
        "networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False
    ),
    ResourceType(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
    # Create-only: answered by auth.py's review, never stored (as the real API server does).
    ResourceType("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", namespaced=False),
    ResourceType(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        status_subresource=True,
    ),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
    ),
)


def crd_resource_types(crd: Obj) -> list[ResourceType]:
    """The types a CustomResourceDefinition serves: one for each served version."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    out: list[ResourceType] = []
    for v in spec.get("versions", []):
        if not v.get("served", True):
            continue
        out.append(
            ResourceType(
                spec["group"],
                v["name"],
                names["plural"],
                names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames", [])),
                status_subresource="status" in (v.get("subresources") or {}),
                singular=names.get("singular", ""),
            )
        )
    return out
