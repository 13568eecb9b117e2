"""The connection options, defined once: how a command reaches the scaler (or the store).

A command that talks to the scaler takes ``conn: Connection`` and is decorated
with :func:`connection_options`; the decorator adds the flags below to its
signature (after the command's own), and builds the :class:`Connection` from
them. Read commands also get ``--db`` (read the SQL store instead), admin
commands ``--token``. Every flag, env var and default is written here only.

| flag | env | default |
| --- | --- | --- |
| ``--scaler HOST:PORT`` | TIDE_SCALER | 127.0.0.1:50051 |
| ``--db URL`` (read commands) | | (ask the scaler) |
| ``--token T`` (admin commands; prefer ``--token-file``) | TIDE_ADMIN_TOKEN | |
| ``--timeout-s S`` | | 5 |
| ``--tls-ca-file``, ``--tls-client-cert-file``, ``--tls-client-key-file``, ``--token-file`` | TIDE_TLS_CA_FILE, TIDE_TLS_CLIENT_CERT_FILE, TIDE_TLS_CLIENT_KEY_FILE, TIDE_TOKEN_FILE | |
| ``--tls-server-name NAME`` | TIDE_TLS_SERVER_NAME | (the host of ``--scaler``) |
| ``--context NAME`` | TIDE_CONTEXT | the contexts file's current one |

The four files are every Tide client's (tide.base.credentials). The server name is the
CLI's: through ``kubectl port-forward`` the scaler answers on 127.0.0.1 with a
certificate for its Service's names, and the chart sets all five in the scaler's own
pod, so ``kubectl exec deploy/<release>-scaler -- tide ...`` needs no flag.

A context (tide/services/cli/contexts.py, ``tide config use-context``) fills the settings
that no flag or environment variable gave; the defaults above come last.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

from tide.base.credentials import (
    ENV_TLS_CA_FILE,
    ENV_TLS_CLIENT_CERT_FILE,
    ENV_TLS_CLIENT_KEY_FILE,
    ENV_TOKEN_FILE,
    ClientCredentials,
)
from tide.services.cli import contexts
from tide.services.cli.app import run
from tide.services.cli.source import GrpcScaler, SqlHistory

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SCALER = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Connection:
    scaler: str = DEFAULT_SCALER
    timeout_s: float = DEFAULT_TIMEOUT_S
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    token_file: str = ""
    #: The name the scaler's certificate must hold ("": the host of ``scaler``).
    tls_server_name: str = ""
    #: Admin commands only: the bearer token of every call the command makes, unary and
    #: streaming (the channel's, tide/services/cli/source.py), instead of the token file's.
    token: str = ""
    #: Read commands only: read this SQL store instead of asking the scaler.
    db: str = ""

    @property
    def offline(self) -> bool:
        return bool(self.db)

    def scaler_client(self) -> GrpcScaler:
        return GrpcScaler(
            self.scaler,
            token=self.token,
            timeout_s=self.timeout_s,
            credentials=ClientCredentials.of(self),
            server_name=self.tls_server_name,
        )

    def history(self) -> GrpcScaler | SqlHistory:
        """Where the read commands read: the store with ``--db``, else the scaler."""
        return SqlHistory(self.db) if self.db else self.scaler_client()

    def call(self, fn: Callable[[GrpcScaler], Awaitable[T]]) -> T:
        """Connect to the scaler, make one call, and close: an admin command's whole I/O."""

        async def go() -> T:
            async with self.scaler_client() as s:
                return await fn(s)

        return run(go())

    def read(self, fn: Callable[[GrpcScaler | SqlHistory], Awaitable[T]]) -> T:
        """Open the history source, run ``fn`` on it, and close."""

        async def go() -> T:
            async with self.history() as src:
                return await fn(src)

        return run(go())


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


_SCALER = _option(
    "scaler",
    Annotated[
        str,
        typer.Option(
            "--scaler",
            envvar="TIDE_SCALER",
            help="scaler gRPC address HOST:PORT",
            show_default=f"the context's, else {DEFAULT_SCALER}",
        ),
    ],
    "",
)
_CONTEXT = _option(
    "context",
    Annotated[
        str,
        typer.Option(
            "--context",
            envvar=contexts.ENV_CONTEXT,
            help="the connection settings of this context (tide config get-contexts)",
            show_default="the current context",
        ),
    ],
    "",
)
_DB = _option(
    "db",
    Annotated[
        str,
        typer.Option(
            "--db",
            help="read the SQL store at this SQLAlchemy URL instead of asking the scaler (offline)",
        ),
    ],
    "",
)
_TOKEN = _option(
    "token",
    Annotated[
        str,
        typer.Option(
            "--token", envvar="TIDE_ADMIN_TOKEN", help="admin bearer token", show_default=False
        ),
    ],
    "",
)
_TIMEOUT = _option(
    "timeout_s",
    Annotated[float, typer.Option("--timeout-s", min=0.1, help="deadline of each call")],
    DEFAULT_TIMEOUT_S,
)
_TLS = tuple(
    _option(
        name,
        Annotated[str, typer.Option("--" + name.replace("_", "-"), envvar=env, help=what)],
        "",
    )
    for name, env, what in (
        ("tls_ca_file", ENV_TLS_CA_FILE, "CA (PEM) the scaler's certificate chains to: use TLS"),
        ("tls_client_cert_file", ENV_TLS_CLIENT_CERT_FILE, "client certificate (PEM), mTLS"),
        ("tls_client_key_file", ENV_TLS_CLIENT_KEY_FILE, "client key (PEM), mTLS"),
        ("token_file", ENV_TOKEN_FILE, "file holding a bearer token"),
        (
            "tls_server_name",
            "TIDE_TLS_SERVER_NAME",
            "name the scaler's certificate must hold (through a port-forward: its Service's)",
        ),
    )
)


def connection_options(*, db: bool = False, token: bool = False) -> Callable[[F], F]:
    """Give a command the connection flags and call it with ``conn=Connection(...)``.

    ``db``: the command reads history and accepts ``--db``; ``token``: it makes
    admin calls and accepts ``--token``."""
    options = (
        _SCALER,
        *((_DB,) if db else ()),
        *((_TOKEN,) if token else ()),
        _TIMEOUT,
        *_TLS,
        _CONTEXT,
    )
    names = tuple(o.name for o in options)

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        if "conn" not in sig.parameters:
            raise TypeError(f"{fn.__name__}: a command with connection options takes `conn`")
        own = [p for p in sig.parameters.values() if p.name != "conn"]

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            values = {n: kwargs.pop(n) for n in names}
            context = values.pop("context")
            # Flag or environment, then the context, then the default.
            if not all(values[f] for f in contexts.FIELDS):
                for key, value in contexts.settings(context).items():
                    values[key] = values[key] or value
            values["scaler"] = values["scaler"] or DEFAULT_SCALER
            return fn(*args, conn=Connection(**values), **kwargs)

        # typer reads the parameters from the signature: the command's own, then ours.
        command.__signature__ = sig.replace(parameters=[*own, *options])  # type: ignore[attr-defined]
        command.__annotations__ = {
            **{p.name: p.annotation for p in own},
            **{o.name: o.annotation for o in options},
            "return": sig.return_annotation,
        }
        return command  # type: ignore[return-value]

    return wrap
