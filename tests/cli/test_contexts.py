"""`tide config`: contexts in the spirit of kubeconfig. A context fills the connection
settings no flag or environment variable gave; --context (TIDE_CONTEXT) picks another."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.main import app

pytestmark = pytest.mark.unit

runner = CliRunner()


@pytest.fixture
def contexts_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    f = tmp_path / "contexts.yaml"
    monkeypatch.setenv("TIDE_CONTEXTS_FILE", str(f))
    for name in ("TIDE_SCALER", "TIDE_CONTEXT", "TIDE_TLS_CA_FILE", "TIDE_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    return f


def tide(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def seen(**flags: str) -> Connection:
    got: list[Connection] = []

    @connection_options()
    def cmd(conn: Connection) -> None:
        got.append(conn)

    values = {
        "scaler": "", "timeout_s": 5.0, "tls_ca_file": "", "tls_client_cert_file": "",
        "tls_client_key_file": "", "token_file": "", "tls_server_name": "", "context": "",
    }  # fmt: skip
    cmd(**{**values, **flags})
    return got[0]


def test_set_use_and_list(contexts_file: Path, tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    code, out, _ = tide(
        "config", "set-context", "prod", "--scaler", "10.0.0.1:50051",
        "--tls-ca-file", str(ca), "--tls-server-name", "tide-scaler",
    )  # fmt: skip
    assert code == 0 and "context prod set" in out
    assert tide("config", "set-context", "dev", "--scaler", "127.0.0.1:1")[0] == 0
    code, _, err = tide("config", "current-context")
    assert code == 1 and "no current context" in err
    assert tide("config", "use-context", "prod") == (0, "switched to context prod\n", "")
    code, out, _ = tide("config", "get-contexts")
    assert out.splitlines()[1].split() == ["*", "prod", "10.0.0.1:50051", "tide-scaler"]
    code, _, err = tide("config", "use-context", "nope")
    assert code == 2 and "nope" in err
    assert oct(contexts_file.stat().st_mode & 0o777) == "0o600"

    # The current context fills what no flag gave; a flag wins; --context picks another.
    conn = seen()
    assert (conn.scaler, conn.tls_ca_file, conn.tls_server_name) == (
        "10.0.0.1:50051", str(ca.resolve()), "tide-scaler",
    )  # fmt: skip
    assert seen(scaler="h:2").scaler == "h:2"
    dev = seen(context="dev")
    assert (dev.scaler, dev.tls_ca_file) == ("127.0.0.1:1", "")


def test_without_a_file_the_defaults_hold(contexts_file: Path) -> None:
    assert seen().scaler == "127.0.0.1:50051"
    code, _, err = tide("jobs", "--context", "missing")
    assert code == 2 and "'missing' not in" in err
