"""Servicer glue: domain errors become gRPC statuses here, and only here; and every
line logged while a call runs carries the ids its request names (``job_id``,
``decision_id``, ``member_id`` as ``member``, ``node_name`` as ``node``)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar, cast

import grpc

from tide.base.errors import TideError, grpc_status_of, trailing_metadata_of
from tide.services.common import logs

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: Request fields whose value is a log id (tide.services.common.logs), by the id's key.
_REQUEST_IDS = (
    ("job_id", "job_id"),
    ("decision_id", "decision_id"),
    ("member", "member_id"),
    ("node", "node_name"),
)


def _ids_of(request: Any) -> dict[str, Any]:
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    return {key: getattr(request, name) for key, name in _REQUEST_IDS if name in fields}


def rpc_errors(fn: F) -> F:
    """Decorate an async servicer method (unary or streaming) so a TideError aborts
    the call with the mapped status and the error's message; anything else is logged
    with its traceback and reported as INTERNAL without leaking internals."""
    if inspect.isasyncgenfunction(fn):
        gen_fn = cast(Callable[..., AsyncIterator[Any]], fn)

        @functools.wraps(fn)
        async def stream_wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            with logs.bound(**_ids_of(request)):
                try:
                    async for item in gen_fn(self, request, context):
                        yield item
                except TideError as exc:
                    await context.abort(grpc_status_of(exc), str(exc), trailing_metadata_of(exc))
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception:
                    logger.exception("unhandled error in %s", fn.__qualname__)
                    await context.abort(
                        grpc.StatusCode.INTERNAL, "internal error; see the server log"
                    )

        return cast(F, stream_wrapper)

    coro_fn = cast(Callable[..., Coroutine[Any, Any, Any]], fn)

    @functools.wraps(fn)
    async def unary_wrapper(self: Any, request: Any, context: Any) -> Any:
        with logs.bound(**_ids_of(request)):
            try:
                return await coro_fn(self, request, context)
            except TideError as exc:
                await context.abort(grpc_status_of(exc), str(exc), trailing_metadata_of(exc))
            except (grpc.aio.AbortError, grpc.aio.UsageError):
                raise
            except Exception:
                logger.exception("unhandled error in %s", fn.__qualname__)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")

    return cast(F, unary_wrapper)


def rewrap(
    handler: grpc.RpcMethodHandler[Any, Any],
    wrap: Callable[[Any], Any],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with its behaviour replaced by ``wrap(behaviour)``, of the same RPC
    kind: what every server interceptor that runs code around a call (metrics,
    shedding, the guard) needs, since grpc.aio offers no hook around the behaviour."""
    codec = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **codec)
    return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **codec)
