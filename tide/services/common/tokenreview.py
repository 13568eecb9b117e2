"""Bound ServiceAccount tokens checked through the Kubernetes TokenReview API.

A projected token (``serviceAccountToken`` volume with ``audience: tide``) names
its ServiceAccount, and in ``status.user.extra`` the pod and node it is bound to
(``authentication.kubernetes.io/pod-name``, ``.../node-name``); the guard turns
that into an identity (tide.services.common.guard.identity_from_review). Reviews are
cached until the token expires (its ``exp`` claim, read only to bound the cache:
the API server is what verifies it), at most ``max_cache_s``, so a stream of
calls costs one review per token. A refused token is cached for a short while so
a client retrying with a bad token does not turn into a flood of reviews.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from tide.services.common.guard import Review

POD_CLAIM = "authentication.kubernetes.io/pod-name"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
#: Bound of one TokenReview call, seconds: without it a call waits on an API server
#: behind a dead path for ever, and with it the RPC being authenticated (reliability
#: catalog T24). A review that times out is a refusal, cached like one.
REVIEW_TIMEOUT_S = 5.0


def token_expiry_s(token: str) -> float:
    """The ``exp`` claim of a JWT (0 if it has none or is not a JWT); not verified."""
    try:
        payload = token.split(".")[1]
        doc = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return float(doc.get("exp", 0))
    except (IndexError, ValueError, TypeError, AttributeError):
        return 0.0


def review_of_status(status: Any) -> Review:
    """A Review from a TokenReview's status (the kubernetes client's model or a dict)."""

    def get(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    if not get(status, "authenticated"):
        return Review(False, error=str(get(status, "error") or "not authenticated"))
    user = get(status, "user") or {}
    extra = get(user, "extra") or {}
    pod = (extra.get(POD_CLAIM) or [""])[0]
    node = (extra.get(NODE_CLAIM) or [""])[0]
    return Review(True, username=str(get(user, "username") or ""), pod=pod, node=node)


class CachedReviewer:
    """A TokenReviewer over ``review_fn`` (blocking: run in a thread), caching each
    answer for the token's lifetime."""

    def __init__(
        self,
        review_fn: Callable[[str], Review],
        *,
        max_cache_s: float = 600.0,
        refused_cache_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._review = review_fn
        self._max_cache_s = max_cache_s
        self._refused_cache_s = refused_cache_s
        self._clock = clock
        self._cache: dict[bytes, tuple[float, Review]] = {}
        self.reviews = 0

    async def review(self, token: str) -> Review:
        # Keyed by a digest: the cache never holds the token itself.
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        self.reviews += 1
        review = await asyncio.to_thread(self._review, token)
        exp = token_expiry_s(token)
        if review.authenticated:
            until = now + self._max_cache_s
            if exp:
                until = min(until, exp)
            if exp and exp <= now:
                review = Review(False, error="token expired")
                until = now + self._refused_cache_s
        else:
            until = now + self._refused_cache_s
        if len(self._cache) > 10_000:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (until, review)
        return review


class KubernetesTokenReviewer(CachedReviewer):
    """TokenReview through the official client, with the in-cluster configuration."""

    def __init__(
        self, *, audience: str, request_timeout_s: float = REVIEW_TIMEOUT_S, **kwargs: Any
    ) -> None:
        from kubernetes import client, config

        config.load_incluster_config()  # type: ignore[no-untyped-call]
        api = client.AuthenticationV1Api()

        def review(token: str) -> Review:
            body = client.V1TokenReview(
                spec=client.V1TokenReviewSpec(token=token, audiences=[audience])
            )
            try:
                status = api.create_token_review(body, _request_timeout=request_timeout_s).status
            except Exception as exc:
                # The reason, never the token: the client's exception holds the request.
                return Review(False, error=f"TokenReview failed: {type(exc).__name__}")
            return review_of_status(status)

        super().__init__(review, **kwargs)
