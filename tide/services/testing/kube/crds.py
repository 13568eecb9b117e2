"""The two PaddleJob CRDs, as their operators install them (names, scope, short
names, the status subresource); the schemas keep unknown fields, since the
emulator does not validate them."""

from __future__ import annotations

from typing import Any

from tide.services.testing.kube.apiserver import KubeApiServer, ResourceType

PADDLE_OPERATOR = ResourceType(
    "batch.paddlepaddle.org",
    "v1",
    "paddlejobs",
    "PaddleJob",
    short_names=("pdj",),
    status_subresource=True,
    singular="paddlejob",
)
KUBEFLOW = ResourceType(
    "kubeflow.org", "v1", "paddlejobs", "PaddleJob", status_subresource=True, singular="paddlejob"
)
CRD = ResourceType(
    "apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False
)


def crd(t: ResourceType) -> dict[str, Any]:
    names: dict[str, Any] = {"kind": t.kind, "plural": t.plural, "singular": t.singular}
    if t.short_names:
        names["shortNames"] = list(t.short_names)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{t.plural}.{t.group}"},
        "spec": {
            "group": t.group,
            "scope": "Namespaced",
            "names": names,
            "versions": [
                {
                    "name": t.version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def install_paddlejob_crds(api: KubeApiServer, *kinds: ResourceType) -> None:
    """Create the CRDs of ``kinds`` (both when none is named)."""
    for t in kinds or (PADDLE_OPERATOR, KUBEFLOW):
        api.create(CRD, crd(t))
