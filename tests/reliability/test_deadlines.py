"""Reliability catalog T24: every unary call Tide makes carries a deadline.

A call without one waits forever on a peer that accepted the connection and
then stalled (a paused process, a half-open partition): the caller's task hangs
and whatever it holds with it. Streams are the exception by design: they live
for hours and rely on keepalive to notice a dead peer (tide/base/grpc_options.py).

The check reads the source: a call of a unary method of a Tide or gRPC health
service through something named like a stub must pass ``timeout=``. Adding one
without a deadline fails here, before any partition test could catch it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tide.services.agent.podresources import api_pb2
from tide.v1 import coordinator_pb2, scaler_pb2, telemetry_pb2

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: Production code; tests and benches may leave a deadline to pytest's timeout.
CHECKED = ("tide",)


def _unary_methods() -> set[str]:
    names: set[str] = set()
    for module in (scaler_pb2, coordinator_pb2, telemetry_pb2, health_pb2, api_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                if not (m.client_streaming or m.server_streaming):
                    names.add(m.name)
    return names


UNARY = _unary_methods()


def _receiver(node: ast.expr) -> str:
    return ast.unparse(node).lower()


def calls_without_deadline(source: str, path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in UNARY or "stub" not in _receiver(node.func.value):
            continue
        keywords = {k.arg for k in node.keywords}
        # **kwargs may carry it; the function that builds them is checked where it is called.
        if "timeout" not in keywords and None not in keywords:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}(...) has no timeout=")
    return found


def test_the_check_finds_a_call_without_a_deadline() -> None:
    bad = "async def f(self):\n    await self._stub.Heartbeat(req)\n"
    good = "async def f(self):\n    await self._stub.Heartbeat(req, timeout=self.t)\n"
    stream = "def f(stub):\n    return stub.Stream(it)\n"
    assert calls_without_deadline(bad, "x.py") == [
        "x.py:2: self._stub.Heartbeat(...) has no timeout="
    ]
    assert calls_without_deadline(good, "x.py") == []
    assert calls_without_deadline(stream, "x.py") == []


def test_every_unary_call_in_production_code_has_a_deadline() -> None:
    assert {"Heartbeat", "RequestResize", "Check", "Register"} <= UNARY
    problems: list[str] = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            rel = str(path.relative_to(ROOT))
            problems += calls_without_deadline(path.read_text(), rel)
    assert problems == [], "\n".join(problems)
