"""The controllers a chart needs on the emulated cluster: Deployments, DaemonSets, and
cert-manager's Certificates.

- Deployment: ``spec.replicas`` live pods from ``spec.template``, named
  ``NAME-HASH-XXXXX`` with the ``pod-template-hash`` label and an owner reference to
  the Deployment; extra ones are deleted (gracefully), missing or ended ones replaced;
  ``status.replicas`` / ``readyReplicas`` / ``availableReplicas`` kept. Not emulated:
  the ReplicaSet in between and rolling updates (a changed template is not rolled out).
- DaemonSet: one pod per Ready node that ``spec.template.spec.nodeSelector`` selects,
  bound to it (``spec.nodeName``) as the DaemonSet controller does; status
  ``desiredNumberScheduled`` / ``numberReady``. Taints and tolerations: the stand-in
  nodes have none.
- Certificate (cert-manager.io/v1): the Secret ``spec.secretName`` of type
  kubernetes.io/tls with ``tls.crt``, ``tls.key`` and ``ca.crt``, signed by the CA
  the stand-in is given (the issuer the chart names), with the Certificate's
  ``dnsNames``, ``ipAddresses`` and ``uris``; status Ready. No renewal.

One thread, woken by any change of the store, as the operators' stand-ins are.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import json
import logging
import secrets
import tempfile
import threading
from pathlib import Path

from tide.services.common.pki import CertificateAuthority
from tide.services.testing.kube.apiserver import KubeApiServer, now_rfc3339
from tide.services.testing.kube.operators import POD
from tide.services.testing.kube.resources import ResourceType
from tide.services.testing.kube.semantics import ApiError, Obj

logger = logging.getLogger(__name__)

DEPLOYMENT = ResourceType("apps", "v1", "deployments", "Deployment", status_subresource=True)
DAEMONSET = ResourceType("apps", "v1", "daemonsets", "DaemonSet", status_subresource=True)
SECRET = ResourceType("", "v1", "secrets", "Secret")
NODE = ResourceType("", "v1", "nodes", "Node", namespaced=False)
CERTIFICATE = ResourceType(
    "cert-manager.io", "v1", "certificates", "Certificate", status_subresource=True
)

#: cert-manager's Certificate and Issuer, as the CRDs its install creates (only what
#: the emulator reads of them).
CERT_MANAGER_CRDS = tuple(
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.cert-manager.io"},
        "spec": {
            "group": "cert-manager.io",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [
                {"name": "v1", "served": True, "storage": True, "subresources": {"status": {}}}
            ],
        },
    }
    for plural, kind in (("certificates", "Certificate"), ("issuers", "Issuer"))
)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def template_hash(template: Obj) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _owned_by(pod: Obj, uid: str) -> bool:
    return any(r.get("uid") == uid for r in pod["metadata"].get("ownerReferences") or [])


def _live(pod: Obj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get(
        "phase"
    ) not in ("Succeeded", "Failed")


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    )


class Controllers:
    """``start()``, ``stop()``. ``issuer``: the CA that signs Certificates (None: they
    stay pending, as with no cert-manager)."""

    def __init__(self, api: KubeApiServer, issuer: CertificateAuthority | None = None) -> None:
        self.api = api
        self.issuer = issuer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-controllers", daemon=True)

    def start(self) -> Controllers:
        crd_t = self.api.rtype("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        for crd in CERT_MANAGER_CRDS:
            with contextlib.suppress(ApiError):
                self.api.create(crd_t, crd)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        seen = 0
        while not self._stop.is_set() and not self.api.closing:
            seen = self.api.wait_changed(seen, 0.5)
            for step in (self._deployments, self._daemonsets, self._certificates):
                try:
                    step()
                except ApiError as exc:
                    logger.debug("controllers: %s", exc.message)

    # -- workloads --------------------------------------------------------------------------

    def _pod(self, owner: Obj, kind: str, name: str, node: str = "") -> Obj:
        template = copy.deepcopy(owner["spec"]["template"])
        meta = template.setdefault("metadata", {})
        meta["name"] = name
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": kind,
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
            }
        ]
        spec = template.setdefault("spec", {})
        if node:
            spec["nodeName"] = node
        return {"apiVersion": "v1", "kind": "Pod", **template}

    def _reconcile(self, t: ResourceType, owner: Obj, want: dict[str, Obj]) -> None:
        """Pods of ``owner``: create ``want`` (name → pod) where missing, delete the others;
        then its status."""
        ns = owner["metadata"]["namespace"]
        pods = [p for p in self.api.list(POD, ns)[0] if _owned_by(p, owner["metadata"]["uid"])]
        live = {p["metadata"]["name"]: p for p in pods if _live(p)}
        for name, pod in want.items():
            if name not in live:
                with contextlib.suppress(ApiError):  # still terminating under that name
                    self.api.create(POD, pod, ns)
        for name in set(live) - set(want):
            with contextlib.suppress(ApiError):
                self.api.delete(POD, ns, name)
        ready = sum(1 for p in pods if _live(p) and _ready(p))
        if t.kind == "Deployment":
            status: Obj = {
                "replicas": len(live),
                "readyReplicas": ready,
                "availableReplicas": ready,
                "updatedReplicas": len(live),
                "observedGeneration": owner["metadata"].get("generation", 1),
            }
        else:
            status = {
                "desiredNumberScheduled": len(want),
                "currentNumberScheduled": len(live),
                "numberReady": ready,
                "numberAvailable": ready,
                "updatedNumberScheduled": len(live),
                "observedGeneration": owner["metadata"].get("generation", 1),
            }
        if owner.get("status") != {**(owner.get("status") or {}), **status}:
            self.api.update(
                t,
                ns,
                owner["metadata"]["name"],
                lambda cur: {**cur, "status": {**(cur.get("status") or {}), **status}},
                subresource="status",
            )

    def _deployments(self) -> None:
        for d in self.api.list(DEPLOYMENT)[0]:
            if d["metadata"].get("deletionTimestamp"):
                continue
            h = template_hash(d["spec"]["template"])
            ns = d["metadata"]["namespace"]
            uid = d["metadata"]["uid"]
            current = sorted(
                p["metadata"]["name"]
                for p in self.api.list(POD, ns)[0]
                if _owned_by(p, uid) and _live(p)
            )
            n = int(d["spec"].get("replicas", 1))
            names = current[:n]
            while len(names) < n:
                names.append(f"{d['metadata']['name']}-{h}-{secrets.token_hex(3)[:5]}")
            want = {}
            for name in names:
                pod = self._pod(d, "Deployment", name)
                pod["metadata"].setdefault("labels", {})["pod-template-hash"] = h
                want[name] = pod
            self._reconcile(DEPLOYMENT, d, want)

    def _daemonsets(self) -> None:
        nodes = [
            n
            for n in self.api.list(NODE)[0]
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in n.get("status", {}).get("conditions") or []
            )
        ]
        for ds in self.api.list(DAEMONSET)[0]:
            if ds["metadata"].get("deletionTimestamp"):
                continue
            selector = ds["spec"]["template"].get("spec", {}).get("nodeSelector") or {}
            ns, uid = ds["metadata"]["namespace"], ds["metadata"]["uid"]
            by_node = {
                p["spec"].get("nodeName"): p["metadata"]["name"]
                for p in self.api.list(POD, ns)[0]
                if _owned_by(p, uid) and _live(p)
            }
            want = {}
            for node in nodes:
                labels = node["metadata"].get("labels") or {}
                if any(labels.get(k) != v for k, v in selector.items()):
                    continue
                name = by_node.get(node["metadata"]["name"]) or (
                    f"{ds['metadata']['name']}-{secrets.token_hex(3)[:5]}"
                )
                want[name] = self._pod(ds, "DaemonSet", name, node["metadata"]["name"])
            self._reconcile(DAEMONSET, ds, want)

    # -- cert-manager -----------------------------------------------------------------------

    def _certificates(self) -> None:
        if self.issuer is None:
            return
        try:
            certs = self.api.list(CERTIFICATE)[0]
        except ApiError:
            return  # the CRD is not served yet
        for cert in certs:
            ns, spec = cert["metadata"]["namespace"], cert.get("spec") or {}
            with contextlib.suppress(ApiError):
                self.api.get(SECRET, ns, spec["secretName"])
                continue
            self.api.create(SECRET, self._issue(cert), ns)
            ready = {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Ready",
                        "lastTransitionTime": now_rfc3339(),
                    }
                ]
            }
            self.api.update(
                CERTIFICATE,
                ns,
                cert["metadata"]["name"],
                lambda cur, status=ready: {**cur, "status": status},  # type: ignore[misc]
                subresource="status",
            )

    def _issue(self, cert: Obj) -> Obj:
        assert self.issuer is not None
        spec = cert["spec"]
        with tempfile.TemporaryDirectory() as tmp:
            sub = CertificateAuthority(self.issuer.dir)
            sub.dir = Path(tmp)  # the issued pair only; the CA stays where it is
            issued = sub.issue(
                cert["metadata"]["name"],
                uris=tuple(spec.get("uris") or ()),
                hosts=(*(spec.get("dnsNames") or ()), *(spec.get("ipAddresses") or ())),
                server="server auth" in (spec.get("usages") or ["server auth"]),
            )
            crt, key = Path(issued.cert_file).read_bytes(), Path(issued.key_file).read_bytes()
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {
                "name": spec["secretName"],
                "annotations": {"cert-manager.io/certificate-name": cert["metadata"]["name"]},
            },
            "data": {
                "tls.crt": _b64(crt),
                "tls.key": _b64(key),
                "ca.crt": _b64(Path(self.issuer.ca_file).read_bytes()),
            },
        }
