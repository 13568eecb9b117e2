"""The error hierarchy every domain builds on, and its one mapping to gRPC.

Domain modules subclass these (``class DecisionNotFound(NotFound)``) so that a
servicer never chooses a status code itself: :func:`grpc_status_of` does, in
one table. Domain code never imports grpc.
"""

from __future__ import annotations

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


class DeadlineExceeded(TideError):
    """A barrier or a wait ran past its deadline."""


class Unauthenticated(TideError):
    """No or wrong credentials."""


class PermissionDenied(TideError):
    """Credentials are valid but not allowed to do this."""


class ConfigError(InvalidArgument):
    """A setting has a bad value. The message names the setting and the value."""


_STATUS: tuple[tuple[type[TideError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Conflict, grpc.StatusCode.ABORTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
)


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code a servicer answers with for ``exc``; INTERNAL for anything unplanned."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL
