"""The guard in front of every Tide servicer: parse → authenticate → authorize → validate.

One server interceptor (:class:`Guard`) wraps each method's handler, so a call
reaches a servicer only once

1. its bytes parsed (garbage is INVALID_ARGUMENT, counted, and logged at most
   once every few seconds, never a traceback per request);
2. its caller is known (:func:`authenticate`): a bearer token (the admin token, or
   a Kubernetes ServiceAccount token checked by TokenReview), else the SPIFFE ID in
   the client certificate's SAN, else, only when the server runs ``--insecure``,
   the anonymous caller;
3. the caller may call the method (:class:`Rule`: which kinds of caller, which role
   at least) and speaks only for itself: an agent for its own node, a launcher for
   its own pod of its own job (:func:`check_subject`);
4. its fields are valid (tide.services.common.validate, from the proto descriptors).

The servicer then reads the caller with :func:`caller` (the scaler stores it as a
decision's ``requested_by``). Refusals are UNAUTHENTICATED (no or unknown
credentials) or PERMISSION_DENIED (known, not allowed); the reason is counted in
``tide_guard_refused_total{reason}``.

Identities (docs/security.md), all SPIFFE IDs in the trust domain ``tide``:

- agent: ``spiffe://tide/ns/<ns>/sa/<sa>/node/<node>``
- launcher: ``spiffe://tide/ns/<ns>/sa/<sa>/job/<name>/pod/<pod>`` (job ``<ns>/<name>``)
- scaler: ``spiffe://tide/ns/<ns>/sa/<sa>/scaler``
- user: ``spiffe://tide/ns/<ns>/sa/<sa>/user/<name>/role/<viewer|operator|admin>``
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from tide.base.errors import (
    InvalidArgument,
    PermissionDenied,
    TideError,
    Unauthenticated,
    Unavailable,
)
from tide.services.common import refused_streams
from tide.services.common.rpc import rewrap

logger = logging.getLogger(__name__)

TRUST_DOMAIN = "tide"


class Kind(enum.StrEnum):
    AGENT = "agent"
    LAUNCHER = "launcher"
    SCALER = "scaler"
    USER = "user"
    #: A caller without credentials on a server run ``--insecure``.
    ANONYMOUS = "anonymous"


class Role(enum.IntEnum):
    """Roles on the Scaler API (and on the coordinator's scaler-facing calls); each
    includes the ones below it."""

    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3


@dataclass(frozen=True)
class Identity:
    """Who is calling, as proven by a certificate or a token."""

    kind: Kind
    #: The SPIFFE ID, the ServiceAccount's username, "admin-token" or "anonymous".
    name: str
    role: Role | None = None
    node: str = ""
    job: str = ""
    pod: str = ""
    #: How it was proven: mtls, token, admin-token or insecure.
    via: str = ""

    def __str__(self) -> str:
        return self.name


ANONYMOUS = Identity(Kind.ANONYMOUS, "anonymous", Role.ADMIN, via="insecure")


def spiffe_id(ns: str, sa: str, *path: str) -> str:
    return "/".join((f"spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/{sa}", *path))


def identity_from_spiffe(uri: str, via: str = "mtls") -> Identity | None:
    """The identity a SPIFFE ID names, or None for anything not of Tide's shapes."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix) :].split("/")
    if len(parts) < 5 or parts[0] != "ns" or parts[2] != "sa" or not all(parts):
        return None
    ns, rest = parts[1], parts[4:]
    match rest:
        case ["node", node]:
            return Identity(Kind.AGENT, uri, node=node, via=via)
        case ["job", name, "pod", pod]:
            return Identity(Kind.LAUNCHER, uri, job=f"{ns}/{name}", pod=pod, via=via)
        case ["scaler"]:
            return Identity(Kind.SCALER, uri, via=via)
        case ["user", _name, "role", role] if role.upper() in Role.__members__:
            return Identity(Kind.USER, uri, role=Role[role.upper()], via=via)
    return None


# --- what a request speaks for -----------------------------------------------------------


class Subject(NamedTuple):
    """The node, job and pod a request acts for ("" for what it does not name). A
    tuple: one is built for every message of a request stream (each agent report),
    and a frozen dataclass costs several times as much to build."""

    node: str = ""
    job: str = ""
    pod: str = ""


#: The kinds of caller :func:`check_subject` binds, its gate and the guard's: the others'
#: subject is not read.
BOUND_KINDS = frozenset({Kind.AGENT, Kind.LAUNCHER})


SubjectOf = Callable[[Any], Subject]


def check_subject(who: Identity, subject: Subject) -> None:
    """PermissionDenied unless ``who`` may act for ``subject``: an agent only for its
    node, a launcher only for its pod of its job. Others (not :data:`BOUND_KINDS`) are
    bound by their role."""
    if who.kind not in BOUND_KINDS:
        return
    if who.kind is Kind.AGENT and subject.node and subject.node != who.node:
        raise PermissionDenied(f"{who} speaks for node {who.node!r}, not {subject.node!r}")
    if who.kind is Kind.LAUNCHER:
        if subject.job and subject.job != who.job:
            raise PermissionDenied(f"{who} speaks for job {who.job!r}, not {subject.job!r}")
        if subject.pod and subject.pod != who.pod:
            raise PermissionDenied(f"{who} speaks for pod {who.pod!r}, not {subject.pod!r}")


@dataclass(frozen=True)
class Rule:
    """Who may call one method: these kinds of caller, and users (and the admin token)
    with at least ``role``. ``subject`` reads what a request (each message of a
    request stream) acts for, checked against a node- or pod-bound caller."""

    kinds: frozenset[Kind] = frozenset()
    role: Role | None = None
    subject: SubjectOf | None = None

    def allows(self, who: Identity) -> bool:
        if who.kind is Kind.ANONYMOUS:
            return self.role is None or (who.role is not None and who.role >= self.role)
        if who.kind in self.kinds:
            return True
        return self.role is not None and who.role is not None and who.role >= self.role


#: Health and reflection: any authenticated caller.
OPEN = Rule(frozenset(Kind), Role.VIEWER)


def requested_by(who: Identity, asked: str) -> str:
    """Who a decision records as having asked: the authenticated caller. Only an admin
    may name someone else (``tide scale --as``: a shared admin token or an automation
    acting for a person); everyone else's ``requested_by`` is ignored. An anonymous
    caller (insecure mode) proves nothing, so what it says is kept as said."""
    if who.kind is Kind.ANONYMOUS or (asked and who.role is Role.ADMIN):
        if asked and asked != who.name and who.kind is not Kind.ANONYMOUS:
            logger.info("%s records a decision as requested by %s", who, asked)
        return asked or who.name
    return who.name


# --- tokens ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Review:
    """What a token review said: the ServiceAccount, its pod and node, and until when."""

    authenticated: bool
    username: str = ""
    pod: str = ""
    node: str = ""
    expires_at_s: float = 0.0
    error: str = ""


class TokenReviewer(Protocol):
    """Checks a bearer token (tide.services.common.tokenreview: Kubernetes TokenReview)."""

    async def review(self, token: str) -> Review: ...


def identity_from_review(review: Review, kinds: Mapping[str, str]) -> Identity:
    """The identity of a reviewed ServiceAccount token: ``kinds`` maps
    ``<namespace>/<serviceaccount>`` to agent, launcher, scaler or a user role."""
    prefix = "system:serviceaccount:"
    if not review.username.startswith(prefix):
        raise PermissionDenied(f"{review.username!r} is not a ServiceAccount")
    ns, _, sa = review.username[len(prefix) :].partition(":")
    what = kinds.get(f"{ns}/{sa}", "")
    base = spiffe_id(ns, sa)
    if what == "agent":
        if not review.node:
            raise PermissionDenied(f"{review.username}: the token names no node")
        return Identity(Kind.AGENT, f"{base}/node/{review.node}", node=review.node, via="token")
    if what == "launcher":
        # Operators name pods <job>-<replica type>-<index> (paddle-operator, Kubeflow).
        name = review.pod.rsplit("-", 2)[0] if review.pod.count("-") >= 2 else ""
        if not name:
            raise PermissionDenied(f"{review.username}: the token names no pod of a job")
        return Identity(
            Kind.LAUNCHER,
            f"{base}/job/{name}/pod/{review.pod}",
            job=f"{ns}/{name}",
            pod=review.pod,
            via="token",
        )
    if what == "scaler":
        return Identity(Kind.SCALER, f"{base}/scaler", via="token")
    if what.upper() in Role.__members__:
        return Identity(Kind.USER, base, role=Role[what.upper()], via="token")
    raise PermissionDenied(f"ServiceAccount {ns}/{sa} has no Tide identity")


# --- the interceptor ---------------------------------------------------------------------

_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("tide_caller")


def caller() -> Identity:
    """The authenticated caller of the current call (anonymous outside a guarded call)."""
    return _CALLER.get(ANONYMOUS)


class Malformed:
    """What a request that could not be parsed becomes, instead of an exception."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


class RateLimitedLog:
    """One line per ``every_s`` per key, with how many were held back."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, held = self._last.get(key, (-1e18, 0))
        if now - last < self.every_s:
            self._last[key] = (last, held + 1)
            return
        self._last[key] = (now, 0)
        suffix = f" ({held} more since the last line)" if held else ""
        logger.warning("%s%s", msg % args, suffix)


@dataclass
class GuardSettings:
    insecure: bool = False
    admin_token: str = ""
    reviewer: TokenReviewer | None = None
    #: ``<namespace>/<serviceaccount>`` → agent, launcher, scaler, viewer, operator, admin.
    token_kinds: Mapping[str, str] = field(default_factory=dict)


_MIN_ROLE_WITH_ADMIN_TOKEN = Role.VIEWER


class Guard(grpc.aio.ServerInterceptor):
    """Wraps every handler of the server: parse, authenticate, authorize, validate."""

    def __init__(
        self,
        settings: GuardSettings,
        rules: Mapping[str, Rule],
        *,
        validate: Callable[[Any, str], None] | None = None,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.settings = settings
        self.rules = dict(rules)
        self._validate = validate
        self._admin = f"Bearer {settings.admin_token}".encode() if settings.admin_token else b""
        # In insecure mode with an admin token, the token is what makes a caller admin.
        self._anonymous = (
            Identity(Kind.ANONYMOUS, "anonymous", _MIN_ROLE_WITH_ADMIN_TOKEN, via="insecure")
            if settings.admin_token
            else ANONYMOUS
        )
        self.refused = _refused_counter(registry)
        self.malformed = _malformed_counter(registry)
        self._log = RateLimitedLog()

    # --- authenticate ---

    async def authenticate(self, context: Any, metadata: Iterable[tuple[str, Any]]) -> Identity:
        token = b""
        for key, value in metadata:
            if key == "authorization":
                token = value.encode() if isinstance(value, str) else bytes(value)
                break
        if token:
            return await self._from_token(token)
        uris = _peer_uris(context)
        for uri in uris:
            found = identity_from_spiffe(uri)
            if found is not None:
                return found
        if uris or (not self.settings.insecure and _peer_has_certificate(context)):
            # Authenticated by the CA, but as nobody Tide knows (docs/security.md). An
            # insecure server takes a certificate without any URI as anonymous, as before.
            raise PermissionDenied("the client certificate names no Tide identity")
        if self.settings.insecure:
            return self._anonymous
        raise Unauthenticated("no credentials: present a client certificate or a bearer token")

    async def _from_token(self, header: bytes) -> Identity:
        if self._admin and hmac.compare_digest(header, self._admin):
            return Identity(Kind.USER, "admin-token", Role.ADMIN, via="admin-token")
        scheme, _, token = header.decode(errors="replace").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        reviewer = self.settings.reviewer
        if reviewer is None:
            raise Unauthenticated("bearer token not accepted")
        review = await reviewer.review(token)
        if not review.authenticated:
            raise Unauthenticated("bearer token not accepted: " + (review.error or "rejected"))
        return identity_from_review(review, self.settings.token_kinds)

    # --- the interceptor ---

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        rule = self.rules.get(method, OPEN)
        metadata = tuple(details.invocation_metadata or ())
        if handler.request_streaming:
            return rewrap(
                handler,
                lambda b: self._stream_request(b, method, rule, metadata),
                request_deserializer=_safe(handler.request_deserializer),
            )
        return rewrap(
            handler,
            lambda b: self._unary_request(b, method, rule, metadata),
            request_deserializer=_safe(handler.request_deserializer),
        )

    async def _admit(
        self, context: Any, method: str, rule: Rule, metadata: Any, stream: bool = False
    ) -> Identity:
        try:
            who = await self.authenticate(context, metadata)
        except TideError as exc:
            await self._refuse(context, method, exc, stream)
            raise AssertionError("unreachable") from None
        if not rule.allows(who):
            need = rule.role.name.lower() if rule.role is not None else "another identity"
            msg = f"{who} may not call {method} (needs {need})"
            # An anonymous caller could get in with credentials: that is UNAUTHENTICATED.
            refusal: TideError = (
                Unauthenticated(msg + ": send 'authorization: Bearer <admin token>'")
                if who.kind is Kind.ANONYMOUS
                else PermissionDenied(msg)
            )
            await self._refuse(context, method, refusal, stream)
        return who

    async def _refuse(
        self, context: Any, method: str, exc: TideError, stream: bool = False
    ) -> None:
        code = grpc.StatusCode.PERMISSION_DENIED
        if isinstance(exc, Unauthenticated):
            code = grpc.StatusCode.UNAUTHENTICATED
        elif isinstance(exc, InvalidArgument):
            code = grpc.StatusCode.INVALID_ARGUMENT
        elif isinstance(exc, Unavailable):
            # A subject the service cannot look up now (a standby coordinator): retry.
            code = grpc.StatusCode.UNAVAILABLE
        self.refused.labels(code.name.lower()).inc()
        self._log(f"refused:{method}:{code.name}", "refused %s: %s: %s", method, code.name, exc)
        if stream:
            await refused_streams.drain(context)
        await context.abort(code, str(exc))

    async def _check(self, context: Any, method: str, rule: Rule, who: Identity, req: Any) -> None:
        if isinstance(req, Malformed):
            self.malformed.inc()
            self._log(f"malformed:{method}", "unparseable request to %s: %s", method, req.error)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request could not be parsed: {req.error}"
            )
        try:
            if rule.subject is not None and who.kind in BOUND_KINDS:
                check_subject(who, rule.subject(req))
            if self._validate is not None:
                self._validate(req, method)
        except TideError as exc:
            await self._refuse(context, method, exc)

    def _unary_request(self, behavior: Any, method: str, rule: Rule, metadata: Any) -> Any:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                who = await self._admit(context, method, rule, metadata)
                await self._check(context, method, rule, who, request)
                _CALLER.set(who)
                # Closed here, in this call's context (its log ids are reset in it).
                async with contextlib.aclosing(behavior(request, context)) as gen:
                    async for item in gen:
                        yield item

            return stream

        async def unary(request: Any, context: Any) -> Any:
            who = await self._admit(context, method, rule, metadata)
            await self._check(context, method, rule, who, request)
            _CALLER.set(who)
            return await behavior(request, context)

        return unary

    def _stream_request(self, behavior: Any, method: str, rule: Rule, metadata: Any) -> Any:
        guard = self

        def messages(requests: Any, context: Any, who: Identity) -> AsyncIterator[Any]:
            # Read once, not per message: a report stream's every message passes here.
            subject_of = rule.subject if who.kind in BOUND_KINDS else None
            validate = guard._validate

            async def each() -> AsyncIterator[Any]:
                async for req in requests:
                    if isinstance(req, Malformed):
                        guard.malformed.inc()
                        guard._log(
                            f"malformed:{method}",
                            "unparseable message on %s: %s",
                            method,
                            req.error,
                        )
                        raise DecodeError(req.error)
                    try:
                        if subject_of is not None:
                            check_subject(who, subject_of(req))
                        if validate is not None:
                            validate(req, method)
                    except TideError as exc:
                        await guard._refuse(context, method, exc, stream=True)
                    yield req

            return each()

        if inspect.isasyncgenfunction(behavior):

            async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
                who = await self._admit(context, method, rule, metadata, stream=True)
                _CALLER.set(who)
                async with contextlib.aclosing(
                    behavior(messages(requests, context, who), context)
                ) as gen:
                    async for item in gen:
                        yield item

            return stream

        async def call(requests: Any, context: Any) -> Any:
            who = await self._admit(context, method, rule, metadata, stream=True)
            _CALLER.set(who)
            return await behavior(messages(requests, context, who), context)

        return call


def _peer_uris(context: Any) -> list[str]:
    # grpc puts a client certificate's URI SANs in peer_uri (a certificate without
    # one has none there, nor in its PEM), so there is nothing to parse here.
    try:
        auth = context.auth_context()
    except Exception:
        return []
    return [u.decode() if isinstance(u, bytes) else str(u) for u in auth.get("peer_uri", ())]


def _peer_has_certificate(context: Any) -> bool:
    # A certificate without any URI SAN has no peer_uri, but grpc still gives its PEM.
    try:
        return bool(context.auth_context().get("x509_pem_cert"))
    except Exception:
        return False


_COUNTERS: dict[tuple[int, str], Any] = {}


def _refused_counter(registry: CollectorRegistry) -> Counter:
    key = (id(registry), "refused")
    if key not in _COUNTERS:
        _COUNTERS[key] = Counter(
            "tide_guard_refused_total",
            "Calls refused by the guard, by the status they got.",
            ("code",),
            registry=registry,
        )
    return _COUNTERS[key]  # type: ignore[no-any-return]


def _malformed_counter(registry: CollectorRegistry) -> Counter:
    key = (id(registry), "malformed")
    if key not in _COUNTERS:
        _COUNTERS[key] = Counter(
            "tide_guard_malformed_requests_total",
            "Requests (or stream messages) that could not be parsed.",
            registry=registry,
        )
    return _COUNTERS[key]  # type: ignore[no-any-return]
