"""What every Tide service exports: ``tide_build_info`` and the gRPC server metrics.

The gRPC metrics follow go-grpc-prometheus's names and labels, which the
community's dashboards and alerts already use: ``grpc_server_started_total``,
``grpc_server_handled_total`` (by ``grpc_code``) and
``grpc_server_handling_seconds``, each by ``grpc_service``, ``grpc_method`` and
``grpc_type``. No maintained Python library serves grpc.aio (py-grpc-prometheus
has sync interceptors only, and the official grpcio-observability plugin is
experimental and brings the OpenTelemetry metrics SDK to every call), so the
interceptor is here. It costs one dict lookup and a clock read per call, not per
message: a telemetry stream is one call however many reports it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import platform
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any, Final

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, Info

from tide.services.common.rpc import rewrap

#: Buckets of short operations, seconds: an evaluation, a commit, a unary call.
SHORT_BUCKETS_S: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Latency buckets of gRPC calls, seconds: unary calls take milliseconds; streams
#: (telemetry, watches, the coordinator's directives) last minutes to days.
HANDLING_BUCKETS_S: Final = (*SHORT_BUCKETS_S[1:], 60.0, 600.0, 3600.0)


def version() -> str:
    try:
        return metadata.version("tide")
    except metadata.PackageNotFoundError:
        return "unknown"


def register_build_info(registry: CollectorRegistry, service: str) -> None:
    """``tide_build_info{service, version, python, grpc} 1``: which build answers."""
    info = Info("tide_build", "Build of this Tide process (value 1).", registry=registry)
    info.info(
        {
            "service": service,
            "version": version(),
            "python": platform.python_version(),
            "grpc": grpc.__version__,
        }
    )


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name


def _rpc_type(handler: grpc.RpcMethodHandler[Any, Any]) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """Counts calls started and handled (by status code) and times them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("grpc_type", "grpc_service", "grpc_method")
        self.started = Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            labels,
            registry=registry,
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            (*labels, "grpc_code"),
            registry=registry,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its status, seconds.",
            labels,
            buckets=HANDLING_BUCKETS_S,
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kind = _rpc_type(handler)
        service, name = _split(handler_call_details.method)
        labels = (kind, service, name)
        return rewrap(handler, lambda behavior: self._wrap(behavior, labels))

    def _done(self, labels: tuple[str, str, str], started: float, code: str) -> None:
        self.handled.labels(*labels, code).inc()
        self.handling.labels(*labels).observe(time.perf_counter() - started)

    def _wrap(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                self.started.labels(*labels).inc()
                t0 = time.perf_counter()
                code = "OK"
                try:
                    # Closed here, so a cancelled stream's clean-up is inside its timing.
                    async with contextlib.aclosing(behavior(request, context)) as gen:
                        async for item in gen:
                            yield item
                except BaseException as exc:
                    code = _code_of(exc, context)
                    raise
                else:
                    code = _code_of(None, context)
                finally:
                    self._done(labels, t0, code)

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            self.started.labels(*labels).inc()
            t0 = time.perf_counter()
            code = "OK"
            try:
                result = await behavior(request, context)
            except BaseException as exc:
                code = _code_of(exc, context)
                raise
            else:
                code = _code_of(None, context)
            finally:
                self._done(labels, t0, code)
            return result

        return call


def _code_of(exc: BaseException | None, context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The status the call ends with: what the handler set or aborted with, else
    CANCELLED for a cancelled call, UNKNOWN for an escaped exception, OK."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int) and code:
        # grpc.aio reports the code as the core's integer once the call has ended.
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    if exc is None:
        return "OK"
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        return "CANCELLED"
    return "UNKNOWN"


_REGISTERED: dict[int, GrpcServerMetrics] = {}


def grpc_server_metrics(registry: CollectorRegistry) -> GrpcServerMetrics:
    """One interceptor per registry: several servers in one process (tests, the agent's
    edge beside the scaler in local mode) share its series instead of clashing."""
    found = _REGISTERED.get(id(registry))
    if found is None:
        found = _REGISTERED[id(registry)] = GrpcServerMetrics(registry)
    return found
