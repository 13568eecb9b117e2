"""One way to run a Tide service: a grpc.aio server with health, reflection,
Prometheus metrics, TLS/mTLS, the guard (tide.services.common.guard: who may call
what), a plaintext health port for the kubelet's probe, and a graceful shutdown
on SIGTERM.

A service's ``main`` loads its settings, builds its servicers, and calls
:func:`serve`. Tests use :func:`start_server` to get the bound ports.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from tide.base.errors import FailedPrecondition
from tide.base.grpc_options import server_options
from tide.base.listening import listening_line
from tide.services.common.config import CommonSettings
from tide.services.common.guard import Guard, GuardSettings, Role, Rule, TokenReviewer
from tide.services.common.looplag import watch_loop_lag
from tide.services.common.metrics import grpc_server_metrics
from tide.services.common.readiness import LIVENESS, Readiness
from tide.services.common.shedding import ConcurrencyLimit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceSpec:
    """A servicer and how to register it: ``add`` is the generated
    ``add_XServicer_to_server`` and ``name`` the full service name
    (``tide.v1.Scaler``), used by health and reflection."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    metrics_port: int | None
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    _metrics_httpd: Any = None
    guard: Guard | None = None
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING first, so load balancers and probes stop sending
        new work, then let in-flight RPCs finish for up to ``grace_s``."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
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
    rules: Mapping[str, Rule] | None = None,
    admin_methods: frozenset[str] = frozenset(),
    validate: Callable[[Any, str], None] | None = None,
    reviewer: TokenReviewer | None = None,
    registry: CollectorRegistry = REGISTRY,
    options: Sequence[tuple[str, Any]] | None = None,
) -> RunningServer:
    """Start the server. ``rules``: who may call each method (tide.services.common.guard);
    ``admin_methods`` (without a rule of their own) need the admin role; ``validate``
    checks each request's fields; ``reviewer`` checks ServiceAccount tokens.

    Without TLS and without ``insecure`` the server still starts (in-process tests),
    as insecure; processes refuse that at their entry point
    (:meth:`CommonSettings.security_problem`)."""
    insecure = settings.insecure or not settings.tls_cert_file
    if insecure:
        logger.warning(
            "INSECURE: callers without credentials are accepted as anonymous%s;"
            " never run a shared cluster like this (docs/security.md)",
            " (admin calls need the admin token)" if settings.admin_token else "",
        )
    if reviewer is None and settings.token_review:
        from tide.services.common.tokenreview import KubernetesTokenReviewer

        reviewer = KubernetesTokenReviewer(audience=settings.token_audience)
    all_rules: dict[str, Rule] = {m: Rule(role=Role.ADMIN) for m in admin_methods}
    all_rules.update(rules or {})
    guard = Guard(
        GuardSettings(
            insecure=insecure,
            admin_token=settings.admin_token,
            reviewer=reviewer,
            token_kinds=settings.token_kinds(),
        ),
        all_rules,
        validate=validate,
        registry=registry,
    )
    interceptors: list[grpc.aio.ServerInterceptor] = [
        # First, so that refused and shed calls are counted with their status.
        grpc_server_metrics(registry),
        # After the metrics, so a shed call is counted with its RESOURCE_EXHAUSTED.
        ConcurrencyLimit(
            settings.max_inflight_unary_calls, settings.max_inflight_streams, registry
        ),
        guard,
    ]
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

    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    if settings.health_listen:
        # Health alone, plaintext: the kubelet's gRPC probe carries no credentials.
        health_server = grpc.aio.server(options=server_options())
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(settings.health_listen)
        if health_port == 0:
            raise OSError(f"cannot listen on {settings.health_listen}")
        await health_server.start()

    metrics_port: int | None = None
    httpd = None
    if settings.metrics_listen:
        host, _, mport = settings.metrics_listen.rpartition(":")
        httpd, _thread = start_http_server(int(mport), addr=host, registry=registry)
        metrics_port = int(httpd.server_port)
    logger.info(
        "serving %s on port %d%s (metrics %s, health %s)",
        ", ".join(names) or "health",
        port,
        (" with mTLS" if settings.tls_client_ca_file else " with TLS") if creds else "",
        metrics_port if metrics_port is not None else "off",
        health_port if health_port is not None else "on the main port",
    )
    return RunningServer(
        server, port, metrics_port, health_servicer, names, httpd, guard, health_server, health_port
    )


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


def check_port_free(listen: str) -> None:
    """Fail now, in one line, if ``listen`` (HOST:PORT) is taken: a service that would
    only find out at bind time has already migrated its schema and loaded its state
    (a second coordinator started by mistake). Port 0 is always free."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As gRPC binds (SO_REUSEADDR, no SO_REUSEPORT: tide/base/grpc_options.py).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            raise FailedPrecondition(f"cannot listen on {listen}: {exc.strerror}") from None


async def serve(
    settings: CommonSettings,
    services: Sequence[ServiceSpec],
    *,
    rules: Mapping[str, Rule] | None = None,
    admin_methods: frozenset[str] = frozenset(),
    validate: Callable[[Any, str], None] | None = None,
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
    readiness: Readiness | None = None,
    on_bound: Callable[[int], None] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully within the grace period.

    ``background`` coroutines (the scaler's control loop, say)
    run beside the server and are cancelled after it has stopped accepting
    work; ``on_shutdown`` hooks run last (flush, close the database).
    ``readiness`` drives health from the service's dependencies (readiness.py);
    a background task that ends before shutdown is logged at once and turns
    liveness off, so the kubelet restarts a process that stopped working.
    ``on_bound`` is told the bound port before the background tasks start (a
    listen address of port 0 is known only then)."""
    readiness = readiness or Readiness()
    running = await start_server(
        settings, services, rules=rules, admin_methods=admin_methods, validate=validate
    )
    await readiness.bind(running.health, running.service_names)
    # Printed on stdout so scripts and tests can find the bound ports.
    print(listening_line(running.port, running.metrics_port), flush=True)
    if on_bound is not None:
        on_bound(running.port)
    tasks: list[asyncio.Task[None]] = [
        asyncio.create_task(_guarded(fn, readiness), name=getattr(fn, "__qualname__", "task"))
        for fn in (watch_loop_lag, *background)
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
