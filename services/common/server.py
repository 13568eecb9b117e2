"""One way to run a Tide service: a grpc.aio server with health, reflection,
Prometheus metrics, optional TLS/mTLS, a bearer token on admin RPCs, and a
graceful shutdown on SIGTERM.

A service's ``main`` loads its settings, builds its servicers, and calls
:func:`serve`. Tests use :func:`start_server` to get the bound ports.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from services.common.config import CommonSettings
from services.common.metrics import grpc_server_metrics
from services.common.readiness import LIVENESS, Readiness
from services.common.shedding import ConcurrencyLimit
from tidebase.grpc_options import server_options
from tidebase.listening import listening_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceSpec:
    """A servicer and how to register it: ``add`` is the generated
    ``add_XServicer_to_server`` and ``name`` the full service name
    (``tide.v1.Scaler``), used by health and reflection."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str


class _AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """Admin methods need ``authorization: Bearer <token>``; others pass through."""

    def __init__(self, token: str, admin_methods: frozenset[str]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._admin = admin_methods

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method not in self._admin:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_b, self._expected):
            return await continuation(handler_call_details)
        method = handler_call_details.method

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            logger.warning("refused admin call %s: missing or wrong bearer token", method)
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} is an admin call: send 'authorization: Bearer <token>'",
            )

        return grpc.unary_unary_rpc_method_handler(deny)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    metrics_port: int | None
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    _metrics_httpd: Any = None

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING first, so load balancers and probes stop sending
        new work, then let in-flight RPCs finish for up to ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()


def _credentials(settings: CommonSettings) -> grpc.ServerCredentials | None:
    if not settings.tls_cert_file:
        return None
    key = Path(settings.tls_key_file).read_bytes()
    cert = Path(settings.tls_cert_file).read_bytes()
    ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


async def start_server(
    settings: CommonSettings,
    services: Sequence[ServiceSpec],
    *,
    admin_methods: frozenset[str] = frozenset(),
    registry: CollectorRegistry = REGISTRY,
    options: Sequence[tuple[str, Any]] | None = None,
) -> RunningServer:
    # First, so that refused admin calls are counted with their UNAUTHENTICATED.
    interceptors: list[grpc.aio.ServerInterceptor] = [
        grpc_server_metrics(registry),
        # After the metrics, so a shed call is counted with its RESOURCE_EXHAUSTED.
        ConcurrencyLimit(
            settings.max_inflight_unary_calls, settings.max_inflight_streams, registry
        ),
    ]
    if settings.admin_token:
        interceptors.append(_AdminTokenInterceptor(settings.admin_token, admin_methods))
    elif admin_methods:
        logger.warning("no admin_token set: admin RPCs are open to every caller")
    server = grpc.aio.server(
        interceptors=interceptors,
        options=list(options) if options is not None else server_options(),
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(s.name for s in services)
    for spec in services:
        spec.add(spec.servicer, server)
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    creds = _credentials(settings)
    port = (
        server.add_secure_port(settings.listen, creds)
        if creds is not None
        else server.add_insecure_port(settings.listen)
    )
    if port == 0:
        raise OSError(f"cannot listen on {settings.listen}")
    await server.start()
    for name in ("", *names, LIVENESS):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    metrics_port: int | None = None
    httpd = None
    if settings.metrics_listen:
        host, _, mport = settings.metrics_listen.rpartition(":")
        httpd, _thread = start_http_server(int(mport), addr=host, registry=registry)
        metrics_port = int(httpd.server_port)
    logger.info(
        "serving %s on port %d%s (metrics %s)",
        ", ".join(names) or "health",
        port,
        " with TLS" if creds else "",
        metrics_port if metrics_port is not None else "off",
    )
    return RunningServer(server, port, metrics_port, health_servicer, names, httpd)


async def wait_for_signal(
    stop: asyncio.Event | None = None, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """Return when one of ``signals`` arrives (or ``stop`` is set)."""
    loop = asyncio.get_running_loop()
    event = stop or asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, event.set)
    try:
        await event.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def serve(
    settings: CommonSettings,
    services: Sequence[ServiceSpec],
    *,
    admin_methods: frozenset[str] = frozenset(),
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    readiness: Readiness | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully within the grace period.

    ``background`` coroutines (the scaler's control loop, say)
    run beside the server and are cancelled after it has stopped accepting
    work; ``on_shutdown`` hooks run last (flush, close the database).
    ``readiness`` drives health from the service's dependencies (readiness.py);
    a background task that ends before shutdown is logged at once and turns
    liveness off, so the kubelet restarts a process that stopped working."""
    readiness = readiness or Readiness()
    running = await start_server(settings, services, admin_methods=admin_methods)
    await readiness.bind(running.health, running.service_names)
    # Printed on stdout so scripts and tests can find the bound ports.
    print(listening_line(running.port, running.metrics_port), flush=True)
    tasks: list[asyncio.Task[None]] = [
        asyncio.create_task(_guarded(fn, readiness), name=getattr(fn, "__qualname__", "task"))
        for fn in background
    ]
    try:
        await wait_for_signal()
        logger.info("shutting down: grace period %.1f s", settings.grace_period_s)
    finally:
        await running.stop(settings.grace_period_s)
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("background task failed during shutdown")
        for hook in on_shutdown:
            await hook()


async def _guarded(fn: Callable[[], Coroutine[Any, Any, None]], readiness: Readiness) -> None:
    """Run a background task; if it ends on its own, say so now, not at shutdown."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        await fn()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("background task %s died; the service is not healthy", name)
        await readiness.mark_dead(f"background task {name} died: {exc}")
    else:
        logger.error("background task %s returned; the service is not healthy", name)
        await readiness.mark_dead(f"background task {name} returned")
