"""Client side of the Tide API: channels with the shared options, TLS and the
admin token, and the one place where a gRPC error becomes a domain error."""

from __future__ import annotations

from pathlib import Path

import grpc

from tidebase import errors
from tidebase.grpc_options import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S, client_options


def open_channel(
    target: str,
    *,
    ca_file: str = "",
    cert_file: str = "",
    key_file: str = "",
    keepalive_time_s: float | None = None,
    keepalive_timeout_s: float | None = None,
) -> grpc.aio.Channel:
    """An aio channel to ``target`` (HOST:PORT). With ``ca_file`` it uses TLS,
    and with ``cert_file``/``key_file`` it presents a client certificate (mTLS)."""
    options = client_options(
        keepalive_time_s=KEEPALIVE_TIME_S if keepalive_time_s is None else keepalive_time_s,
        keepalive_timeout_s=(
            KEEPALIVE_TIMEOUT_S if keepalive_timeout_s is None else keepalive_timeout_s
        ),
    )
    if not ca_file:
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )
    return grpc.aio.secure_channel(target, creds, options=options)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the admin token (empty when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


_FROM_STATUS: dict[grpc.StatusCode, type[errors.TideError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.ABORTED: errors.Conflict,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


def domain_error(exc: grpc.RpcError) -> errors.TideError:
    """The TideError a failed call stands for, so callers above the client never import grpc."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _FROM_STATUS.get(code, errors.TideError)
    return cls(details or code.name)
