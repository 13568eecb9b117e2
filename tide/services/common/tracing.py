"""Traces: one per decision, exported over OTLP/gRPC when an endpoint is configured.

The OpenTelemetry API is what the code calls; with no endpoint configured it is
the API's no-op tracer, whose spans cost a few hundred nanoseconds and record
nothing. :func:`configure` installs an SDK provider with a batching OTLP
exporter; the process's entry point calls it once (``--otlp-endpoint``).

The trace context crosses gRPC as W3C ``traceparent`` metadata, on the one call
that carries a decision (the scaler's Resize to the coordinator):
:func:`inject` on the client, :func:`extract` on the server. A per-RPC
instrumentation (opentelemetry-instrumentation-grpc) would also put every
heartbeat, telemetry stream and list call into traces; a decision's trace is
what an SRE wants to read, so the hop is propagated by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NoOpTracerProvider, Span, Tracer, TracerProvider

_provider: TracerProvider = NoOpTracerProvider()
_sdk: Any = None


def configure(service: str, endpoint: str, *, version: str = "") -> None:
    """Export this process's spans to the OTLP/gRPC collector at ``endpoint`` (HOST:PORT,
    plaintext); empty: spans are not recorded."""
    global _provider, _sdk
    if not endpoint:
        _provider, _sdk = NoOpTracerProvider(), None
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"service.name": f"tide-{service}", "service.namespace": "tide"}
    if version:
        attrs["service.version"] = version
    sdk = SdkTracerProvider(resource=Resource.create(attrs))
    sdk.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    _provider, _sdk = sdk, sdk


def shutdown() -> None:
    """Flush what is buffered and stop exporting (at the end of the process)."""
    global _provider, _sdk
    if _sdk is not None:
        _sdk.shutdown()
    _provider, _sdk = NoOpTracerProvider(), None


def force_flush(timeout_s: float = 10.0) -> bool:
    return bool(_sdk.force_flush(int(timeout_s * 1000))) if _sdk is not None else True


def tracer() -> Tracer:
    return _provider.get_tracer("tide")


def start_span(
    name: str,
    *,
    parent: Span | otel_context.Context | None = None,
    new_trace: bool = False,
    start_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Span:
    """A span that the caller ends (``span.end()``): for work that outlives one block, a
    decision or a resize phase. ``parent``: a span, an extracted context, or the current
    one; ``new_trace``: no parent, the first span of a trace."""
    if new_trace:
        ctx: otel_context.Context | None = otel_context.Context()
    elif isinstance(parent, Span):
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = parent
    return tracer().start_span(
        name, context=ctx, start_time=start_ns, attributes=dict(attributes or {})
    )


@contextlib.contextmanager
def current(span: Span) -> Iterator[Span]:
    """``span`` is the current span in the block (children and :func:`inject` see it)."""
    with trace.use_span(span, end_on_exit=False):
        yield span


def inject() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (empty when nothing is traced)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return sorted(carrier.items())


def extract(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The trace context a caller sent in its metadata (an empty one when it sent none)."""
    carrier = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in metadata or ()}
    return propagate.extract(carrier)


def record_error(span: Span, message: str) -> None:
    span.set_status(trace.Status(trace.StatusCode.ERROR, message))
