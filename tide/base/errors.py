"""The error hierarchy every domain builds on, and its one mapping to gRPC.

Domain modules subclass these (``class DecisionNotFound(NotFound)``) so that a
servicer never chooses a status code itself: :func:`grpc_status_of` does, in
one table. Domain code never imports grpc: nor does this module at import
time, because Paddle workers use these classes and are forked from a parent
that must not have loaded gRPC (it is not fork-safe), and a cold import costs
a worker 0.05-0.15 s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class TideError(Exception):
    """Base of every error Tide raises on purpose. The message is shown to users."""


class InvalidArgument(TideError):
    """The request or configuration is malformed; retrying it unchanged will fail again."""


class NotFound(TideError):
    """The named job, decision, member or checkpoint does not exist."""


class AlreadyExists(TideError):
    """The thing to create exists already."""


class FailedPrecondition(TideError):
    """The request is valid but the system is not in a state to accept it (stale generation...)."""


class Conflict(TideError):
    """A concurrent writer won (version or fencing epoch changed); re-read and retry."""


class Unavailable(TideError):
    """A dependency (database, coordinator, API server) cannot be reached; retry later."""


class StoreUnavailable(Unavailable):
    """The service's own database cannot be reached or written: nothing was done,
    and the same work can run again once the store is back."""


class DeadlineExceeded(TideError):
    """A barrier or a wait ran past its deadline."""


class Unauthenticated(TideError):
    """No or wrong credentials."""


class PermissionDenied(TideError):
    """Credentials are valid but not allowed to do this."""


class ConfigError(InvalidArgument):
    """A setting has a bad value. The message names the setting and the value."""


# Domain class → name of its grpc.StatusCode; the most specific class first.
_STATUS: tuple[tuple[type[TideError], str], ...] = (
    (InvalidArgument, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (AlreadyExists, "ALREADY_EXISTS"),
    (FailedPrecondition, "FAILED_PRECONDITION"),
    (Conflict, "ABORTED"),
    (Unavailable, "UNAVAILABLE"),
    (DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (Unauthenticated, "UNAUTHENTICATED"),
    (PermissionDenied, "PERMISSION_DENIED"),
)


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code a servicer answers with for ``exc``; INTERNAL for anything unplanned."""
    import grpc

    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return grpc.StatusCode[code]
    return grpc.StatusCode.INTERNAL


#: Trailing metadata key naming an UNAVAILABLE's cause; "store": the service answered,
#: its database did not. A client tells that from a service it cannot reach.
CAUSE_KEY = "tide-cause"
STORE_CAUSE = "store"


def trailing_metadata_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a servicer adds to the status of ``exc``: the cause of a store outage."""
    return ((CAUSE_KEY, STORE_CAUSE),) if isinstance(exc, StoreUnavailable) else ()


def is_store_cause(trailing_metadata: object) -> bool:
    """Whether a failed call's trailing metadata names the service's store as the cause."""
    try:
        items = list(trailing_metadata or ())  # type: ignore[call-overload]
    except TypeError:
        return False
    return any(tuple(kv) == (CAUSE_KEY, STORE_CAUSE) for kv in items)
