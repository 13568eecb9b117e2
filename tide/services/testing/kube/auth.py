"""The API server emulator's authentication: bound ServiceAccount tokens (what the
kubelet's TokenRequest gets for a pod's projected token, and for the token it mounts at
/var/run/secrets/kubernetes.io/serviceaccount), TokenReview, and the bearer check of
every request when the server requires one.

Semantics kept from the real API server:

- a token is bound to a ServiceAccount, a set of audiences, an expiry, and the pod (and
  node) it was issued for; a review names ``system:serviceaccount:NS:SA`` and, in
  ``extra``, the pod and node (tide/services/common/tokenreview.py reads them);
- a review with ``spec.audiences`` authenticates only a token issued for one of them,
  and ``status.audiences`` lists the ones that matched; without ``spec.audiences`` the
  API server's own audience is meant;
- a token of a deleted pod stops being valid (:meth:`TokenAuthority.revoke_pod`);
- an expired or unknown token is ``authenticated: false`` with an error, never a 4xx.

Not emulated: signing (tokens are opaque here; nothing in Tide parses them) and RBAC
(every authenticated request is allowed).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from tide.services.common.tokenreview import NODE_CLAIM, POD_CLAIM
from tide.services.testing.kube.semantics import ApiError, Obj

#: The audience of the API server itself (a token with no audience named is for it).
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class BoundToken:
    namespace: str
    service_account: str
    audiences: tuple[str, ...]
    expires_at_s: float
    pod: str = ""
    pod_uid: str = ""
    node: str = ""

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


class TokenAuthority:
    """Issues and reviews tokens; thread-safe. ``admin_token`` is a static token for
    the test's own kubectl (a kubeconfig user), allowed everywhere."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, BoundToken] = {}
        self.admin_token = "admin-" + secrets.token_urlsafe(24)

    def issue(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: tuple[str, ...] = (API_AUDIENCE,),
        ttl_s: float = 3600.0,
        pod: str = "",
        pod_uid: str = "",
        node: str = "",
    ) -> str:
        token = "sa-" + secrets.token_urlsafe(32)
        bound = BoundToken(
            namespace, service_account, audiences, time.time() + ttl_s, pod, pod_uid, node
        )
        with self._lock:
            self._tokens[token] = bound
        return token

    def revoke_pod(self, pod_uid: str) -> None:
        """The pod a token is bound to is gone: its tokens no longer authenticate."""
        with self._lock:
            for token in [t for t, b in self._tokens.items() if b.pod_uid == pod_uid]:
                del self._tokens[token]

    def _bound(self, token: str) -> BoundToken | None:
        with self._lock:
            return self._tokens.get(token)

    def authenticates(self, token: str) -> bool:
        """Whether a bearer token may call the API server (its own audience)."""
        if token == self.admin_token:
            return True
        return self.review_status(token, [API_AUDIENCE]).get("authenticated") is True

    def review_status(self, token: str, audiences: list[str]) -> Obj:
        """The ``status`` of a TokenReview of ``token`` for ``audiences``."""
        bound = self._bound(token)
        if bound is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        if bound.expires_at_s <= time.time():
            return {"authenticated": False, "error": "token has expired"}
        wanted = audiences or [API_AUDIENCE]
        matched = [a for a in wanted if a in bound.audiences]
        if not matched:
            return {
                "authenticated": False,
                "error": "token audiences is invalid for the target audiences",
            }
        extra: dict[str, list[str]] = {}
        if bound.pod:
            extra[POD_CLAIM] = [bound.pod]
            extra["authentication.kubernetes.io/pod-uid"] = [bound.pod_uid]
        if bound.node:
            extra[NODE_CLAIM] = [bound.node]
        return {
            "authenticated": True,
            "audiences": matched,
            "user": {
                "username": bound.username,
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{bound.namespace}",
                    "system:authenticated",
                ],
                "extra": extra,
            },
        }

    def review(self, body: Obj) -> Obj:
        """A created TokenReview: the request with its status (nothing is stored)."""
        spec = body.get("spec") or {}
        token = spec.get("token")
        if not isinstance(token, str) or not token:
            raise ApiError(422, "Invalid", "spec.token: Required value")
        out = {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": self.review_status(token, list(spec.get("audiences") or [])),
        }
        return out
