"""Overload shedding: a bound on calls in flight, and a clear answer past it.

grpc.aio queues every call it accepts; under a flood (a DaemonSet of agents
reconnecting at once after a scaler restart, a runaway script calling the CLI)
that queue grows without bound and every caller slows down together. Past
its bound a server here answers at once with RESOURCE_EXHAUSTED and retry advice:
the ``grpc-retry-pushback-ms`` trailer, which gRPC's own retry policy honours,
and the delay in the message for callers that read it.

Unary calls and streams are bounded apart: a stream (an agent's telemetry, a
launcher's directives, a watch) holds its slot for hours, a unary call for
milliseconds, so one bound would let streams starve every short call. Health
and reflection are never shed: a probe must answer most of all under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from tide.services.common.rpc import rewrap

#: Methods of these services are never shed (probes, tooling).
EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

#: Advised wait before a shed call is tried again, milliseconds: long enough for
#: a burst of short calls to drain, short against an agent's report interval.
RETRY_PUSHBACK_MS = 1000

#: How long a refused client stream is given to deliver its first message, seconds.
FIRST_MESSAGE_WAIT_S = 0.5

_SHED: dict[int, Counter] = {}


def _shed_counter(registry: CollectorRegistry) -> Counter:
    found = _SHED.get(id(registry))
    if found is None:
        found = Counter(
            "tide_grpc_shed_total",
            "Calls refused with RESOURCE_EXHAUSTED because the server was at its bound"
            " of calls in flight, by kind (unary, stream).",
            ("kind",),
            registry=registry,
        )
        for kind in ("unary", "stream"):
            found.labels(kind)
        _SHED[id(registry)] = found
    return found


class ConcurrencyLimit(grpc.aio.ServerInterceptor):
    """At most ``max_unary`` unary calls and ``max_streams`` streaming calls in flight."""

    def __init__(
        self, max_unary: int, max_streams: int, registry: CollectorRegistry = REGISTRY
    ) -> None:
        self.limits = {"unary": max_unary, "stream": max_streams}
        self.inflight = {"unary": 0, "stream": 0}
        self._shed = _shed_counter(registry)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        streaming = handler.request_streaming or handler.response_streaming
        kind = "stream" if streaming else "unary"
        return rewrap(handler, lambda behavior: self._wrap(behavior, kind))

    async def _refuse(
        self, kind: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self._shed.labels(kind).inc()
        if hasattr(request, "__anext__"):
            # A client stream writes first (an agent's first report). Refused before
            # that write lands, the client's send fails and its call ends INTERNAL
            # ("Internal error from Core"), hiding the answer and its advice; read
            # the first message (briefly) so the refusal is what the client sees.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(anext(request), FIRST_MESSAGE_WAIT_S)
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"server busy: {self.limits[kind]} {kind} calls in flight, its bound; "
            f"retry in {RETRY_PUSHBACK_MS / 1000:g} s with backoff",
        )

    def _wrap(self, behavior: Any, kind: str) -> Any:
        # The check and the count happen in the call's own task, on the event loop:
        # no other call runs between them, so the bound is exact.
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                if self.inflight[kind] >= self.limits[kind]:
                    await self._refuse(kind, request, context)
                self.inflight[kind] += 1
                try:
                    # Closed here, not left to the garbage collector: the handler's own
                    # clean-up runs before the slot is given back.
                    async with contextlib.aclosing(behavior(request, context)) as gen:
                        async for item in gen:
                            yield item
                finally:
                    self.inflight[kind] -= 1

            return stream

        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if self.inflight[kind] >= self.limits[kind]:
                await self._refuse(kind, request, context)
            self.inflight[kind] += 1
            try:
                return await behavior(request, context)
            finally:
                self.inflight[kind] -= 1

        return call
