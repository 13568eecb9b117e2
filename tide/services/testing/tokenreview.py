"""A TokenReview API with real semantics, for tests: it issues bound ServiceAccount
tokens (JWT-shaped, with ``exp``) and reviews them as the API server does: unknown,
expired or other-audience tokens are not authenticated; a good one names its
ServiceAccount and, in ``extra``, the pod and node it is bound to.

Plug it into the guard as ``CachedReviewer(FakeTokenApi(...))``: the production
``KubernetesTokenReviewer`` is the same cache over the real API. (A Kubernetes API
emulator can replace it behind the same ``review_fn``.)
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from tide.services.common.guard import Review
from tide.services.common.tokenreview import NODE_CLAIM, POD_CLAIM, review_of_status


@dataclass(frozen=True)
class _Bound:
    username: str
    audiences: tuple[str, ...]
    pod: str
    node: str
    expires_at_s: float


def _b64(doc: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")


class FakeTokenApi:
    """``review_fn`` of tide.services.common.tokenreview.CachedReviewer."""

    def __init__(self, audience: str = "tide", clock: Callable[[], float] = time.time) -> None:
        self.audience = audience
        self.clock = clock
        self._tokens: dict[str, _Bound] = {}
        self.calls = 0

    def issue(
        self,
        namespace: str,
        service_account: str,
        *,
        pod: str = "",
        node: str = "",
        ttl_s: float = 3600.0,
        audience: str = "tide",
    ) -> str:
        exp = self.clock() + ttl_s
        token = ".".join(
            (
                _b64({"alg": "RS256"}),
                _b64({"exp": int(exp), "aud": [audience], "sub": service_account}),
                secrets.token_urlsafe(16),
            )
        )
        user = f"system:serviceaccount:{namespace}:{service_account}"
        self._tokens[token] = _Bound(user, (audience,), pod, node, exp)
        return token

    def revoke(self, token: str) -> None:
        """The bound object (the pod) is gone: its tokens stop being valid."""
        self._tokens.pop(token, None)

    def __call__(self, token: str) -> Review:
        self.calls += 1
        bound = self._tokens.get(token)
        if bound is None:
            return review_of_status({"authenticated": False, "error": "invalid bearer token"})
        if bound.expires_at_s <= self.clock():
            return review_of_status({"authenticated": False, "error": "token has expired"})
        if self.audience not in bound.audiences:
            return review_of_status({"authenticated": False, "error": "token audiences mismatch"})
        extra = {}
        if bound.pod:
            extra[POD_CLAIM] = [bound.pod]
        if bound.node:
            extra[NODE_CLAIM] = [bound.node]
        return review_of_status(
            {"authenticated": True, "user": {"username": bound.username, "extra": extra}}
        )
