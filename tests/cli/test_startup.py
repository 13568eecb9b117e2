"""What every `tide` invocation imports before it does anything (issue 18: the CLI's
start-up cost). A command imports what it needs when it runs: gRPC for a scaler,
SQLAlchemy for --db, rich for a table on a terminal, YAML for -o yaml or -f, the
replay for whatif. Loading the command table must import none of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

#: Modules a command needs only when it runs; each costs tens of milliseconds to import.
DEFERRED = (
    "grpc",
    "sqlalchemy",
    "psycopg",
    "rich",
    "yaml",
    "prometheus_client",
    "tide.services.sim.replay",
    "tide.services.scaler.policy",
    "tide.services.store.db",
)


def test_loading_the_commands_imports_no_command_dependency() -> None:
    code = (
        "import json, sys\n"
        "import tide.services.cli.main\n"
        f"print(json.dumps([m for m in {DEFERRED!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_the_deferred_imports_are_there_when_a_command_runs() -> None:
    # The check above would pass for a module renamed away; this one fails then.
    code = (
        "import json, sys\n"
        "import tide.services.cli.main, tide.services.cli.replaying, tide.services.cli.source\n"
        "import tide.services.cli.source as s\n"
        "s.GrpcScaler('127.0.0.1:1')\n"
        "from tide.services.cli.app import console; console()\n"
        f"print(json.dumps([m for m in {DEFERRED!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(out.stdout))
    assert {"rich", "yaml", "tide.services.sim.replay", "tide.services.scaler.policy"} <= loaded
