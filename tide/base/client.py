"""Client side of the Tide API: channels with the shared options, TLS, the bearer
token, and the one place where a gRPC error becomes a domain error."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from tide.base import errors
from tide.base.credentials import NO_CREDENTIALS, ClientCredentials
from tide.base.grpc_options import KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S, client_options


def channel_options(
    *,
    keepalive_time_s: float | None = None,
    keepalive_timeout_s: float | None = None,
    own_subchannels: bool = False,
    extra_options: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    """The channel arguments ``open_channel`` uses: the shared ones of
    tide.base.grpc_options, then ``extra_options``, which override them by name."""
    options = client_options(
        keepalive_time_s=KEEPALIVE_TIME_S if keepalive_time_s is None else keepalive_time_s,
        keepalive_timeout_s=(
            KEEPALIVE_TIMEOUT_S if keepalive_timeout_s is None else keepalive_timeout_s
        ),
    )
    if own_subchannels:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if extra_options:
        options = [(k, v) for k, v in options if k not in extra_options]
        options += list(extra_options.items())
    return options


#: Round robin over the replicas that report SERVING on gRPC health (the overall
#: service, ""): a standby is NOT_SERVING, so calls go to the leader only, and to
#: the new one once it is elected. The client-side analogue of a Kubernetes
#: Service, which routes to ready pods only.
_REPLICAS_SERVICE_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
)


def channel_target(address: str) -> tuple[str, dict[str, Any]]:
    """The gRPC target and channel arguments for ``address``: one HOST:PORT as it is, or
    several comma-separated IP:PORT of one service's replicas (a coordinator and its
    standbys, run without a Kubernetes Service), dialled as one channel that sends
    each call to a replica whose health is SERVING. Raises ConfigError naming a bad
    address."""
    if "," not in address:
        return address, {}
    hosts: list[str] = []
    families: set[int] = set()
    for part in (p.strip() for p in address.split(",")):
        host, sep, port = part.rpartition(":")
        host = host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if not sep or ip is None or not port.isdigit() or not 0 < int(port) <= 65535:
            raise errors.ConfigError(
                f"address list: expected IP:PORT,IP:PORT..., got {part!r} in {address!r}"
            )
        families.add(ip.version)
        hosts.append(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    if len(families) > 1:
        raise errors.ConfigError(f"address list: IPv4 and IPv6 mixed, got {address!r}")
    scheme = "ipv6" if families == {6} else "ipv4"
    return f"{scheme}:{','.join(hosts)}", {"grpc.service_config": _REPLICAS_SERVICE_CONFIG}


class _Token:
    """Adds ``authorization: Bearer <token>`` to every call that has none of its own, unary
    and streaming alike: the channel's literal token (the CLI's ``--token``), else the
    token read from its file at each call (cheap: a stat), so a rotated token is sent from
    the next call on."""

    def __init__(self, credentials: ClientCredentials, token: str = "") -> None:
        self._creds = credentials
        self._token = token

    def details(self, details: Any) -> Any:
        metadata = list(details.metadata or ())
        if any(k.lower() == "authorization" for k, _ in metadata):
            # A call that brings its own token keeps it: the channel's is a default.
            return details
        token = self._token or self._creds.token()
        if not token:
            return details
        metadata.extend(bearer(token))
        return details._replace(metadata=grpc.aio.Metadata(*metadata))


# grpc.aio files each interceptor under the first kind it is an instance of: one class each.
class _UnaryUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _UnaryStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.details(details), request)


class _StreamUnary(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.details(details), requests)


class _StreamStream(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.details(details), requests)


def _token_interceptors(credentials: ClientCredentials, token: str) -> list[Any] | None:
    if not (token or credentials.token_file):
        return None
    return [
        cls(credentials, token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    ]


def open_channel(
    target: str,
    *,
    credentials: ClientCredentials = NO_CREDENTIALS,
    keepalive_time_s: float | None = None,
    keepalive_timeout_s: float | None = None,
    own_subchannels: bool = False,
    extra_options: Mapping[str, Any] | None = None,
    token: str = "",
) -> grpc.aio.Channel:
    """An aio channel to ``target`` (HOST:PORT). With ``credentials.tls_ca_file`` it
    uses TLS, with a client certificate and key it presents them (mTLS), and with a
    token file every call carries the token. ``token``: a bearer token given literally
    (the CLI's ``--token``), which every call, unary or streaming, carries instead of the
    file's.

    ``own_subchannels``: gRPC shares connections, and their reconnect backoff,
    between channels with equal options (its global subchannel pool), so a new
    channel opened to replace one in backoff would inherit that backoff; with
    this set it starts with a connection of its own. ``extra_options``: more
    gRPC channel arguments, overriding the shared ones by name. A comma-separated
    ``target`` is a list of replicas (:func:`channel_target`)."""
    target, replicas = channel_target(target)
    options = channel_options(
        keepalive_time_s=keepalive_time_s,
        keepalive_timeout_s=keepalive_timeout_s,
        own_subchannels=own_subchannels,
        extra_options={**replicas, **(extra_options or {})},
    )
    interceptors = _token_interceptors(credentials, token)
    if not credentials.tls_ca_file:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    c = credentials
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(c.tls_ca_file).read_bytes(),
        private_key=Path(c.tls_client_key_file).read_bytes() if c.tls_client_key_file else None,
        certificate_chain=(
            Path(c.tls_client_cert_file).read_bytes() if c.tls_client_cert_file else None
        ),
    )
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)


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
