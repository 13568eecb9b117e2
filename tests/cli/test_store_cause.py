"""Issue 30: `tide` says the scaler's database is down, not "scaler unreachable", when
the scaler answered UNAVAILABLE for its store."""

from __future__ import annotations

import grpc
import pytest

from tide.base import errors
from tide.services.cli.source import GrpcScaler

pytestmark = pytest.mark.unit


def _failed(trailing: tuple[tuple[str, str], ...], details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        details=details,
    )


def test_a_store_outage_is_marked_on_the_status() -> None:
    assert errors.trailing_metadata_of(errors.StoreUnavailable("db down")) == (
        (errors.CAUSE_KEY, errors.STORE_CAUSE),
    )
    assert errors.trailing_metadata_of(errors.Unavailable("standby")) == ()


async def test_the_cli_names_the_scalers_database() -> None:
    scaler = GrpcScaler("127.0.0.1:1")
    exc = _failed(
        errors.trailing_metadata_of(errors.StoreUnavailable("x")),
        "create decision: database unavailable after 5 attempts",
    )
    err = await scaler._error(exc)
    assert isinstance(err, errors.StoreUnavailable)
    assert "its database is down" in str(err)
    assert "unreachable" not in str(err)


async def test_rpc_errors_sends_the_cause_with_the_status() -> None:
    from tide.services.common.rpc import rpc_errors

    class Context:
        aborted: tuple[object, ...] = ()

        async def abort(self, *args: object) -> None:
            self.aborted = args

    class Servicer:
        @rpc_errors
        async def Call(self, request: object, context: object) -> None:
            raise errors.StoreUnavailable("decision store: database unavailable")

    ctx = Context()
    await Servicer().Call(object(), ctx)
    code, _details, trailing = ctx.aborted
    assert code is grpc.StatusCode.UNAVAILABLE
    assert errors.is_store_cause(trailing), trailing
