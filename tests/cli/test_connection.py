"""The connection options are one group, defined once (tide/services/cli/connection.py), and
every command that reaches the scaler has exactly it: same flags, env vars and defaults."""

from __future__ import annotations

from typing import Any

import pytest
import typer

from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.main import app

pytestmark = pytest.mark.unit

READ = ("jobs", "history", "explain", "chart")
ADMIN = ("scale", "pause", "resume")

COMMON = {
    # "": the context's (tide config), else 127.0.0.1:50051 (tide/services/cli/contexts.py).
    "--scaler": ("TIDE_SCALER", ""),
    "--timeout-s": (None, 5.0),
    "--tls-ca-file": ("TIDE_TLS_CA_FILE", ""),
    "--tls-client-cert-file": ("TIDE_TLS_CLIENT_CERT_FILE", ""),
    "--tls-client-key-file": ("TIDE_TLS_CLIENT_KEY_FILE", ""),
    "--token-file": ("TIDE_TOKEN_FILE", ""),
    "--tls-server-name": ("TIDE_TLS_SERVER_NAME", ""),
    "--context": ("TIDE_CONTEXT", ""),
}


def _options(name: str) -> dict[str, Any]:
    # typer's own click types: read them by duck typing.
    group: Any = typer.main.get_command(app)
    command = group.commands[name]
    return {
        p.opts[0]: (p.envvar, p.default)
        for p in command.params
        if p.param_type_name == "option" and p.opts[0] != "--help"
    }


@pytest.mark.parametrize("name", READ)
def test_read_commands_have_the_group_and_db(name: str) -> None:
    opts = _options(name)
    assert {k: opts[k] for k in COMMON} == COMMON
    assert opts["--db"] == (None, "")
    assert "--token" not in opts


@pytest.mark.parametrize("name", ADMIN)
def test_admin_commands_have_the_group_and_token(name: str) -> None:
    opts = _options(name)
    assert {k: opts[k] for k in COMMON} == COMMON
    assert opts["--token"] == ("TIDE_ADMIN_TOKEN", "")
    assert "--db" not in opts


def test_the_decorator_builds_one_connection_from_the_flags() -> None:
    seen: list[Connection] = []

    @connection_options(db=True, token=True)
    def cmd(conn: Connection, job: str) -> str:
        seen.append(conn)
        return job

    out = cmd(
        job="ns/a",
        scaler="h:1",
        db="sqlite://",
        token="t",
        timeout_s=2.0,
        tls_ca_file="ca",
        tls_client_cert_file="",
        tls_client_key_file="",
        token_file="",
        tls_server_name="tide-scaler.tide-system.svc",
        context="",
    )
    assert out == "ns/a"
    assert seen == [
        Connection(
            "h:1", 2.0, "ca", "", "", "", "tide-scaler.tide-system.svc", token="t", db="sqlite://"
        )
    ]
    assert seen[0].offline


def test_a_command_without_conn_is_refused() -> None:
    with pytest.raises(TypeError, match="takes `conn`"):
        connection_options()(lambda job: job)
